import gzip
import json
import sys

import pytest

from transformer.config import DataConfig
from transformer.data import DataError, load_split, read_lines


def _write(folder, name, lines, gz=True, raw=None):
    data = raw if raw is not None else "".join(line + "\n" for line in lines).encode("utf-8")
    path = folder / (name + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_local_gz_and_plain_files(tmp_path):
    _write(tmp_path, "train.de", ["Hallo Welt", "Ein Hund"])
    _write(tmp_path, "train.en", ["Hello world", "A dog"], gz=False)
    corpus = load_split(DataConfig(path=str(tmp_path)), "train")
    assert corpus.src == ["Hallo Welt", "Ein Hund"] and corpus.tgt == ["Hello world", "A dog"]


def test_lines_split_on_newline_only(tmp_path):
    # U+2028 and U+0085 are line breaks for str.splitlines, not for a parallel corpus.
    _write(tmp_path, "train.de", ["eins\u2028zwei", "drei\x85vier", "fünf"])
    _write(tmp_path, "train.en", ["one two", "three four", "five"])
    corpus = load_split(DataConfig(path=str(tmp_path)), "train")
    assert len(corpus) == 3 and corpus.src[1] == "drei\x85vier" and corpus.tgt[2] == "five"


def test_mismatched_line_counts_name_both_files(tmp_path):
    _write(tmp_path, "train.de", ["a", "b", "c"])
    _write(tmp_path, "train.en", ["a", "b"])
    with pytest.raises(DataError, match=r"train\.de\.gz has 3 lines but .*train\.en\.gz has 2"):
        load_split(DataConfig(path=str(tmp_path)), "train")


def test_missing_file_and_unknown_language(tmp_path):
    _write(tmp_path, "train.de", ["a"])
    _write(tmp_path, "train.en", ["a"])
    with pytest.raises(DataError, match=r"no file val\.de\.gz"):
        load_split(DataConfig(path=str(tmp_path)), "val")
    with pytest.raises(DataError, match=r"no file train\.xx.*languages present for split 'train': de, en"):
        load_split(DataConfig(path=str(tmp_path), src_lang="xx"), "train")


def test_empty_split(tmp_path):
    _write(tmp_path, "train.de", [])
    _write(tmp_path, "train.en", [])
    with pytest.raises(DataError, match="is empty"):
        load_split(DataConfig(path=str(tmp_path)), "train")


def test_invalid_utf8_names_the_line(tmp_path):
    path = _write(tmp_path, "x.de", [], gz=False, raw=b"ok\nalso ok\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"x\.de, line 3: not valid UTF-8"):
        read_lines(path)


def test_huggingface_translation_column_from_local_json(tmp_path):
    pytest.importorskip("datasets")
    rows = [{"translation": {"en": f"hello {i}", "ro": f"salut {i}"}} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(hf_dataset="json", data_files={"train": str(tmp_path / "train.jsonl")}, src_lang="en",
                      tgt_lang="ro")
    corpus = load_split(data, "train")
    assert corpus.src[3] == "hello 3" and corpus.tgt[3] == "salut 3"  # the direction asked for
    import logging  # the hub's retry warnings are printed by its own handler, not a second time by ours
    assert not logging.getLogger("huggingface_hub").propagate and not logging.getLogger("datasets").propagate
    wrong = DataConfig(hf_dataset="json", data_files={"train": str(tmp_path / "train.jsonl")}, src_lang="en",
                       tgt_lang="de")
    with pytest.raises(DataError, match="translation column has languages en, ro, not de"):
        load_split(wrong, "train")


def test_huggingface_two_columns_from_local_csv(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "v.csv").write_text("de,en\nHallo,Hello\nHund,Dog\n")
    data = DataConfig(hf_dataset="csv", data_files={"val": str(tmp_path / "v.csv")})
    corpus = load_split(data, "val")
    assert corpus.src == ["Hallo", "Hund"] and corpus.tgt == ["Hello", "Dog"]
    with pytest.raises(DataError, match="no column fr; columns are de, en"):
        load_split(DataConfig(hf_dataset="csv", data_files={"val": str(tmp_path / "v.csv")}, tgt_lang="fr"), "val")


def test_falls_back_to_huggingface_when_the_folder_is_missing(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "t.csv").write_text("de,en\nHallo,Hello\n")
    data = DataConfig(path=str(tmp_path / "missing"), hf_dataset="csv", data_files={"train": str(tmp_path / "t.csv")})
    assert load_split(data, "train").tgt == ["Hello"]


def test_a_hub_dataset_without_the_datasets_package_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    data = DataConfig(path="../no/such/multi30k", hf_dataset="bentrevett/multi30k")
    with pytest.raises(DataError, match=r"data.hf_dataset 'bentrevett/multi30k' \(data.path \.\./no/such/multi30k "
                                        r"does not exist\): loading it needs the datasets package: pip install "
                                        r"datasets"):
        load_split(data, "train")


def test_an_unreachable_hub_is_one_clear_error_naming_the_missing_folder(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'bentrevett/multi30k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    data = DataConfig(path="../no/such/multi30k", hf_dataset="bentrevett/multi30k")
    with pytest.raises(DataError, match=r"bentrevett/multi30k: cannot load split 'train' from the Hugging Face hub: "
                                        r"Couldn't reach .* the local data.path \.\./no/such/multi30k \(here: /.*\) "
                                        r"does not exist: set data.path"):
        load_split(data, "train")

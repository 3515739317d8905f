from pathlib import Path

import pytest
import yaml

from transformer.config import ConfigError, config_from_dict, load_config, save_config

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path, raw) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


BASE = {"data": {"path": "somewhere"}, "model": {"d_model": 32, "n_heads": 4}}


@pytest.mark.parametrize("name", ["multi30k_de_en.yaml", "multi30k_en_de.yaml"])
def test_recipes_load(name):
    config = load_config(ROOT / "configs" / name)
    assert config.model.src_vocab_size == config.data.vocab_size
    assert config.training.warmup_steps > 0


def test_unknown_key_suggests_the_closest(tmp_path):
    raw = {**BASE, "training": {"warmup_step": 10}}
    message = r"c\.yaml: training\.warmup_step: unknown key; did you mean training\.warmup_steps"
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, raw))


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="trainig: unknown section; did you mean training"):
        load_config(_write(tmp_path, {**BASE, "trainig": {}}))


@pytest.mark.parametrize("section, key, value, message", [
    ("training", "max_steps", "many", "expected an integer"),
    ("training", "max_steps", 0, "must be a positive integer"),
    ("training", "warmup_steps", 0, "must be a positive integer"),
    ("training", "label_smoothing", 1.5, r"must be in \[0, 1\)"),
    ("data", "max_tokens_per_batch", -5, "must be a positive integer"),
    ("data", "spm_model_type", "wordpiece", "must be 'bpe' or 'unigram'"),
    ("model", "n_heads", 3, "divisible"),
    ("model", "norm_first", "yes", "expected true or false"),
    ("decoding", "beam_size", 0, "must be a positive integer"),
])
def test_bad_values_name_the_key(tmp_path, section, key, value, message):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    raw.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=rf"{section}\.{'d_model' if key == 'n_heads' else key}.*{message}"):
        load_config(_write(tmp_path, raw))


def test_overrides_are_parsed_as_yaml_and_validated(tmp_path):
    path = _write(tmp_path, BASE)
    config = load_config(path, ["training.max_steps=7", "model.norm_first=true", "data.path=/x"])
    assert config.training.max_steps == 7 and config.model.norm_first is True and config.data.path == "/x"
    with pytest.raises(ConfigError, match=r"with --set training\.max_step=7: training\.max_step: unknown key"):
        load_config(path, ["training.max_step=7"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(path, ["max_steps"])
    with pytest.raises(ConfigError, match=r"section among .*; did you mean training\.max_steps\?$"):
        load_config(path, ["trainin.max_steps=7"])


def test_full_sharing_needs_joint_vocabulary(tmp_path):
    raw = {**BASE, "model": {**BASE["model"], "share_all_embeddings": True},
           "data": {"path": "x", "joint_vocab": False}}
    with pytest.raises(ConfigError, match="needs one joint vocabulary"):
        load_config(_write(tmp_path, raw))
    raw["model"]["share_all_embeddings"] = False  # tying target embedding and output projection stays allowed
    assert load_config(_write(tmp_path, raw)).model.tie_embeddings


def test_data_max_len_above_the_position_encodings_is_refused_naming_both_keys(tmp_path):
    path = _write(tmp_path, BASE)
    max_positions = load_config(path).model.max_positions
    assert load_config(path, [f"data.max_len={max_positions}"]).data.max_len == max_positions
    with pytest.raises(ConfigError, match=f"data.max_len: {max_positions + 1} tokens is more than "
                                          f"model.max_positions={max_positions}"):
        load_config(path, [f"data.max_len={max_positions + 1}", f"data.max_tokens_per_batch={max_positions + 1}"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_saved_config_round_trips(tmp_path):
    config = load_config(ROOT / "configs" / "multi30k_de_en.yaml")
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config
    assert config_from_dict(config.to_dict()) == config


def test_one_pad_id_for_model_loss_batching_and_decoding():
    """The pad id is not a model setting that could disagree with the loss and the decoder: one constant."""
    import dataclasses

    import torch

    from transformer.config import PAD_ID, TransformerConfig
    from transformer.model import Transformer
    assert "pad_id" not in {f.name for f in dataclasses.fields(TransformerConfig)}
    with pytest.raises(TypeError):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, pad_id=5)
    model = Transformer(TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=8, n_heads=2, d_ff=16,
                                          n_encoder_layers=1, n_decoder_layers=1))
    assert model.src_key_padding_mask(torch.tensor([[4, 5, PAD_ID]])).tolist() == [[False, False, True]]
    assert torch.count_nonzero(model.encoder.embedding.embedding.weight[PAD_ID]) == 0


def test_option_error_spells_its_parameters_and_keeps_other_text():
    from transformer.config import OptionError

    err = OptionError("{compile} works on float32 models, not with {quantization}; see runs/{a}/x.pt",
                      compile=True, quantization="int8")
    assert str(err) == "compile=True works on float32 models, not with quantization='int8'; see runs/{a}/x.pt"
    assert err.as_flags() == "--compile works on float32 models, not with --quantization int8; see runs/{a}/x.pt"
    assert OptionError("{max_len_a}: must be >= 0", max_len_a=-1.0).as_flags() == "--max-len-a -1.0: must be >= 0"


def test_a_relative_data_path_is_recorded_absolute_and_an_old_relative_one_resumes(tmp_path, monkeypatch,
                                                                                     multi30k_subset):
    """`evaluate --split` of a checkpoint reads the training folder's data from wherever it runs."""
    from tests.conftest import write_small_config
    from transformer.training.checkpoint import check_resume_config
    from transformer.training.init_from import run_config

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    path = write_small_config(tmp_path, Path("../..") / multi30k_subset.relative_to(tmp_path.parent))
    recorded, _ = run_config(path, [], tmp_path / "run", None, False)
    assert recorded.data.path == str(multi30k_subset.resolve())
    monkeypatch.chdir(tmp_path)
    assert load_config(path).data.path != recorded.data.path  # read elsewhere, the relative path means another folder
    monkeypatch.chdir(tmp_path / "work")
    old_run = load_config(path)  # what a run recorded before paths were made absolute
    check_resume_config({"config": old_run.to_dict(), "vocab_sizes": [old_run.model.src_vocab_size,
                                                                       old_run.model.tgt_vocab_size]},
                        recorded, tmp_path / "last.pt")
    elsewhere = load_config(path, ["data.path=/nowhere"])
    with pytest.raises(ConfigError, match="data.path"):
        check_resume_config({"config": elsewhere.to_dict(), "vocab_sizes": [8000, 8000]}, recorded, tmp_path / "l")


# ---- recipes built on recipes (base:) ----------------------------------------------------------------------------


def _recipe(folder: Path, name: str, raw: dict) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_recipe_merges_its_bases_mappings_and_replaces_their_lists_and_values(tmp_path):
    _recipe(tmp_path, "sub/root.yaml", {**BASE, "data": {"path": "somewhere", "directions": ["de-en", "en-de"],
                                                         "max_len": 50}, "training": {"max_steps": 9}})
    _recipe(tmp_path, "middle.yaml", {"base": "sub/root.yaml", "data": {"max_len": 40, "vocab_size": 500}})
    top = _recipe(tmp_path, "top.yaml", {"base": "middle.yaml", "data": {"directions": ["fr-en"]},
                                         "model": {"d_model": 64}})
    config = load_config(top)
    assert config.data.directions == ["fr-en"]  # a list replaced whole, not merged
    assert (config.data.max_len, config.data.vocab_size, config.data.path) == (40, 500, "somewhere")
    assert (config.model.d_model, config.model.n_heads, config.training.max_steps) == (64, 4, 9)
    saved = tmp_path / "saved.yaml"
    save_config(config, saved)  # a run saves the whole resolved config: it loads alone
    assert "base" not in yaml.safe_load(saved.read_text()) and load_config(saved) == config


def test_an_error_names_the_base_file_that_set_the_key_and_a_set_names_itself(tmp_path):
    _recipe(tmp_path, "root.yaml", {**BASE, "data": {"path": "x", "max_len": -1}})
    top = _recipe(tmp_path, "top.yaml", {"base": "root.yaml", "training": {"max_steps": 5}})
    with pytest.raises(ConfigError, match=r"root\.yaml \(a base of .*top\.yaml\): data\.max_len: must be a positive"):
        load_config(top)
    with pytest.raises(ConfigError, match=r"top\.yaml with --set data.max_len=-2: data\.max_len"):
        load_config(top, ["data.max_len=-2"])
    _recipe(tmp_path, "root.yaml", {**BASE, "data": {"path": "x"}, "training": {"max_step": 5}})
    with pytest.raises(ConfigError, match=r"root\.yaml \(a base of .*top\.yaml\): training\.max_step: unknown key"):
        load_config(top)


def test_a_cycle_of_bases_and_a_missing_base_are_refused_naming_the_files(tmp_path):
    a = _recipe(tmp_path, "a.yaml", {"base": "b.yaml", **BASE})
    _recipe(tmp_path, "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match=r"a\.yaml: base: a cycle of recipes: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(a)
    _recipe(tmp_path, "b.yaml", {"base": "gone.yaml"})
    with pytest.raises(ConfigError, match=r"b\.yaml: base: gone\.yaml: no such recipe"):
        load_config(a)
    _recipe(tmp_path, "b.yaml", {"base": 3})
    with pytest.raises(ConfigError, match=r"b\.yaml: base: expected the file name of the recipe"):
        load_config(a)


def test_a_recipe_named_in_a_recipe_is_relative_to_the_file_that_names_it(tmp_path):
    _recipe(tmp_path, "sub/root.yaml", {**BASE, "data": {"path": "x", "synthetic": [
        {"path": "c", "tag": "", "made_by": {"model": ["reverse.yaml", "/abs/m.pt"], "input": ["mono.txt"]}}]}})
    top = _recipe(tmp_path, "top.yaml", {"base": "sub/root.yaml"})
    made = load_config(top).data.synthetic[0].made_by
    assert made.model == [str(tmp_path / "sub" / "reverse.yaml"), "/abs/m.pt"]
    assert made.input == ["mono.txt"]  # data files: relative to the working directory, as data.path


def test_made_by_is_checked_naming_the_entry(tmp_path):
    path = _recipe(tmp_path, "c.yaml", {**BASE, "data": {"path": "x", "synthetic": [
        {"path": "c", "tag": "", "made_by": {"model": [], "input": ["mono.txt"]}}]}})
    with pytest.raises(ConfigError, match=r"data\.synthetic\[0\]\.made_by\.model: name at least one"):
        load_config(path)
    path = _recipe(tmp_path, "c.yaml", {**BASE, "data": {"path": "x", "synthetic": [
        {"path": "c", "tag": "", "made_by": {"model": ["m.pt"], "input": ["t"], "sampling": True, "beam_size": 4}}]}})
    with pytest.raises(ConfigError, match=r"made_by\.sampling: sampling draws one translation"):
        load_config(path)


def test_a_set_of_a_list_entry_says_what_set_reaches_and_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"--set reaches section\.key only, not the entries of data\.synthetic: .*"
                                          r"base: FILE"):
        load_config(_write(tmp_path, BASE), ["data.synthetic.0.tag="])


def test_a_synthetic_corpus_must_say_whether_its_sources_are_tagged(tmp_path):
    path = _recipe(tmp_path, "c.yaml", {**BASE, "data": {"path": "x", "synthetic": [{"path": "c"}]}})
    with pytest.raises(ConfigError, match=r'data\.synthetic\[0\]\.tag: required: "<bt>" to mark back-translated '
                                          r'sources .*"" for none'):
        load_config(path)

"""End to end through the command line, on a few thousand real Multi30k pairs."""

import gzip
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sacrebleu
import sentencepiece

from tests.conftest import write_small_config
from transformer.cli import main


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "transformer", *args], input=stdin, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])


def test_train_writes_the_run_directory(trained_run):
    for name in ("config.yaml", "spm.model", "metrics.jsonl", "checkpoints/last.pt", "checkpoints/best.pt",
                 "checkpoints/step_150.pt"):
        assert (trained_run / name).exists(), name
    assert not (trained_run / "checkpoints" / "step_75.pt").exists()  # keep_last_checkpoints: 1
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    valid = [r for r in records if r["type"] == "valid"]
    assert [r["step"] for r in train] == [25, 50, 75, 100, 125, 150]
    assert [r["step"] for r in valid] == [75, 150]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # it learns
    assert valid[-1]["bleu"] > 0 and valid[-1]["ppl"] < valid[0]["ppl"]
    assert all(r["tgt_tokens_per_s"] > 0 and r["lr"] > 0 for r in train)


def test_resume_continues_where_training_stopped(tmp_path, multi30k_subset, trained_run):
    config = write_small_config(tmp_path, multi30k_subset, training={"max_steps": 20, "eval_every_steps": 10,
                                                                      "log_every_steps": 5})
    run_dir = tmp_path / "run"
    result = run_cli("train", "--config", str(config), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    result = run_cli("train", "--config", str(config), "--run-dir", str(run_dir), "--resume",
                     "--set", "training.max_steps=30")
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr and "at step 20" in result.stderr
    assert "reusing the sentencepiece model" in result.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 10, 15, 20, 20, 25, 30, 30]
    # A finished run resumed again: said, and nothing rebuilt or rewritten (scripts resume without asking first)
    last = run_dir / "checkpoints" / "last.pt"
    before = (last.stat().st_mtime_ns, (run_dir / "metrics.jsonl").read_text())
    result = run_cli("train", "--config", str(config), "--run-dir", str(run_dir), "--resume",
                     "--set", "training.max_steps=30")
    assert result.returncode == 0, result.stderr
    assert "the run has finished (30 of training.max_steps=30 updates)" in result.stderr
    assert "done: 30 steps" in result.stdout and "reusing the sentencepiece model" not in result.stderr
    assert (last.stat().st_mtime_ns, (run_dir / "metrics.jsonl").read_text()) == before
    result = run_cli("train", "--config", str(config), "--run-dir", str(run_dir), "--resume",
                     "--set", "model.d_ff=128")  # a config that could not resume it is still refused
    assert result.returncode == 2 and "model.d_ff" in result.stderr


def test_translate_arguments_stdin_and_files(trained_run, tmp_path):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    result = run_cli("translate", "--checkpoint", ckpt, "Ein Mann fährt Fahrrad.", "Zwei Hunde spielen.")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2 and all(result.stdout.splitlines())
    lines = ["Ein Hund läuft.", "", "   ", "Eine Frau singt.", ""]
    result = run_cli("translate", "--checkpoint", ckpt, "--beam-size", "1", stdin="\n".join(lines) + "\n")
    out = result.stdout.split("\n")[:-1]
    assert len(out) == 5 and out[1] == out[2] == out[4] == "" and out[0] and out[3]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    assert main(["translate", "--checkpoint", ckpt, "--input", str(tmp_path / "in.txt"), "--output",
                 str(tmp_path / "out.txt")]) == 0
    assert (tmp_path / "out.txt").read_text().split("\n")[:-1][1:3] == ["", ""]
    result = run_cli("translate", "--checkpoint", ckpt, "--n-best", "3", "--beam-size", "4", "Ein Hund läuft.")
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "0"]
    scores = [float(r[1]) for r in rows]
    assert scores == sorted(scores, reverse=True)


def test_translate_with_two_workers_writes_the_same(trained_run, multi30k_subset, tmp_path):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    lines = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read().split("\n")
    (tmp_path / "in.txt").write_text("\n".join(lines[:40]) + "\n")
    outputs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}.txt"
        result = run_cli("translate", "--checkpoint", ckpt, "--input", str(tmp_path / "in.txt"), "--output", str(out),
                         "--batch-size", "8", "--workers", workers)
        assert result.returncode == 0, result.stderr
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 40
    result = run_cli("translate", "--checkpoint", ckpt, "--workers", "0", "Ein Hund läuft.")
    assert result.returncode == 2 and "--workers 0: must be at least 1" in result.stderr


def test_translate_and_evaluate_read_text_by_the_one_set_of_rules(trained_run, tmp_path, capsys):
    """BOM and CRLF endings are tolerated alike in --input, stdin, --src and --ref; a NUL byte or invalid UTF-8
    stops with the file and line."""
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    lines = ["Ein Hund läuft.", "Eine Frau singt."]
    (tmp_path / "clean.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "bom_crlf.txt").write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    outputs = []
    for name in ("clean.txt", "bom_crlf.txt"):
        assert main(["translate", "--checkpoint", ckpt, "--input", str(tmp_path / name), "--beam-size", "1"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2
    stdin = run_cli("translate", "--checkpoint", ckpt, "--beam-size", "1",
                    stdin="\ufeff" + "\r\n".join(lines) + "\r\n")
    assert stdin.stdout == outputs[0]
    (tmp_path / "nul.txt").write_bytes(b"Ein Hund.\nEine\x00 Frau.\n")
    assert main(["translate", "--checkpoint", ckpt, "--input", str(tmp_path / "nul.txt")]) == 2
    assert "nul.txt" in (err := capsys.readouterr().err) and "line 2" in err
    (tmp_path / "latin1.txt").write_bytes("Ein Hund.\nEine Frau l\xe4uft.\n".encode("latin-1"))
    assert main(["evaluate", "--checkpoint", ckpt, "--src", str(tmp_path / "clean.txt"), "--ref",
                 str(tmp_path / "latin1.txt")]) == 2
    assert "latin1.txt" in (err := capsys.readouterr().err) and "line 2" in err


def test_evaluate_split_and_files(trained_run, multi30k_subset, tmp_path):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    out = tmp_path / "eval" / "test.json"
    result = run_cli("evaluate", "--checkpoint", ckpt, "--split", "test", "--json", str(out),
                     "--set", f"data.path={multi30k_subset}")
    assert result.returncode == 0, result.stderr
    assert "BLEU = " in result.stdout and "nrefs:1|case:mixed|eff:no|tok:13a" in result.stdout
    record = json.loads(out.read_text())
    hyps = Path(record["hypotheses"]).read_text().split("\n")[:-1]
    assert len(hyps) == 100 and record["n_sentences"] == 100
    assert (record["quantization"], record["compile"], record["workers"]) == (None, False, 1)  # how it decoded
    assert record["beam_size"] == 4 and record["length_penalty"] == pytest.approx(0.6)
    greedy = tmp_path / "eval" / "greedy.json"
    assert run_cli("evaluate", "--checkpoint", ckpt, "--split", "test", "--json", str(greedy), "--beam-size", "1",
                   "--set", f"data.path={multi30k_subset}").returncode == 0
    record_greedy = json.loads(greedy.read_text())
    assert record_greedy["beam_size"] == 1 and record_greedy["length_penalty"] is None  # greedy uses no α
    (tmp_path / "eval" / "blocked.hyp.txt").mkdir()  # a folder where the hypotheses would go: one line, status 2
    result = run_cli("evaluate", "--checkpoint", ckpt, "--split", "test", "--json", str(tmp_path / "eval" /
                     "blocked.json"), "--beam-size", "1", "--set", f"data.path={multi30k_subset}")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        f"error: --json: cannot write {tmp_path / 'eval' / 'blocked.hyp.txt'}: "), result.stderr
    assert not (tmp_path / "eval" / "blocked.json").exists() and not list((tmp_path / "eval").glob(".*.tmp"))
    assert not any("▁" in h for h in hyps)  # detokenized
    refs = (multi30k_subset / "test_2016_flickr.en.gz")
    import gzip
    ref_lines = gzip.open(refs, "rt").read().split("\n")[:100]
    assert record["bleu"] == sacrebleu.corpus_bleu(hyps, [ref_lines]).score  # same as sacrebleu's own scoring
    # --src/--ref files give the same score as --split.
    src = tmp_path / "src.de"
    src.write_text(gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read())
    ref = tmp_path / "ref.en"
    ref.write_text("\n".join(ref_lines) + "\n")
    result = run_cli("evaluate", "--checkpoint", ckpt, "--src", str(src), "--ref", str(ref))
    assert f"BLEU = {record['bleu']:.2f}" in result.stdout


def test_evaluate_several_references_as_sacrebleu_scores_them(trained_run, multi30k_subset, tmp_path):
    import gzip

    ckpt = str(trained_run / "checkpoints" / "best.pt")
    src = tmp_path / "src.de"
    src.write_text(gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read())
    ref1 = tmp_path / "ref1.en"
    ref1.write_text(gzip.open(multi30k_subset / "test_2016_flickr.en.gz", "rt").read())
    lines = ref1.read_text().split("\n")[:-1]
    ref2 = tmp_path / "ref2.en"  # a second reference: the model's own greedy output for the first 50 lines
    greedy = run_cli("translate", "--checkpoint", ckpt, "--beam-size", "1", "--input", str(src)).stdout.split("\n")
    ref2.write_text("".join(line + "\n" for line in greedy[:50] + lines[50:]))
    out = tmp_path / "multi.json"
    result = run_cli("evaluate", "--checkpoint", ckpt, "--src", str(src), "--ref", str(ref1), str(ref2),
                     "--beam-size", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    hyp_path = record["hypotheses"]
    cli = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref1), str(ref2), "-i", hyp_path, "-b", "-w", "6"],
                         capture_output=True, text=True, timeout=120)
    assert f"{record['bleu']:.6f}" == cli.stdout.strip()
    assert "nrefs:2|" in record["bleu_signature"]
    one_ref = sacrebleu.corpus_bleu(Path(hyp_path).read_text().split("\n")[:-1], [lines]).score
    assert record["bleu"] > one_ref  # the second reference counts
    short = tmp_path / "short.en"
    short.write_text("\n".join(lines[:40]) + "\n")
    result = run_cli("evaluate", "--checkpoint", ckpt, "--src", str(src), "--ref", str(ref1), str(short))
    assert result.returncode == 2 and f"reference {short} has 40 lines but the source {src} has 100" in result.stderr


def test_min_len_flag_and_no_n_best_on_evaluate(trained_run, tmp_path):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    sentences = ["Ein Hund läuft.", "Zwei Männer.", "Eine Frau singt.", "Kinder spielen.", "Ein Mann.", "Hallo.",
                 "Ja.", "Ein Hund.", "Zwei Hunde spielen im Schnee.", "Ein Mädchen."]
    flags = ["--checkpoint", ckpt, "--beam-size", "1", "--max-len-a", "0", "--max-len-b", "60"]
    plain = run_cli("translate", *flags, *sentences).stdout.split("\n")[:-1]
    forced = run_cli("translate", *flags, "--min-len", "40", *sentences)
    assert forced.returncode == 0, forced.stderr
    # Outputs that stopped at eos well before 40 pieces (counted by re-encoding the text: about the decoded pieces;
    # a weakly trained model repeats itself, so which sentences these are depends on the run).
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(trained_run / "spm.model"))
    ended = [i for i, line in enumerate(plain) if len(pieces.encode(line)) < 30]
    assert ended, plain
    for i in ended:  # eos was held back for 40 tokens (pieces: the words they make may run together)
        assert len(forced.stdout.split("\n")[i]) > len(plain[i]), (plain[i], forced.stdout)
    result = run_cli("evaluate", "--checkpoint", ckpt, "--split", "test", "--n-best", "2")
    assert result.returncode == 2 and "unrecognized arguments: --n-best" in result.stderr


def test_user_errors_are_one_line_without_traceback(tmp_path, multi30k_subset):
    bad = write_small_config(tmp_path, multi30k_subset, training={"warmup_step": 5})
    result = run_cli("train", "--config", str(bad))
    assert result.returncode == 2
    assert "training.warmup_step: unknown key; did you mean training.warmup_steps?" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli("train", "--config", str(write_small_config(tmp_path, tmp_path / "nowhere")),
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # a run that could not start leaves no empty folder
    result = run_cli("translate", "--checkpoint", str(tmp_path / "missing.pt"), "Hallo")
    assert result.returncode == 2 and "missing.pt: checkpoint not found" in result.stderr


def test_a_folder_that_is_not_a_model_is_refused_in_one_line(tmp_path, capsys):
    """Neither a CTranslate2 export nor a MarianMT folder (nor a .pt file): `open_engine` says what it expected, in
    one line, and `transformer translate` prints that line and exits 2."""
    from transformer.engines import open_engine
    from transformer.files import CheckpointError
    from transformer.translate import Translator

    folder = tmp_path / "some_dir"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "bert"}')  # a Hugging Face folder of another kind
    for opener in (open_engine, Translator.from_checkpoint):
        with pytest.raises(CheckpointError) as err:
            opener(folder)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{folder} is a folder but not a model"), message
        assert all(what in message for what in (".pt checkpoint", "CTranslate2 export", "MarianMT folder")), message
    assert main(["translate", "--checkpoint", str(folder), "x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {message}\n"


def test_bad_device_and_evaluate_overrides_are_user_errors(trained_run, capsys):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    assert main(["translate", "--checkpoint", ckpt, "--device", "cuda:7", "Hallo"]) == 2
    assert "device 'cuda:7' asked for, but CUDA is not available" in capsys.readouterr().err
    assert main(["translate", "--checkpoint", ckpt, "--device", "tpu", "Hallo"]) == 2
    assert "expected auto, cpu, cuda, cuda:N or mps" in capsys.readouterr().err
    # --set for evaluate goes through the same parser as train's, with the checkpoint named in the message
    assert main(["evaluate", "--checkpoint", ckpt, "--split", "test", "--set", "training.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt}: --set 'training.max_steps=3'" in err and "section among data" in err
    assert main(["evaluate", "--checkpoint", ckpt, "--split", "test", "--set", "data.max_len=-1"]) == 2
    assert "data.max_len" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(trained_run, monkeypatch):
    from transformer.translate import Translator

    def broken(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(Translator, "run", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["translate", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "Hallo"])


def test_unreachable_vocabulary_size_names_the_largest_that_works(tmp_path):
    import gzip

    data = tmp_path / "tiny"
    data.mkdir()
    for lang, words in (("de", "ein Hund läuft schnell"), ("en", "a dog runs fast")):
        for split in ("train", "val"):
            lines = [f"{words} {i}" for i in range(50)]
            (data / f"{split}.{lang}.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    config = write_small_config(tmp_path, data, data={"vocab_size": 8000})
    result = run_cli("train", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.vocab_size=8000" in result.stderr and "the largest size that works on this data is" in result.stderr


@pytest.mark.slow
def test_hf_dataset_direction_is_logged(tmp_path):
    pytest.importorskip("datasets")
    rows = [{"translation": {"en": f"the house number {i}", "ro": f"casa numarul {i}"}} for i in range(300)]
    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = write_small_config(tmp_path, tmp_path / "no-such-folder", data={
        "hf_dataset": "json", "src_lang": "en", "tgt_lang": "ro", "vocab_size": 100,
        "data_files": {"train": str(tmp_path / "train.jsonl"), "val": str(tmp_path / "val.jsonl")}},
        training={"max_steps": 2, "eval_every_steps": 2})
    result = run_cli("train", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "example pair  en: the house number 0  ->  ro: casa numarul 0" in result.stderr
    bad = write_small_config(tmp_path, tmp_path / "no-such-folder", data={
        "hf_dataset": "json", "src_lang": "en", "tgt_lang": "de",
        "data_files": {"train": str(tmp_path / "train.jsonl"), "val": str(tmp_path / "val.jsonl")}})
    result = run_cli("train", "--config", str(bad), "--run-dir", str(tmp_path / "run2"))
    assert result.returncode == 2 and "translation column has languages en, ro, not de" in result.stderr


def test_translate_streams_typed_lines_one_by_one(trained_run):
    """One line in, its translation out while stdin is still open; then the next line. With --n-best 1 each output
    line starts with its input's index, so the test knows which input an output answers, whatever the (weakly
    trained) model writes."""
    import select

    flags = ["--beam-size", "1", "--n-best", "1"]
    process = subprocess.Popen([sys.executable, "-m", "transformer", "translate", "--checkpoint",
                                str(trained_run / "checkpoints" / "best.pt"), *flags],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=Path(__file__).resolve().parents[1])

    def translation_of(line: str) -> str:
        process.stdin.write(line.encode() + b"\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], 120)
        assert ready, "no translation while stdin is open"
        return process.stdout.readline().decode()

    try:
        first = translation_of("Ein Mann fährt Fahrrad.")
        second = translation_of("Zwei Hunde spielen im Schnee.")
        assert first.startswith("0\t") and second.startswith("1\t")
        assert first.endswith("\n") and first.split("\t")[2].strip() and second.split("\t")[2].strip()
    finally:
        process.stdin.close()
        process.wait(timeout=120)
    assert process.returncode == 0, process.stderr.read().decode()
    batch = run_cli("translate", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), *flags,
                    stdin="Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\n")
    assert batch.stdout == first + second  # the same as the whole input at once


def test_ctrl_c_while_translating_typed_input_is_one_line(trained_run):
    import select
    import signal

    process = subprocess.Popen([sys.executable, "-m", "transformer", "translate", "--checkpoint",
                                str(trained_run / "checkpoints" / "best.pt"), "--beam-size", "1"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=Path(__file__).resolve().parents[1],
                               # as from a terminal: a shell's background job (`make test &`) ignores SIGINT, and
                               # the child would inherit that
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        process.stdin.write("Ein Mann fährt Fahrrad.\n".encode())
        process.stdin.flush()
        assert select.select([process.stdout], [], [], 120)[0] and process.stdout.readline().strip()
        process.send_signal(signal.SIGINT)  # waiting for the next typed line, as a user presses Ctrl-C
        process.wait(timeout=60)
    finally:
        process.kill()
    stderr = process.stderr.read().decode()
    assert process.returncode == 130 and "translate: interrupted" in stderr and "Traceback" not in stderr, stderr


def test_translate_and_evaluate_refuse_conflicting_files_before_work(trained_run, tmp_path, capsys):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    src = tmp_path / "in.de"
    src.write_text("Ein Hund läuft.\nZwei Katzen.\n", encoding="utf-8")
    assert main(["translate", "--checkpoint", ckpt, "--input", str(src), "--output", str(src)]) == 2
    assert "is the --input file" in capsys.readouterr().err and src.read_text().count("\n") == 2
    nested = tmp_path / "new" / "folder" / "out.en"  # missing folders are made, as evaluate --json does
    assert main(["translate", "--checkpoint", ckpt, "--input", str(src), "--output", str(nested)]) == 0
    assert nested.read_text(encoding="utf-8").count("\n") == 2
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", ckpt, "--split", "test", "--src", str(src), "--ref", str(src)]) == 2
    assert "--split test and --src/--ref name two test sets" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", ckpt, "--src", str(src), "--ref", str(src), "--tokenize", "foo"]) == 2
    err = capsys.readouterr().err
    assert "--tokenize foo: sacrebleu's BLEU tokenizers are" in err and "13a" in err


def test_translate_a_file_chunk_by_chunk(trained_run, tmp_path, monkeypatch, capsys):
    """A file is read --buffer-size lines at a time and each chunk's translations are on disk before the next chunk
    is read: at most one chunk is ever held, so a file of any size takes bounded memory (exact, not measured)."""
    import transformer.data.text

    lines = gzip.open(Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k" / "train.de.gz",
                      "rt", encoding="utf-8").read().split("\n")[:1000]
    src, out = tmp_path / "in.de", tmp_path / "out.en"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    seen = []  # (lines read before this read, lines written to disk at this read, lines this read returned)

    class WatchedReader(transformer.data.text.LineReader):
        def read(self, n):
            read_before = sum(chunk for _, _, chunk in seen)
            partial = out.with_name(out.name + ".partial")  # where translate writes until it is done
            written = partial.read_text(encoding="utf-8").count("\n") if partial.exists() else 0
            chunk = super().read(n)
            seen.append((read_before, written, len(chunk)))
            return chunk

    monkeypatch.setattr(transformer.data.text, "LineReader", WatchedReader)
    assert main(["translate", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--input", str(src),
                 "--output", str(out), "--beam-size", "1", "--max-len-a", "0", "--max-len-b", "2",
                 "--buffer-size", "64"]) == 0
    assert [chunk for _, _, chunk in seen] == [64] * 15 + [40, 0]
    assert all(written == read_before for read_before, written, _ in seen)  # every earlier line already written
    assert len(out.read_text(encoding="utf-8").split("\n")) == 1000 + 1
    assert "translate" in capsys.readouterr().err  # the progress bar (output is a file)


def test_version_and_verbose_after_the_subcommand(tmp_path, capsys):
    from transformer.checkpoint import CheckpointError

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("transformer 0.")
    assert main(["translate", "--checkpoint", str(tmp_path / "missing.pt"), "Hallo"]) == 2  # one line
    with pytest.raises(CheckpointError):  # -v keeps the traceback, before or after the subcommand
        main(["translate", "-v", "--checkpoint", str(tmp_path / "missing.pt"), "Hallo"])
    with pytest.raises(CheckpointError):
        main(["-v", "translate", "--checkpoint", str(tmp_path / "missing.pt"), "Hallo"])


def test_bad_decoding_flags_are_named_as_typed(trained_run, capsys):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    assert main(["translate", "--checkpoint", ckpt, "--n-best", "5", "--beam-size", "2", "Hallo"]) == 2
    assert capsys.readouterr().err.startswith("error: --n-best: must be between 1 and beam_size=2, got 5")
    assert main(["translate", "--checkpoint", ckpt, "--min-len", "-1", "Hallo"]) == 2
    assert capsys.readouterr().err.startswith("error: --min-len: must be >= 0")


def test_compile_flag_reaches_the_translator_and_its_refusals(trained_run, tmp_path, capsys):
    """--compile is passed on (the compiled step's own tests are in tests/model/test_compiled.py); what it cannot
    combine with is refused in one line before any work."""
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    src = tmp_path / "in.de"
    src.write_text("Ein Hund läuft.\n", encoding="utf-8")
    assert main(["translate", "--checkpoint", ckpt, "--input", str(src), "--compile", "--workers", "2"]) == 2
    assert "--compile decodes with one worker" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", ckpt, "--split", "test", "--compile", "--quantization", "int8"]) == 2
    assert "--compile works on float32 models" in capsys.readouterr().err
    fake_ct2 = tmp_path / "ct2"
    fake_ct2.mkdir()
    (fake_ct2 / "model.bin").write_bytes(b"")
    (fake_ct2 / "transformer_nmt.json").write_text("{}")
    assert main(["translate", "--checkpoint", str(fake_ct2), "--input", str(src), "--compile"]) == 2
    assert "--compile compiles our own decoder" in capsys.readouterr().err


def test_translate_compile_writes_the_eager_lines_and_says_it_is_compiling(trained_run, tmp_path, capsys):
    """`translate --compile` as a user calls it: the same output file as without it (greedy), and a line on stderr
    before the silent compile of the first batch."""
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    src = tmp_path / "in.de"
    src.write_text("Ein Hund läuft.\nZwei Kinder spielen im Park.\n\nEine Frau liest ein Buch.\n", encoding="utf-8")
    eager, compiled = tmp_path / "eager.en", tmp_path / "compiled.en"
    common = ["translate", "--checkpoint", ckpt, "--input", str(src), "--beam-size", "1"]
    assert main([*common, "--output", str(eager)]) == 0
    assert "--compile" not in capsys.readouterr().err
    assert main([*common, "--output", str(compiled), "--compile"]) == 0
    assert "--compile: compiling the decoding step" in capsys.readouterr().err
    assert compiled.read_text(encoding="utf-8") == eager.read_text(encoding="utf-8")
    assert compiled.read_text(encoding="utf-8").count("\n") == 4


def test_output_is_utf8_whatever_the_locale():
    """LC_ALL=C or PYTHONIOENCODING=ascii/latin-1 (minimal containers, cron) must not break or re-encode output."""
    code = "from transformer.data.text import utf8_stdout; utf8_stdout().write('Fahrrad fährt 😆\\n')"
    for encoding in ("ascii", "latin-1"):
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "PYTHONIOENCODING": encoding}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True,
                             cwd=Path(__file__).resolve().parents[1]).stdout
        assert out == "Fahrrad fährt 😆\n".encode(), encoding


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_output_is_one_line_and_a_closed_pipe_stops_quietly(trained_run):
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "transformer", "translate", "--checkpoint", ckpt,
                                 "Ein Hund läuft."], stdout=full, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 2
    assert result.stderr == "error: stdout: cannot write the translations: No space left on device\n"
    result = subprocess.run([sys.executable, "-m", "transformer", "translate", "--checkpoint", ckpt, "--output",
                             "/dev/full", "Ein Hund läuft."], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (2, "error: /dev/full: cannot write the translations: No space "
                                                     "left on device\n")
    # `translate | head -n 1`: the reader closes the pipe after one line, translate is still reading its input
    process = subprocess.Popen([sys.executable, "-m", "transformer", "translate", "--checkpoint", ckpt],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdin.write("Ein Hund läuft.\n".encode())
    process.stdin.flush()
    assert process.stdout.readline()  # the first translation
    process.stdout.close()
    process.stdin.write(b"Zwei Hunde spielen.\n")
    process.stdin.close()
    assert process.wait(timeout=60) == 141
    assert process.stderr.read() == b""  # no traceback, no message


def test_a_pipe_reader_gets_the_first_lines_after_a_short_chunk(trained_run, multi30k_subset, tmp_path, monkeypatch):
    """`translate --input F | head -n 1` must not decode a whole --buffer-size chunk before the first line can be
    written: to a pipe the chunks start at FIRST_CHUNK lines and double; to a file they are --buffer-size lines."""
    from transformer.data.text import FIRST_CHUNK
    from transformer.translate import Translator

    lines = gzip.open(multi30k_subset / "test_2016_flickr.de.gz", "rt").read().split("\n")[:100]
    source = tmp_path / "in.de"
    source.write_text("\n".join(lines * 10) + "\n")
    decoded: list[int] = []
    real = Translator.run

    def counted(self, request, **options):
        decoded.append(len(request))
        return real(self, request, **options)

    monkeypatch.setattr(Translator, "run", counted)
    ckpt = str(trained_run / "checkpoints" / "best.pt")
    assert main(["translate", "--checkpoint", ckpt, "--input", str(source), "--output", str(tmp_path / "o")]) == 0
    assert decoded == [1000]
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stdout", os.fdopen(write_end, "w", encoding="utf-8"))
    first: list[bytes] = []

    def head_n_1() -> None:
        with os.fdopen(read_end, "rb") as reader:
            first.append(reader.readline())

    reader = threading.Thread(target=head_n_1)
    reader.start()
    decoded.clear()
    assert main(["translate", "--checkpoint", ckpt, "--input", str(source)]) == 141
    reader.join()
    # the first chunk reaches the reader; translate stops at the first write after it left (16 + 32 lines, or one
    # chunk more if that write came before the reader closed the pipe), far from the 1000 lines of one chunk
    assert first[0].strip() and decoded[0] == FIRST_CHUNK and sum(decoded) <= 7 * FIRST_CHUNK, decoded


def test_the_help_names_every_command():
    from transformer.cli import build_parser

    parser = build_parser()
    commands = re.search(r"\{([a-z,]+)\}", parser.format_usage()).group(1).split(",")
    assert "synthesize" in commands and "chain" in commands
    assert [c for c in commands if f" {c}," not in parser.description and f" {c}." not in parser.description] == []

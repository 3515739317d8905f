"""`transformer average`: the mean in float64, identity for one input, deterministic files, and every refusal."""

import re

import torch

from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.cli import main
from transformer.training.average import average_checkpoints, last_checkpoints
from transformer.translate import Translator

SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau singt."]


def _perturbed(trained_run, tmp_path, name, scale, **changes):
    """last.pt with every float weight changed by scale * N(0, 1) (seeded), saved as tmp_path / name."""
    state = load_checkpoint(trained_run / "checkpoints" / "last.pt")
    g = torch.Generator().manual_seed(int(scale * 1000))
    state["model"] = {k: t + scale * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
                      for k, t in state["model"].items()}
    state.update(changes)
    save_checkpoint(state, tmp_path / name)
    return tmp_path / name


def test_one_checkpoint_averages_to_itself(trained_run, tmp_path):
    best = trained_run / "checkpoints" / "best.pt"
    assert main(["average", "--checkpoints", str(best), "--output", str(tmp_path / "avg.pt")]) == 0
    averaged = torch.load(tmp_path / "avg.pt", weights_only=True)
    assert "optimizer" not in averaged and "rng" not in averaged
    for name, tensor in load_checkpoint(best)["model"].items():
        assert torch.equal(averaged["model"][name], tensor), name
    a = Translator.from_checkpoint(best).translate(SENTENCES, beam_size=2)
    b = Translator.from_checkpoint(tmp_path / "avg.pt").translate(SENTENCES, beam_size=2)
    assert a == b


def test_the_mean_in_float64_stored_in_the_original_dtype(trained_run, tmp_path):
    paths = [_perturbed(trained_run, tmp_path, f"p{i}.pt", 0.01 * (i + 1)) for i in range(3)]
    averaged = average_checkpoints(paths)
    inputs = [load_checkpoint(p)["model"] for p in paths]
    for name, tensor in averaged["model"].items():
        expected = sum(m[name].double() for m in inputs) / 3
        assert tensor.dtype == inputs[0][name].dtype, name
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, expected.to(tensor.dtype), rtol=0, atol=0, msg=name)
    assert averaged["averaged_from"] == [str(p) for p in paths]


def test_averaging_twice_gives_identical_files(trained_run, tmp_path):
    paths = [str(_perturbed(trained_run, tmp_path, f"p{i}.pt", 0.01 * (i + 1))) for i in range(2)]
    for out in ("a.pt", "b.pt"):
        assert main(["average", "--checkpoints", *paths, "--output", str(tmp_path / out)]) == 0
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_last_n_of_a_run_by_step(trained_run, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (100, 20, 3):
        _perturbed(trained_run, run / "checkpoints", f"step_{step}.pt", step / 1000)
    assert [p.name for p in last_checkpoints(run, 2)] == ["step_20.pt", "step_100.pt"]
    assert main(["average", "--run-dir", str(run), "--last", "2", "--output", str(tmp_path / "avg.pt")]) == 0
    assert main(["average", "--run-dir", str(run), "--last", "4", "--output", str(tmp_path / "x.pt")]) == 2


def test_refusals_name_the_files(trained_run, tmp_path, capsys):
    good = str(_perturbed(trained_run, tmp_path, "good.pt", 0.01))
    config = load_checkpoint(good)["config"]
    other_model = {**config, "model": {**config["model"], "d_ff": 128}}
    wider = str(_perturbed(trained_run, tmp_path, "wider.pt", 0.02, config=other_model))
    tokenizer = load_checkpoint(good)["tokenizer"]
    other_tok = str(_perturbed(trained_run, tmp_path, "tok.pt", 0.03,
                               tokenizer={**tokenizer, "src": b"x" + tokenizer["src"]}))
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(open(good, "rb").read()[:1000])
    cases = [([good, wider], "cannot average .*wider.pt with .*good.pt: different model configs .*d_ff: 128 vs"),
             ([good, other_tok], "tok.pt with .*good.pt: different sentencepiece models"),
             ([good, str(tmp_path / "missing.pt")], "missing.pt: checkpoint not found"),
             ([good, str(corrupt)], "corrupt.pt: not a readable checkpoint"),
             ([good, str(tmp_path)], "is a folder: average takes .pt checkpoints of one run .*cannot be averaged")]
    for inputs, message in cases:
        assert main(["average", "--checkpoints", *inputs, "--output", str(tmp_path / "out.pt")]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), (message, err)
    assert not (tmp_path / "out.pt").exists()
    assert main(["average", "--run-dir", str(trained_run), "--last", "3", "--output", str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "3 step checkpoints asked for, 1 found (step_150.pt)" in err and "training.save_every_steps" in err


def test_an_existing_output_is_replaced_only_when_it_is_an_earlier_average(trained_run, tmp_path, capsys):
    paths = [str(_perturbed(trained_run, tmp_path, f"p{i}.pt", 0.01 * (i + 1))) for i in range(2)]
    trained = tmp_path / "best.pt"
    trained.write_bytes((trained_run / "checkpoints" / "best.pt").read_bytes())
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    for existing in (trained, notes, tmp_path):
        before = existing.read_bytes() if existing.is_file() else None
        assert main(["average", "--checkpoints", *paths, "--output", str(existing)]) == 2
        kind = "a folder" if existing.is_dir() else "a file other than an averaged checkpoint"
        assert re.search(rf"--output {re.escape(str(existing))}: exists and is {kind}", capsys.readouterr().err)
        assert (existing.read_bytes() if existing.is_file() else None) == before
    average = tmp_path / "avg.pt"
    assert main(["average", "--checkpoints", paths[0], "--output", str(average)]) == 0
    assert main(["average", "--checkpoints", *paths, "--output", str(average)]) == 0  # an earlier average: replaced
    assert load_checkpoint(average)["averaged_from"] == paths

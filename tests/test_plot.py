"""`transformer plot`: the curves read from metrics.jsonl, the picture written, and its refusals."""

import json

import pytest

from transformer.cli import main
from transformer.plot import PlotError, plot_runs, read_curves


def _run(folder, offset=0.0, grad_norm=True):
    folder.mkdir(parents=True)
    lines = []
    for step in (10, 20, 30, 40):
        record = {"type": "train", "step": step, "loss": 5.0 - step / 10 + offset, "lr": step * 1e-4}
        if grad_norm:
            record["grad_norm"] = 1.0 + step / 100
        lines.append(record)
        if step % 20 == 0:
            lines.append({"type": "valid", "step": step, "loss": 4.5 - step / 20, "bleu": step / 2 + offset})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_curves_come_from_the_records(tmp_path):
    curves = read_curves(_run(tmp_path / "a"))
    assert curves["train_loss"] == [(10, 4.0), (20, 3.0), (30, 2.0), (40, 1.0)]
    assert curves["valid_loss"] == [(20, 3.5), (40, 2.5)] and curves["bleu"] == [(20, 10.0), (40, 20.0)]
    assert curves["lr"][-1] == (40, 40 * 1e-4) and curves["grad_norm"][0] == (10, 1.1)


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_several_runs_are_drawn_into_one_picture(tmp_path, suffix, magic):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", offset=1.0, grad_norm=False)
    out = plot_runs([str(a), str(b)], tmp_path / "out" / f"curves{suffix}")
    assert out.read_bytes().startswith(magic)
    if suffix == ".svg":  # both runs are in the legend
        text = out.read_text()
        assert "a train" in text and "b train" in text and "gradient norm" in text


def test_the_cli_writes_beside_the_run_and_refuses_what_it_cannot_read(tmp_path, capsys):
    run = _run(tmp_path / "run")
    assert main(["plot", "--run-dir", str(run)]) == 0
    assert (run / "curves.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    assert main(["plot", "--run-dir", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --run-dir {tmp_path / 'missing'}: no metrics.jsonl")
    assert main(["plot", "--run-dir", str(run), "--out", str(tmp_path / "c.gif")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out ") and "suffix must be .png, .svg or .pdf" in err
    (run / "metrics.jsonl").write_text('{"type": "train", "step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(PlotError, match=r"metrics.jsonl:2: not a metrics record"):
        read_curves(run)


def test_drawing_keeps_the_callers_matplotlib_backend(tmp_path):
    """A notebook draws inline: writing a picture must not switch matplotlib's backend (as `matplotlib.use("Agg")`
    would) nor leave pyplot figures open. In a fresh process, so that no other test's backend is touched."""
    import subprocess
    import sys

    _run(tmp_path / "a")
    code = (
        "import matplotlib, sys; matplotlib.use('pdf'); import matplotlib.pyplot as plt\n"
        "from transformer.plot import plot_runs\n"
        f"plot_runs([{str(tmp_path / 'a')!r}], {str(tmp_path / 'c.png')!r})\n"
        "from pathlib import Path; from transformer.attention_plot import save_plot\n"
        "row = lambda n, k: [[1.0 / k] * k for _ in range(n)]\n"
        "data = {'src_pieces': ['a', 'b', '</s>'], 'tgt_in_pieces': ['<s>', 'x'], 'tgt_out_pieces': ['x', '</s>'],\n"
        "        'translation': 'x', 'cross': [[row(2, 3)] * 2], 'encoder_self': [[row(3, 3)] * 2],\n"
        "        'decoder_self': [[row(2, 2)] * 2]}\n"
        f"save_plot(data, Path({str(tmp_path / 'a.png')!r}), -1, None, ('cross', 'encoder_self', 'decoder_self'))\n"
        "print(matplotlib.get_backend(), len(plt.get_fignums()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["pdf", "0"]
    assert all((tmp_path / name).read_bytes().startswith(b"\x89PNG") for name in ("a.png", "c.png"))

"""Training curves from a run's `metrics.jsonl`, drawn with matplotlib (`transformer plot`).

    transformer plot --run-dir runs/multi30k_de_en --out curves.png
    transformer plot --run-dir runs/a --run-dir runs/b --out compare.png     # runs overlaid

Panels over the update step: training and validation loss (label-smoothed, per target token), validation BLEU
(greedy), learning rate, and the gradient norm before clipping (a panel is left out when no run has its data).
One colour per run.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import OptionError

PANELS = (  # (title, [(series of `read_curves`, line style, legend suffix), ...])
    ("loss per target token", [("train_loss", "-", " train"), ("valid_loss", "o--", " valid")]),
    ("validation BLEU (greedy)", [("bleu", "o-", "")]),
    ("learning rate", [("lr", "-", "")]),
    ("gradient norm (before clipping)", [("grad_norm", "-", "")]),
)


class PlotError(OptionError):
    """A run directory without a readable metrics.jsonl, an unknown image suffix, or matplotlib missing."""


def read_curves(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The series of one run: {"train_loss", "valid_loss", "bleu", "lr", "grad_norm"} -> [(step, value), ...].

    Raises:
        PlotError: no metrics.jsonl in run_dir, or a line that is not a JSON record (naming file and line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(
            "{run_dir}: no metrics.jsonl (is it a run directory of transformer train?)",
            run_dir=str(run_dir),
        )
    curves: dict[str, list[tuple[int, float]]] = {
        k: [] for k in ("train_loss", "valid_loss", "bleu", "lr", "grad_norm")
    }
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            raise PlotError(f"{path}:{number}: not a metrics record (JSON with a step)") from None
        if record.get("type") == "train":
            for key, name in (("loss", "train_loss"), ("lr", "lr"), ("grad_norm", "grad_norm")):
                if key in record:
                    curves[name].append((step, float(record[key])))
        elif record.get("type") == "valid":
            curves["valid_loss"].append((step, float(record["loss"])))
            curves["bleu"].append((step, float(record["bleu"])))
    return curves


def plot_runs(run_dirs: list[str], out: str | Path) -> Path:
    """Draw the curves of one or more runs into `out` (.png, .svg or .pdf).

    Raises:
        PlotError: as `read_curves`, an unknown suffix, or matplotlib missing.
    """
    out = Path(out)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise PlotError("{out}: the suffix must be .png, .svg or .pdf", out=str(out))
    runs = [(str(run_dir), read_curves(run_dir)) for run_dir in run_dirs]
    try:
        from matplotlib.figure import (
            Figure,
        )  # not pyplot: the caller's backend (a notebook's inline one) is kept
    except ImportError:
        raise PlotError(
            "plotting needs matplotlib: pip install 'transformer-nmt[viz]' (or pip install "
            "matplotlib)"
        ) from None
    shown = [
        (title, lines)
        for title, lines in PANELS
        if any(curves[series] for _, curves in runs for series, _, _ in lines)
    ]
    if not shown:
        raise PlotError(f"{', '.join(run_dirs)}: metrics.jsonl holds no records yet")
    fig = Figure(figsize=(4.2 * len(shown), 3.4))
    axes = fig.subplots(1, len(shown), squeeze=False)
    for i, (name, curves) in enumerate(runs):
        colour = f"C{i % 10}"
        label = Path(name).name or name
        for ax, (_, lines) in zip(axes[0], shown):
            for series, style, suffix in lines:
                if curves[series]:
                    steps, values = zip(*curves[series])
                    ax.plot(steps, values, style, color=colour, markersize=3, label=label + suffix)
    for ax, (title, _) in zip(axes[0], shown):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("update step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out

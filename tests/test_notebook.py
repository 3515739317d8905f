"""The teaching notebook (notebooks/learn_the_transformer.ipynb) runs top to bottom in a Jupyter kernel, and the
committed copy is executed, small, and the same code as its paired .py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "learn_the_transformer.ipynb"
PAIRED = NOTEBOOK.with_suffix(".py")
CELL_TIMEOUT_S = 180
"""Per cell; the slowest, the toy model's training, takes about 10 s on 2 CPU cores."""
MAX_BYTES = 1_000_000
"""The committed notebook with its pictures, kept small enough for GitHub to render."""


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(trained_run, monkeypatch):
    """Every cell in order in a real kernel (the venv's python3); any error fails the test. Section 7 reads the
    short run of `trained_run` (through TRANSFORMER_NOTEBOOK_DE_EN) instead of training one, and nothing is
    written into the repository: the executed copy stays in memory."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("TRANSFORMER_NOTEBOOK_DE_EN", str(trained_run / "checkpoints" / "best.pt"))
    monkeypatch.delenv("TRANSFORMER_NOTEBOOK_EN_DE", raising=False)
    committed = NOTEBOOK.read_bytes()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    short_run = ROOT / "runs" / "notebook_de_en_short"  # where the notebook would train a model of its own
    had_short_run = short_run.exists()
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    elapsed = time.perf_counter() - start
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "module gives the same output: True and weights: True" in text
    assert "same weights: True | same output: True" in text
    assert f"{trained_run / 'checkpoints' / 'best.pt'}: 150 updates" in text  # the given model, no run of its own
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 8
    assert NOTEBOOK.read_bytes() == committed and short_run.exists() == had_short_run
    print(f"notebook executed in {elapsed:.0f} s")


def test_the_kernel_is_this_python():
    """The test's kernel, "python3", starts the interpreter running the tests (the venv's), not another one."""
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    pytest.importorskip("ipykernel")
    from jupyter_client.manager import KernelManager

    assert "python3" in kernelspec.KernelSpecManager().find_kernel_specs()
    command = KernelManager(kernel_name="python3").format_kernel_cmd()
    assert command[0] == sys.executable, command


def test_the_committed_notebook_is_executed_and_small():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "execute it top to bottom"
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for cell in code for o in cell.outputs) >= 8
    assert os.path.getsize(NOTEBOOK) < MAX_BYTES


def test_the_notebook_and_its_paired_script_hold_the_same_cells():
    """The .py (jupytext's percent format) is the readable diff of the .ipynb: `jupytext --sync` keeps them equal."""
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    committed = nbformat.read(NOTEBOOK, as_version=4)
    paired = jupytext.read(PAIRED)
    cells = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]  # noqa: E731
    assert cells(paired) == cells(committed), "run: jupytext --sync notebooks/learn_the_transformer.ipynb"


def _section_7_helpers(root: Path) -> dict:
    """The functions of the notebook's section 7 (the cell that finds a model), defined with ROOT = `root`."""
    import ast
    import json

    from transformer.checkpoint import load_checkpoint
    from transformer.training.checkpoint import run_progress

    cells = json.loads(NOTEBOOK.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "def recipe_checkpoint" in "".join(c["source"]))
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    namespace = {"os": os, "Path": Path, "ROOT": root, "load_checkpoint": load_checkpoint,
                 "run_progress": run_progress}
    exec(compile(tree, "section 7", "exec"), namespace)
    return namespace


def test_a_run_that_did_not_finish_is_never_taken_as_trained(trained_run, tmp_path, monkeypatch, capsys):
    """Section 7 takes a recipe's best.pt only when its run made every planned update; one that stopped half-way
    is named with its progress and skipped (the notebook then trains its short run, bounded in time)."""
    import shutil

    import torch

    monkeypatch.delenv("TRANSFORMER_NOTEBOOK_DE_EN", raising=False)
    helpers = _section_7_helpers(tmp_path)
    finished = tmp_path / "runs" / "multi30k_de_en_bt" / "checkpoints"
    shutil.copytree(trained_run / "checkpoints", finished)
    stopped = tmp_path / "runs" / "multi30k_de_en" / "checkpoints"
    shutil.copytree(trained_run / "checkpoints", stopped)
    state = torch.load(stopped / "last.pt", weights_only=False)
    state["config"]["training"]["max_steps"] = 7000
    torch.save(state, stopped / "last.pt")
    assert helpers["recipe_checkpoint"]("TRANSFORMER_NOTEBOOK_DE_EN", ["multi30k_de_en", "multi30k_de_en_bt"]) == (
        finished / "best.pt")
    assert "runs/multi30k_de_en stopped at 150 of 7000 updates" in capsys.readouterr().out
    shutil.rmtree(finished.parent)
    assert helpers["recipe_checkpoint"]("TRANSFORMER_NOTEBOOK_DE_EN", ["multi30k_de_en", "multi30k_de_en_bt"]) is None
    monkeypatch.setenv("TRANSFORMER_NOTEBOOK_DE_EN", str(stopped / "best.pt"))  # named: taken as given
    assert helpers["recipe_checkpoint"]("TRANSFORMER_NOTEBOOK_DE_EN", ["multi30k_de_en"]) == stopped / "best.pt"


def test_make_notebook_run_leaves_the_tracked_notebook_as_it_is_unless_asked():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    run = lambda *extra: subprocess.run(["make", "-n", "notebook-run", *extra], cwd=root, capture_output=True,  # noqa: E731
                                        text=True, check=True).stdout
    assert "--output-dir runs/notebooks" in run() and "--inplace" not in run()
    assert "--inplace" in run("IN_PLACE=1")

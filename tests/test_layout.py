"""The layout the README promises: the inference path stands without the training package, modules stay small,
and the training loop is the first thing `trainer.py` defines."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer"
INFERENCE_MODULES = ["transformer", "transformer.checkpoint", "transformer.translate", "transformer.evaluate",
                     "transformer.ct2", "transformer.attention_plot", "transformer.decoding", "transformer.model",
                     "transformer.serve"]


def test_the_inference_path_imports_nothing_from_training():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in INFERENCE_MODULES)
            + "print(sorted(m for m in sys.modules if m.startswith('transformer.training')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.strip()
    assert out == "[]", f"the inference path imports {out}"


def test_no_module_imports_from_a_layer_above_it():
    """Statically: nothing outside training/ (and the CLI, which dispatches to it) imports training/."""
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "training" or relative.name == "cli.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and "training" in node.module.split("."):
                raise AssertionError(f"{relative}:{node.lineno} imports {node.module}")


def test_modules_stay_readable():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= 420, {k: v for k, v in sizes.items() if v > 420}


def test_the_training_loop_comes_first_in_trainer():
    tree = ast.parse((PACKAGE / "training" / "trainer.py").read_text())
    first = next(node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)))
    assert first.name == "training_loop"

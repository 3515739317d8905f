"""The layout docs/layout.md describes: each module imports only from modules above it in `ORDER` (its table), the
inference path stands without the training package, private PyTorch APIs (modules,
functions and attributes) stay in `transformer/fast/`, modules stay small, and the training loop is the first thing
`trainer.py` defines."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "transformer"
ROOT = PACKAGE.parent
# The dependency order, top to bottom (docs/layout.md's table follows it); a package's __init__ comes after its modules.
ORDER = [
    "lazy_imports", "config.errors", "config.languages", "config.sections", "config.loading", "config", "device",
    "model.attention", "model.layers", "model.transformer", "model",
    "fast.reductions", "fast.cache", "fast.layout", "fast.cpu", "fast.compiled", "fast.dropout", "fast",
    "tokenizer", "data.text", "data.datasets", "data.batching", "data.coverage", "data.token_cache",
    "data.subword_sampling", "data.mixing", "data",
    "files", "hf",
    "checkpoint", "ct2",
    "decoding.interface", "decoding.hypothesis", "decoding.ngram", "decoding.rules", "decoding.greedy",
    "decoding.beam", "decoding.sampling", "decoding.search", "decoding.ensemble", "decoding.alignment",
    "decoding.options", "decoding",
    "engines.base", "engines.pytorch", "engines.ctranslate2", "engines.open", "engines",
    "passthrough", "request", "translate", "evaluate", "synthesize",
    "attention_plot", "plot", "serve.batching", "serve.service", "serve.app", "serve.server", "serve",
    "training.distributed", "training.average", "training.optim", "training.loss", "training.data",
    "training.checkpoint", "training.stop", "training.init_from", "training.validate", "training.tensorboard",
    "training.trainer",
    "training",
    "run_scores", "chain",
    "", "cli", "__main__",
]
INFERENCE_MODULES = ["transformer", "transformer.checkpoint", "transformer.translate", "transformer.evaluate",
                     "transformer.ct2", "transformer.engines", "transformer.attention_plot", "transformer.decoding",
                     "transformer.model", "transformer.fast"] + (
    ["transformer.serve"] if importlib.util.find_spec("fastapi") else [])


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a package module in `path`, relative or absolute, at any depth."""
    name = _module_name(path).split(".") if _module_name(path) else []
    here = name if path.name == "__init__.py" else name[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:len(here) - node.level + 1]
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformer":
            found.append((node.lineno, node.module.removeprefix("transformer").lstrip(".")))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.removeprefix("transformer").lstrip("."))
                      for a in node.names if a.name.split(".")[0] == "transformer"]
    return found


def test_each_module_imports_only_from_modules_above_it():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    assert set(modules) == set(ORDER), f"place new modules in ORDER: {set(modules) ^ set(ORDER)}"
    for name, path in modules.items():
        for line, target in _imports(path):
            assert target in ORDER, f"{path.relative_to(ROOT)}:{line} imports unknown module {target!r}"
            assert ORDER.index(target) < ORDER.index(name), (
                f"{path.relative_to(ROOT)}:{line} imports {target or 'transformer'}, which comes after it")


def test_the_check_above_sees_imports():
    """Guards the test above: it finds relative, absolute and function-level imports."""
    assert (1, "model.layers") in [(1, t) for _, t in _imports(PACKAGE / "model" / "transformer.py")]
    assert "training.trainer" in [t for _, t in _imports(PACKAGE / "cli.py")]  # imported inside a function
    assert "fast" in [t for _, t in _imports(PACKAGE / "engines" / "pytorch.py")]


def test_the_inference_path_imports_nothing_from_training():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in INFERENCE_MODULES)
            + "print(sorted(m for m in sys.modules if m.startswith('transformer.training')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.strip()
    assert out == "[]", f"the inference path imports {out}"


def _names_defined(tree: ast.AST) -> set[str]:
    """Every name a source file defines: functions, classes, assigned variables and attributes, class fields."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return names


PUBLIC_UNDERSCORED = {("os", "_exit")}
"""Documented public functions whose names start with an underscore (os._exit: end the process now)."""


def _private_torch(source: str, where: str, ours: set[str]) -> list[str]:
    """Uses of private PyTorch APIs in a source file: `torch._*` and `torch.ops.*` (attributes or imports),
    `torch.ao` imports, and private attributes that the project does not define itself, such as the `_orig_mod`
    that torch.compile's wrapper holds (`x._name`, or `getattr(x, "_name")`, on anything but `self` and `cls`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" and (
                (node.attr.startswith("_") and not node.attr.endswith("__")) or node.attr == "ops"):
            found.append(f"{where}:{node.lineno} torch.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__") and (
                node.attr not in ours and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and not (isinstance(node.value, ast.Name) and (node.value.id, node.attr) in PUBLIC_UNDERSCORED)):
            found.append(f"{where}:{node.lineno} .{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and node.args[1].value.startswith("_") and not node.args[1].value.endswith("__")
                and node.args[1].value not in ours):
            found.append(f"{where}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for n in names:
            parts = n.split(".")
            if parts[0] == "torch" and len(parts) > 1 and (parts[1].startswith("_") or parts[1] in ("ops", "ao")):
                found.append(f"{where}:{node.lineno} {n}")
    return found


# Private attributes of libraries other than PyTorch that the check above cannot tell from PyTorch's: allowed by name.
OTHER_LIBRARIES_PRIVATE = {
    "._fingerprint": "Hugging Face datasets' Dataset (data/datasets.py)",
    "._actions": "argparse (tests of the CLI's options)",
    "._action_groups": "argparse (tests of the CLI's options)",
    "._group_actions": "argparse (tests of the CLI's options)",
}


def test_private_torch_apis_only_in_the_speed_package():
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    ours = set().union(*(_names_defined(ast.parse(p.read_text())) for p in sources))
    uses = {p: _private_torch(p.read_text(), str(p.relative_to(ROOT)), ours) for p in sources}
    outside = [use for p, found in uses.items() if PACKAGE / "fast" not in p.parents for use in found
               if use.split(" ", 1)[1] not in OTHER_LIBRARIES_PRIVATE]
    assert outside == []
    inside = [use for p, found in uses.items() if PACKAGE / "fast" in p.parents for use in found]
    assert any("torch.ops" in use for use in inside) and any("torch._inductor" in use for use in inside)
    assert any("_orig_mod" in use for use in inside)


def test_the_check_above_sees_private_attributes():
    """Guards the test above: it finds a foreign private attribute however it is reached, and leaves the project's
    own private names alone."""
    source = """
import torch._dynamo
from torch.ao import quantization
torch._inductor.config
torch.ops.mkldnn
wrapped._orig_mod.train()
getattr(module, "_orig_mod", module)
self._cache, other._helper, cls._table
def _helper(): pass
"""
    found = {use.split(" ", 1)[1] for use in _private_torch(source, "x.py", _names_defined(ast.parse(source)))}
    assert found == {"torch._dynamo", "torch.ao", "torch._inductor", "torch.ops", "._orig_mod",
                     "getattr(..., '_orig_mod')"}, found


LONG_LINE = 100
"""Characters; STYLE.md §6: fewer than one line in ten of the package longer than this (wrapped, not moved)."""


def test_lines_stay_short_enough_to_read_side_by_side():
    lines = [line for p in PACKAGE.rglob("*.py") for line in p.read_text().splitlines()]
    long = sum(len(line) > LONG_LINE for line in lines)
    assert long / len(lines) < 0.10, f"{long} of {len(lines)} lines longer than {LONG_LINE} characters"


def _reads_directions(source: str) -> list[str]:
    """Where source code reads `.directions` (the raw long form of a run's languages) or counts `.corpora`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "directions" and isinstance(node.ctx, ast.Load):
            found.append(f"{node.lineno} .directions")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len" and node.args
                and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "corpora"):
            found.append(f"{node.lineno} len(.corpora)")
    return found


def test_only_the_config_tells_one_direction_from_several():
    """STYLE.md §13: `data.src_lang`/`tgt_lang` and `data.directions` become one list of corpora where the config is
    built (`config/languages.py: corpora_of`); the rest of the package walks `data.corpora` and never asks which
    form a run was written in, nor how many corpora it has."""
    found = [f"{p.relative_to(ROOT)}:{use}" for p in PACKAGE.rglob("*.py") if p.parent.name != "config"
             for use in _reads_directions(p.read_text())]
    assert found == [], found


def test_the_check_above_sees_a_branch_on_directions():
    source = "if config.data.directions:\n    pass\nn = len(data.corpora)\nfor c in config.data.corpora: pass\n"
    assert _reads_directions(source) == ["1 .directions", "3 len(.corpora)"]


def test_the_training_loop_comes_first_in_trainer():
    tree = ast.parse((PACKAGE / "training" / "trainer.py").read_text())
    first = next(node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)))
    assert first.name == "training_loop"


def test_the_license_is_the_license_file_in_a_form_every_setuptools_takes():
    """setuptools >= 77 deprecates `license = {text = ...}` (a banner at every install) and setuptools < 77 (the
    GPU image's no-network install) refuses an SPDX string: the license is the LICENSE file, which both put in the
    metadata as License-File."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "license" not in project and "license-files" not in project
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")

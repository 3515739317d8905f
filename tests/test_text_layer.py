"""The shape of the text-to-text layer: one engine interface, one place that opens paths, one search entry taking
`DecodingConfig` whole, no engine probed for what it can do, no pipeline or rule written twice."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer"
TEXT_LAYER = [PACKAGE / "translate.py", PACKAGE / "passthrough.py", PACKAGE / "cli.py", PACKAGE / "attention_plot.py",
              PACKAGE / "evaluate.py", PACKAGE / "ct2.py", *sorted((PACKAGE / "engines").glob("*.py")),
              *sorted((PACKAGE / "decoding").glob("*.py")), *sorted((PACKAGE / "serve").glob("*.py"))]
PATH_DISPATCH = {"is_ctranslate2_dir", "is_marian_dir", "load_marian", "load_for_inference", "CTranslate2Engine"}
"""What tells or opens a kind of model path: only `engines/` may use it (and the modules that define it)."""


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _functions(path: Path):
    return [n for n in ast.walk(_tree(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_searches_take_at_most_six_parameters():
    """The searches, their steps and the engines' searches: options travel as `DecodingConfig` whole."""
    found = {}
    for path in [*(PACKAGE / "decoding").glob("*.py"), *(PACKAGE / "engines").glob("*.py")]:
        for fn in _functions(path):
            if path.parent.name == "decoding" or fn.name == "search":
                names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg != "self"]
                found[f"{path.name}:{fn.name}"] = len(names) + bool(fn.args.vararg) + bool(fn.args.kwarg)
    assert {"search.py:search", "greedy.py:greedy_decode", "beam.py:beam_search", "sampling.py:sample_decode",
            "pytorch.py:search", "ctranslate2.py:search"} <= set(found)
    assert {k: v for k, v in found.items() if v > 6} == {}


def test_only_the_engines_package_decides_which_engine_opens_a_path():
    users = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "engines" or path.name in ("ct2.py", "hf.py", "checkpoint.py"):
            continue  # the dispatcher itself, and the modules that define what it uses
        for node in ast.walk(_tree(path)):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            imported = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for used in [name, *imported]:
                if used in PATH_DISPATCH:
                    users.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {used}")
    assert users == []


def test_no_engine_is_probed_with_hasattr():
    probes = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in TEXT_LAYER for node in ast.walk(_tree(path))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "args")]
    assert probes == []


def _windows(path: Path, size: int):
    lines = [line.strip() for line in path.read_text().splitlines()]
    code = [(i + 1, line) for i, line in enumerate(lines)
            if line and not line.startswith(("#", "from ", "import ")) and line not in (")", "]", "}", '"""')]
    for k in range(len(code) - size + 1):
        yield code[k][0], "\n".join(line for _, line in code[k:k + size])


def test_no_run_of_eight_lines_is_written_twice():
    seen: dict[str, str] = {}
    repeats = []
    for path in TEXT_LAYER:
        for line, window in _windows(path, 8):
            where = f"{path.relative_to(PACKAGE)}:{line}"
            if window in seen:
                repeats.append(f"{where} repeats {seen[window]}")
            seen.setdefault(window, where)
    assert repeats == []


def test_the_repeat_check_sees_a_repeat(tmp_path):
    body = "".join(f"x{i} = compute({i})\n" for i in range(8))
    (tmp_path / "a.py").write_text(body + "y = 1\n" + body)
    windows = [w for _, w in _windows(tmp_path / "a.py", 8)]
    assert len(windows) != len(set(windows))

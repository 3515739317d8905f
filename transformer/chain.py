"""Chains: a recipe and everything it needs, made in order, resumed where they stopped (`transformer chain`).

    transformer chain --config configs/multi30k_fr_en_bt.yaml            # plan, then run what is missing
    transformer chain --config configs/multi30k_fr_en_bt.yaml --plan     # the plan only

A recipe says what it needs: each `data.synthetic` entry with `made_by` is a corpus made by a model
(`config/sections.py: SynthesisConfig`), whose models may be recipes themselves (trained first), and
`training.init_from` may name a recipe whose model the run starts from. `plan` walks these references into a list
of steps, each naming what it makes (`Step.output`) and what it needs (`Step.needs`), dependencies first:

    train       a recipe into runs/<recipe name> (`transformer train`; --resume when it stopped)
    synthesize  a corpus folder (`transformer synthesize`: it goes on after its last complete chunk)
    evaluate    the run's test scores into runs/<name>/scores.md (`transformer evaluate --run-dir`)

Every trained run is evaluated. Whether a step is done is decided by one rule per kind (`STATES`), from its output
only: a run is finished when its last.pt has made its training.max_steps (stopped when it has a last.pt short of
them); a corpus when its origin.json exists (stopped when its work folder holds a progress.json); an evaluation
when scores.md exists (stopped when some of its eval_test_*.json exist). `run_chain` runs every step that is not
finished, each as a child `transformer` process; interrupted anywhere (Ctrl-C, SIGTERM, the process killed), the
same command goes on: each step resumes from what it saved.

The run folder of a recipe X.yaml is runs/X (as `transformer train` names it by default), relative to the working
directory, as are corpus paths and input files.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config, ConfigError, load_config
from .config.loading import is_recipe, model_checkpoint, run_dir_of
from .files import sha256_of

MISSING, STOPPED, FINISHED = "missing", "stopped", "finished"


@dataclass(frozen=True)
class Step:
    """One step of a chain.

    Attributes:
        kind: "train", "synthesize" or "evaluate".
        output: what it makes: the run folder (train), the corpus folder (synthesize), the run's scores.md
            (evaluate).
        needs: files that must exist before it runs (other steps' outputs, or files given by the recipe).
        command: the `transformer` arguments that make the output (without --resume, which `run_chain` adds to a
            stopped training).
        recipe: the recipe the step belongs to (for the plan and messages).
    """

    kind: str
    output: Path
    needs: tuple[Path, ...]
    command: tuple[str, ...]
    recipe: Path
    note: str = field(default="", compare=False)
    """A remark on an existing output that the plan prints (a corpus made by another model than the recipe's)."""

    def state(self) -> str:
        """MISSING, STOPPED or FINISHED, by the rule of its kind (`STATES`)."""
        return STATES[self.kind](self.output)


def _train_state(run_dir: Path) -> str:
    from .training.checkpoint import checkpoint_path, run_progress

    if not checkpoint_path(run_dir).exists():
        return MISSING
    return FINISHED if run_progress(run_dir)[2] else STOPPED


def _synthesis_state(folder: Path) -> str:
    from .synthesize import work_folder

    if (folder / "origin.json").is_file():
        return FINISHED
    return STOPPED if (work_folder(folder) / "progress.json").is_file() else MISSING


def _evaluation_state(scores: Path) -> str:
    if scores.is_file():
        return FINISHED
    return STOPPED if any(scores.parent.glob("eval_test_*.json")) else MISSING


STATES: dict[str, Callable[[Path], str]] = {
    "train": _train_state,
    "synthesize": _synthesis_state,
    "evaluate": _evaluation_state,
}
"""The one rule of "done" for each kind of step, read from its output."""


class _Planner:
    def __init__(self, overrides: tuple[str, ...], average_last: int) -> None:
        self.overrides, self.average_last = overrides, average_last
        self.steps: dict[Path, Step] = {}
        self.visiting: list[Path] = []

    def add(self, step: Step) -> None:
        known = self.steps.get(step.output)
        if known is None:
            self.steps[step.output] = step
        elif known.command != step.command:
            raise ConfigError(
                f"{step.recipe}: {step.output} is also made by {known.recipe}, another way "
                f"({' '.join(known.command)}): give one of them another path"
            )

    def recipe(self, recipe: Path) -> Path:
        """Add the steps of `recipe` (and what it needs) and return its run folder."""
        run_dir = run_dir_of(recipe)
        if run_dir in self.steps:
            return run_dir
        if recipe.resolve() in self.visiting:
            cycle = " -> ".join(str(p) for p in [*self.visiting, recipe.resolve()])
            raise ConfigError(f"{recipe}: a chain of recipes that needs itself: {cycle}")
        self.visiting.append(recipe.resolve())
        config = load_config(recipe, self.overrides)
        needs = [self.corpus(recipe, config, i) for i in range(len(config.data.synthetic))]
        if config.training.init_from:
            needs.append(self.model(config.training.init_from))
        sets = [a for o in self.overrides for a in ("--set", o)]
        self.add(
            Step(
                "train",
                run_dir,
                tuple(needs),
                ("train", "--config", str(recipe), "--run-dir", str(run_dir), *sets),
                recipe,
            )
        )
        data_sets = [a for o in self.overrides if o.startswith("data.path=") for a in ("--set", o)]
        self.add(
            Step(
                "evaluate",
                run_dir / "scores.md",
                (run_dir / "checkpoints" / "best.pt",),
                (
                    "evaluate",
                    "--run-dir",
                    str(run_dir),
                    "--average-last",
                    str(self.average_last),
                    *data_sets,
                ),
                recipe,
            )
        )
        self.visiting.pop()
        return run_dir

    def model(self, reference: str) -> Path:
        """The checkpoint of a model reference, with the steps that train it when it is a recipe."""
        if is_recipe(reference):
            self.recipe(Path(reference))
        return model_checkpoint(reference)

    def corpus(self, recipe: Path, config: Config, index: int) -> Path:
        entry = config.data.synthetic[index]
        folder = Path(entry.path)
        made = entry.made_by
        if made is None:
            return folder  # given: it must exist before the run
        checkpoints = [self.model(m) for m in made.model]
        command = ["synthesize"]
        for checkpoint in checkpoints:
            command += ["--checkpoint", str(checkpoint)]
        command += ["--input", *made.input, "--output", str(folder)]
        if made.exclude:
            command += ["--exclude", *made.exclude]
        command += [
            "--beam-size",
            str(made.beam_size),
            "--max-length-ratio",
            f"{made.max_length_ratio:g}",
        ]
        if made.sampling:
            command += ["--sampling"]
        if made.max_lines:
            command += ["--max-lines", str(made.max_lines)]
        if entry.direction:
            command += ["--input-lang", entry.direction.split("-")[0]]
        self.add(
            Step(
                "synthesize",
                folder,
                tuple(checkpoints) + tuple(Path(p) for p in [*made.input, *made.exclude]),
                tuple(command),
                recipe,
                _origin_note(folder, checkpoints),
            )
        )
        return folder


def _origin_note(folder: Path, checkpoints: list[Path]) -> str:
    """A remark when an existing corpus was made by other models than `checkpoints` (its origin.json says which):
    other paths, or the same paths whose content has changed since (their SHA-256 differs from the one recorded: a
    model trained again)."""
    origin = folder / "origin.json"
    if not origin.is_file():
        return ""
    try:
        models = json.loads(origin.read_text(encoding="utf-8"))["model"]
        made = [m["path"] for m in models]
    except (ValueError, KeyError, TypeError):
        return f"{origin} is not a synthesize origin.json"
    wanted = [str(c.resolve()) for c in checkpoints]
    if made != wanted:
        return (
            f"made by {', '.join(made)}, not {', '.join(wanted)}: kept as it is (move the folder away to make "
            "it again)"
        )
    changed = [
        m["path"]
        for m in models
        if m.get("sha256")
        and Path(m["path"]).is_file()
        and sha256_of(Path(m["path"])) != m["sha256"]
    ]
    if changed:
        return (
            f"made by an earlier {', '.join(changed)} (its SHA-256 has changed since): kept as it is (move the "
            "folder away to make it again)"
        )
    return ""


def plan(recipe: str | Path, overrides: tuple[str, ...] = (), average_last: int = 5) -> list[Step]:
    """The steps that make `recipe`'s model and scores, dependencies first.

    Args:
        overrides: `section.key=value` settings applied to every recipe the chain trains (`--set`; the
            evaluations take `data.path` from them).
        average_last: the step checkpoints each evaluation averages.

    Raises:
        ConfigError: a recipe that does not load, a chain that needs itself, or one path made two ways.
    """
    planner = _Planner(tuple(overrides), average_last)
    planner.recipe(Path(recipe))
    return list(planner.steps.values())


def check_needs(steps: list[Step]) -> None:
    """Refuse a chain that needs a file no step makes and that does not exist, before anything runs.

    Raises:
        ConfigError: naming the file and the recipe that needs it.
    """
    made = {s.output for s in steps} | {s.output / "checkpoints" / "best.pt" for s in steps}
    for step in steps:
        for need in step.needs:
            if need not in made and not need.exists():
                raise ConfigError(
                    f"{step.recipe}: {step.kind} {step.output} needs {need}, which does not exist and no "
                    "step of the chain makes (a corpus needs data.synthetic[].made_by to be made)"
                )


def describe(steps: list[Step]) -> str:
    """The plan as text: one line per step with its state."""
    lines = []
    for i, step in enumerate(steps, 1):
        state = step.state()
        what = {
            MISSING: "to do",
            STOPPED: "stopped: goes on",
            FINISHED: "done",
        }[state]
        if step.kind == "train" and state == STOPPED:
            from .training.checkpoint import run_progress

            done, total, _ = run_progress(step.output)
            what += f" from update {done} of {total}"
        lines.append(f"{i:2d}. [{what}] {step.kind} {step.output}  ({step.recipe.name})")
        if step.note:
            lines.append(f"      note: {step.note}")
    return "\n".join(lines)


def _child_dies_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM when the chain's process dies (even by SIGKILL), so that no training goes on
    unseen beside the next `transformer chain`."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_step(step: Step, state: str) -> int:
    """Run one step as a child `transformer` process; its exit status. SIGTERM to this process is passed on."""
    command = [*step.command, *(["--resume"] if step.kind == "train" and state == STOPPED else [])]
    print(f"chain: {step.kind} {step.output}: transformer {' '.join(command)}", flush=True)
    child = subprocess.Popen(
        [sys.executable, "-m", "transformer", *command],
        preexec_fn=_child_dies_with_parent if sys.platform.startswith("linux") else None,
    )
    previous = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                return child.wait()
            except (
                KeyboardInterrupt
            ):  # the child got the terminal's Ctrl-C too: wait for it to save and stop
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_chain(steps: list[Step], out: Callable[[str], None] = print) -> int:
    """Run every step that is not finished, in order; 0 when all are finished, else the exit status of the step
    that failed or stopped (130 for an interrupted one: the same command goes on).

    Raises:
        ConfigError: a needed file that no step makes is missing (`check_needs`).
    """
    check_needs(steps)
    for step in steps:
        state = step.state()
        if state == FINISHED:
            continue
        status = run_step(step, state)
        if status == 0 and step.state() != FINISHED:
            out(f"chain: {step.kind} {step.output} ended without finishing ({step.state()})")
            status = 1
        if status != 0:
            how = "stopped" if status in (130, -signal.SIGINT, -signal.SIGTERM, 143) else "failed"
            out(
                f"chain: {step.kind} {step.output} {how} (exit status {status}); the same command goes on "
                "from what it saved"
            )
            return status if status > 0 else 128 - status
    out(f"chain: every step is done; scores in {steps[-1].output}")
    return 0


__all__ = [
    "FINISHED",
    "MISSING",
    "STATES",
    "STOPPED",
    "Step",
    "check_needs",
    "describe",
    "model_checkpoint",
    "plan",
    "run_chain",
    "run_dir_of",
]

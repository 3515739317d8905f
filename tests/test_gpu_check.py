"""`scripts/gpu_check.py --device cpu --quick` runs every stage, so that the GPU check cannot rot between GPU runs:
one CPU device test in place of the CUDA tests, data, training in two precisions, decoding, the train and translate
commands, torchrun (gloo)."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import MULTI30K

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_cpu_and_prints_its_figures(tmp_path):
    if not MULTI30K.is_dir():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    shared = MULTI30K.parents[1]
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                             "--shared", str(shared), "--work", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["errors"] == {}
    assert figures["tests"]["passed"] >= 1 and "failed" not in figures["tests"]  # the stage counts what pytest ran
    assert json.loads((tmp_path / "work" / "figures.json").read_text()) == figures  # also kept on disk
    so_far = [json.loads(line.split("figures so far: ", 1)[1]) for line in result.stderr.splitlines()
              if "figures so far: " in line]  # after each stage, for a log cut short
    assert len(so_far) == 10 and so_far[-1] == {k: v for k, v in figures.items() if k != "total_s"}
    assert figures["pairs"] == 3000 and figures["cache_startup_s"] < figures["prepare_s"]
    assert figures["matmul_tflops_fp32"] > 0
    for precision in ("fp32", "bf16", "fp32_one_batch", "fp32_compiled"):
        run = figures["train"]["base"][precision]
        assert run["tgt_tokens_per_s"] > 0 and 0 < run["mfu"] < 1 and run["last_nll_per_token"] > 0
    one_batch, accumulated = figures["train"]["base"]["fp32_one_batch"], figures["train"]["base"]["fp32"]
    assert one_batch["tgt_tokens_per_step"] == pytest.approx(accumulated["tgt_tokens_per_step"], rel=0.3)
    searches = {(row["search"], row["batch_size"]) for row in figures["decode"]}
    assert searches == {("greedy", 64), ("greedy", 256), ("beam 4", 64), ("beam 4", 256)}
    assert all(row["tgt_tokens_per_s"] > 0 for row in figures["decode"])
    assert figures["train_command"]["steps"] == 5 and figures["train_command"]["translate_s"] > 0
    assert (tmp_path / "work" / "train_command" / "checkpoints" / "best.pt").is_file()
    assert figures["torchrun"] == {**figures["torchrun"], "backend": "gloo", "steps": 5}


def test_stages_are_not_started_once_the_budget_is_spent(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                             "--budget-s", "0.001", "--work", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert (figures["errors"]["tests"] == figures["errors"]["train command"] == figures["errors"]["torchrun"]
            == "not started: --budget-s 0.001 spent")
    assert figures["train"]["base"] == {"fp32": None, "bf16": None, "fp32_one_batch": None,
                                          "fp32_compiled": None} and figures["tests"] is None


@pytest.mark.slow
def test_a_stage_in_this_process_starts_only_with_its_allowance_left(tmp_path):
    if not MULTI30K.is_dir():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    # 200 s: the other quick stages run (in well under that), the compiled one (allowance 240 s) is not started.
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                             "--budget-s", "200", "--skip", "tests,decode,commands,torchrun", "--shared",
                             str(MULTI30K.parents[1]), "--work", str(tmp_path / "w")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(figures["errors"]) == ["train base fp32 compiled"], figures["errors"]
    assert re.fullmatch(r"not started: \d+ s of --budget-s 200 left, it needs about 240 s",
                        figures["errors"]["train base fp32 compiled"])
    assert figures["train"]["base"]["fp32_compiled"] is None and figures["train"]["base"]["fp32_one_batch"]
    assert result.returncode == 1


@pytest.mark.slow
def test_skipped_stage_groups_are_not_run_and_are_listed(tmp_path):
    if not MULTI30K.is_dir():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                             "--skip", "tests,decode,commands,torchrun,compiled", "--shared", str(MULTI30K.parents[1]),
                             "--work", str(tmp_path / "w")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["skipped"] == ["tests", "decode", "train command", "torchrun", "train base fp32 compiled"]
    assert figures["errors"] == {} and figures["tests"] is None and figures["torchrun"] is None
    assert figures["train"]["base"]["fp32"]["tgt_tokens_per_s"] > 0  # base training always runs
    assert figures["train"]["base"]["fp32_one_batch"]["tgt_tokens_per_s"] > 0  # not skipped
    assert figures["train"]["base"]["fp32_compiled"] is None
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--skip", "decode,bigg"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--skip: unknown stage group 'bigg'" in bad.stderr


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_stage_past_its_time_limit_is_stopped_with_processes_in_sessions_of_their_own(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    # A parent that starts a child in a session of its own, as torchrun starts its workers; both hold the pipes.
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(120)\n")
    monkeypatch.setitem(gpu_check.STAGE_TIMEOUT_S, "torchrun", 3)
    start = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_check._run([sys.executable, "-c", code], "torchrun")
    assert time.perf_counter() - start < 30  # not the child's 120 s
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered asynchronously
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)

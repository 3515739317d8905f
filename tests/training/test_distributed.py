"""torchrun with two CPU processes (gloo) equals one process with the same effective batch; bf16; fp16 on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import write_small_config
from transformer.checkpoint import load_checkpoint
from transformer.config import ConfigError, load_config
from transformer.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    """The environment as it is now (the test run's token-cache folder included, set by a fixture after import),
    plus PYTHONFAULTHANDLER: a process that aborts (a C++ std::terminate, say) prints every thread's stack."""
    return {**os.environ, "PYTHONFAULTHANDLER": "1"}


NO_DROPOUT = {"model": {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1,
                        "dropout": 0.0, "attention_dropout": 0.0},
              "data": {"vocab_size": 300, "max_tokens_per_batch": 1024},
              "training": {"max_steps": 4, "warmup_steps": 2, "eval_every_steps": 4, "log_every_steps": 2,
                           "keep_last_checkpoints": 0, "threads": 1, "device": "cpu"}}
"""A model without dropout, trained on the CPU (gloo) also on a machine with GPUs."""


def test_two_processes_equal_one_with_accumulation(tmp_path, multi30k_subset):
    config = write_small_config(tmp_path, multi30k_subset, **NO_DROPOUT)
    env_flags = ["--set", "data.valid_max_sentences=10", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "transformer", "train", "--config", str(config), "--run-dir", str(tmp_path / "ddp"),
                          *env_flags], capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert two.returncode == 0, two.stderr[-6000:]
    assert "2 process(es)" in two.stderr
    # One token cache, built once (by local rank 0; rank 1 waited and mapped it), nothing half-built left.
    built = [p.name.split(".")[0] for p in (tmp_path / "cache").iterdir()
             if not p.name.endswith(".lock") and p.name != "file_sha256.json"]
    assert built == ["train"]
    assert two.stderr.count("token cache: kept") == 1
    single = load_config(config, ["data.valid_max_sentences=10", "training.accumulate_steps=2"])
    train(single, tmp_path / "one")
    a = load_checkpoint(tmp_path / "ddp" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.pt")
    for name, tensor in b["model"].items():
        torch.testing.assert_close(a["model"][name], tensor, atol=2e-5, rtol=1e-4, msg=name)
    # One writer: each step logged once, one set of checkpoints, no stray temporary files.
    steps = [json.loads(line)["step"] for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 4]
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").iterdir()) == ["best.pt", "last.pt"]
    # The losses logged by the two processes together equal the single process's.
    losses = [json.loads(line)["loss"] for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["type"] == "train"]
    single_losses = [json.loads(line)["loss"] for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
                     if json.loads(line)["type"] == "train"]
    assert losses == pytest.approx(single_losses, abs=1e-3)


def test_bf16_trains_and_saves_fp32_weights(tmp_path, multi30k_subset):
    config = load_config(write_small_config(tmp_path, multi30k_subset, **NO_DROPOUT),
                         ["training.precision=bf16", "training.max_steps=12", "training.eval_every_steps=12",
                          "training.warmup_steps=4", "data.valid_max_sentences=10"])
    train(config, tmp_path / "bf16")
    records = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["type"] == "train"]
    assert losses[-1] < losses[0] - 0.5
    weights = load_checkpoint(tmp_path / "bf16" / "checkpoints" / "last.pt")["model"]
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())


def test_fp16_on_cpu_is_a_config_error(tmp_path, multi30k_subset):
    config = load_config(write_small_config(tmp_path, multi30k_subset, **NO_DROPOUT),
                         ["training.precision=fp16", "training.device=cpu"])
    with pytest.raises(ConfigError, match="training.precision: fp16 needs a CUDA device"):
        train(config, tmp_path / "fp16")


def test_resume_with_a_different_number_of_processes(tmp_path, multi30k_subset):
    config = write_small_config(tmp_path, multi30k_subset, **NO_DROPOUT)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "transformer", "train", "--config", str(config), "--run-dir", str(tmp_path / "run"),
                          "--set", "data.valid_max_sentences=10"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=_env())
    assert two.returncode == 0, two.stderr[-6000:]
    resumed = load_config(config, ["data.valid_max_sentences=10", "training.max_steps=6"])
    state = train(resumed, tmp_path / "run", resume=True)
    assert state.step == 6
    before = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["train_state"]
    assert before["step"] == 6 and before["batch_in_epoch"] == 4 * 2 + 2  # 2 batches per update, then 1


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_the_backend_follows_the_training_device_on_a_machine_with_gpus(monkeypatch, device, backend):
    """CPU training under torchrun on a machine with GPUs joins with gloo (nccl has no CPU tensors); CUDA training
    with nccl, each process on GPU LOCAL_RANK. The process group itself is not created: its arguments are checked."""
    from transformer.training import distributed

    joined, chosen = {}, []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: joined.update(kwargs))
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: joined["backend"])
    place = distributed.init_distributed(torch.device(device))
    assert joined == {"backend": backend, "timeout": distributed.PROCESS_GROUP_TIMEOUT}
    assert chosen == ([1] if device == "cuda" else [])
    assert (place.rank, place.world_size, place.local_rank, place.joined) == (1, 2, 1, True)


def test_more_processes_than_gpus_is_refused_in_one_line(monkeypatch):
    from transformer.device import DeviceError
    from transformer.training import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: pytest.fail("joined"))
    with pytest.raises(DeviceError, match=r"LOCAL_RANK=1 trains on CUDA, but this machine shows 1 GPU\(s\)"):
        distributed.init_distributed(torch.device("cuda"))

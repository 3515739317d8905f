import os
import pickle

import pytest
import torch

from transformer import checkpoint as ckpt
from transformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

STATE = {"model": {"w": torch.ones(3)}, "config": {"model": {}}, "step": 5}


def test_round_trip_and_no_temp_files_left(tmp_path):
    path = tmp_path / "c" / "last.pt"
    save_checkpoint(STATE, path)
    loaded = load_checkpoint(path)
    assert loaded["step"] == 5 and torch.equal(loaded["model"]["w"], torch.ones(3))
    assert os.listdir(path.parent) == ["last.pt"]
    umask = os.umask(0o022)
    try:  # readable by others as any file the user writes (not the 0600 of a temporary file)
        save_checkpoint(STATE, path)
        assert path.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_a_folder_written_at_once_gets_the_usual_permissions(tmp_path):
    from transformer.files import write_folder

    def write(staging):
        (staging / "sub").mkdir()
        (staging / "sub" / "model.bin").write_bytes(b"x")
        os.chmod(staging / "sub" / "model.bin", 0o600)  # as some writers leave their files

    umask = os.umask(0o022)
    try:
        write_folder(tmp_path / "export", write)
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "export", *(tmp_path / "export").rglob("*")]}
    assert modes == {"export": 0o755, "sub": 0o755, "model.bin": 0o644}


def test_a_link_is_written_through_and_a_non_file_is_refused(tmp_path):
    target = tmp_path / "real.pt"
    save_checkpoint(STATE, target)
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    save_checkpoint({**STATE, "step": 6}, link)
    assert link.is_symlink() and load_checkpoint(target)["step"] == 6
    os.mkfifo(tmp_path / "pipe")  # like /dev/stdout: replacing it would break it for everyone
    for path in (tmp_path / "pipe", tmp_path):
        with pytest.raises(CheckpointError, match="exists and is not a regular file"):
            save_checkpoint(STATE, path)
    assert (tmp_path / "pipe").exists() and not (tmp_path / "pipe").is_file()


def test_a_save_killed_midway_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint(STATE, path)

    def dying_save(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # the process is interrupted in the middle of writing

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({**STATE, "step": 6}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 5
    assert os.listdir(tmp_path) == ["last.pt"]


def test_truncated_checkpoint_is_one_clear_error(tmp_path):
    path = tmp_path / "best.pt"
    save_checkpoint(STATE, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"best\.pt: not a readable checkpoint") as refused:
        load_checkpoint(path)
    assert not str(refused.value).endswith(" is")  # torch's first sentence, not a cut one
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"best\.pt"):
        load_checkpoint(path)


def test_damaged_bytes_inside_a_checkpoint_are_refused(tmp_path):
    path = tmp_path / "best.pt"
    save_checkpoint({"model": {"w": torch.ones(100_000)}, "config": {"model": {}}}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = b"\xff" * 64  # inside the weights: torch.load would not notice
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"best\.pt: corrupt: the bytes of .* do not match their stored checksum"):
        load_checkpoint(path)


class Payload:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({**STATE, "extra": Payload()}, path)
    with pytest.raises(CheckpointError, match=r"evil\.pt: refused to load: besides tensors .* pickled Python objects"):
        load_checkpoint(path)
    path.write_bytes(pickle.dumps({"model": 1, "config": 2}))  # a plain pickle, not a torch zip file
    with pytest.raises(CheckpointError, match=r"evil\.pt"):
        load_checkpoint(path)


def test_missing_and_foreign_files(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope.pt")
    monkeypatch.chdir(tmp_path)  # a Hugging Face Hub id is not read from the Hub: the error says how to download it
    with pytest.raises(CheckpointError, match=r"hf download Helsinki-NLP/opus-mt-de-en --local-dir opus-mt-de-en\)$"):
        load_checkpoint("Helsinki-NLP/opus-mt-de-en")
    for name, data in (("source.de", "Ein Hund läuft.\n".encode()), ("random.pt", bytes(range(7, 200)))):
        (tmp_path / name).write_bytes(data)  # a text file or random bytes given as a checkpoint: said so, plainly
        with pytest.raises(CheckpointError, match=rf"{name}: not a checkpoint \(a \.pt file") as err:
            load_checkpoint(tmp_path / name)
        assert "pickled" not in str(err.value)
    (tmp_path / "run").mkdir()
    with pytest.raises(CheckpointError, match=r"run is a folder, not a checkpoint file: give a \.pt file"):
        load_checkpoint(tmp_path / "run")
    (tmp_path / "run" / "model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"run is a folder, not a checkpoint file: give a \.pt file"):
        load_checkpoint(tmp_path / "run")  # model folders are told apart by engines.load_model
    from transformer.engines import load_model

    with pytest.raises(CheckpointError, match=r"run holds a CTranslate2 model.bin without transformer_nmt.json: it "
                                              r"was not written by `transformer export`"):
        load_model(tmp_path / "run")
    (tmp_path / "run" / "transformer_nmt.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"run is a CTranslate2 export, not a checkpoint file"):
        load_model(tmp_path / "run")
    torch.save({"weights": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint of this project"):
        load_checkpoint(tmp_path / "other.pt")


def _retag_as_cuda(path):
    """Rewrite a CPU checkpoint so that its tensors claim to live on cuda:0, as if saved on a GPU."""
    import zipfile

    entries = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            entries[name] = z.read(name)
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    old, new = b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0"
    assert old in entries[pkl]
    entries[pkl] = entries[pkl].replace(old, new)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(name, data)


def test_checkpoint_saved_on_cuda_loads_on_cpu(tmp_path):
    path = tmp_path / "gpu.pt"
    save_checkpoint(STATE, path)
    _retag_as_cuda(path)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)  # what a loader without map_location would hit
    loaded = load_checkpoint(path, map_location="cpu")
    assert loaded["model"]["w"].device.type == "cpu"
    assert torch.equal(loaded["model"]["w"], torch.ones(3))


def _documented_keys() -> list[str]:
    """The key names listed in training/checkpoint.py's module docstring (first word of each indented line)."""
    import re

    from transformer.training import checkpoint as fmt
    block = fmt.__doc__.split("Every checkpoint is one dict")[1].split("Files in")[0]
    return re.findall(r"^    (\w+)\s", block, flags=re.M)


def test_written_keys_are_the_documented_ones(trained_run):
    from transformer.training.checkpoint import CHECKPOINT_KEYS, FP16_CHECKPOINT_KEYS, TrainState

    documented = _documented_keys()
    assert documented == [*CHECKPOINT_KEYS, *FP16_CHECKPOINT_KEYS]
    folder = trained_run / "checkpoints"
    assert sorted(load_checkpoint(folder / "last.pt")) == sorted(CHECKPOINT_KEYS)  # fp32: no loss scaler
    assert sorted(load_checkpoint(folder / "step_150.pt")) == sorted(CHECKPOINT_KEYS)
    assert sorted(load_checkpoint(folder / "best.pt")) == sorted(documented[:5])  # no optimizer, no RNG state
    from dataclasses import fields
    assert sorted(load_checkpoint(folder / "last.pt")["train_state"]) == sorted(f.name for f in fields(TrainState))


def test_an_fp16_runs_loss_scale_is_saved_and_restored(trained_run, tmp_path):
    """The GradScaler's state (loss scale, growth tracker) goes into last.pt and step_N.pt and comes back on
    --resume, so that a resumed fp16 run does not restart at the initial scale and skip updates to find it again.
    (The scaler runs on the CPU here; training refuses fp16 off CUDA, but the saved state is the same.)"""
    from transformer.checkpoint import load_for_inference
    from transformer.training.checkpoint import (
        TrainState,
        checkpoint_path,
        restore,
        save_training_checkpoint,
    )
    from transformer.training.distributed import Distributed
    from transformer.training.optim import build_optimizer

    config, model, tokenizer = load_for_inference(trained_run / "checkpoints" / "last.pt")
    optimizer = build_optimizer(model, config.training, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict({"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                            "_growth_tracker": 7})
    run_dir = tmp_path / "run"
    save_training_checkpoint(run_dir, model, optimizer, tokenizer, config, TrainState(step=3), scaler=scaler,
                             device=torch.device("cpu"), keep_step_checkpoint=True)
    saved = load_checkpoint(checkpoint_path(run_dir))
    assert saved["grad_scaler"]["scale"] == 512.0 and saved["rng"]["cuda"] is None  # no GPU generator on the CPU
    fresh = torch.amp.GradScaler("cpu")
    state = restore(run_dir, model, optimizer, config, torch.device("cpu"), Distributed(), fresh)
    assert state.step == 3 and fresh.state_dict() == scaler.state_dict()
    unscaled = torch.amp.GradScaler("cpu")  # a run that was not fp16 before: the scaler starts afresh
    saved.pop("grad_scaler")
    save_checkpoint(saved, checkpoint_path(run_dir))
    restore(run_dir, model, optimizer, config, torch.device("cpu"), Distributed(), unscaled)
    assert unscaled.state_dict()["scale"] == 2.0 ** 16


def test_load_for_inference_rebuilds_config_model_and_tokenizer(trained_run, tmp_path):
    from transformer.checkpoint import load_for_inference

    config, model, tokenizer = load_for_inference(trained_run / "checkpoints" / "best.pt")
    assert not model.training and config.model.src_vocab_size == tokenizer.src_vocab_size
    state = load_checkpoint(trained_run / "checkpoints" / "best.pt")
    state["model"].pop(next(iter(state["model"])))
    save_checkpoint(state, tmp_path / "broken.pt")
    with pytest.raises(CheckpointError, match="broken.pt: the weights do not fit"):
        load_for_inference(tmp_path / "broken.pt")

"""Shared fixtures: a tiny seeded model and helpers to build padded batches."""

from __future__ import annotations

import itertools
import os

# cuBLAS reads this once, at a process's first matrix product: the deterministic resume tests on CUDA need it set
# before any test multiplies a matrix (the trainer's own default comes too late in a shared process).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from transformer import Transformer, TransformerConfig  # noqa: E402
from transformer.config import DecodingConfig  # noqa: E402

PAD = 0


def tiny_config(**changes) -> TransformerConfig:
    """A model small enough for exact checks in milliseconds."""
    sizes = dict(src_vocab_size=23, tgt_vocab_size=29, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                 n_decoder_layers=2, dropout=0.1, attention_dropout=0.1, max_positions=64)
    sizes.update(changes)
    return TransformerConfig(**sizes)


def tiny_model(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(**changes)).eval()


def search_options(**changes) -> DecodingConfig:
    """The `DecodingConfig` for calling a search (`decoding.search`, `greedy_decode`, `beam_search`, `sample_decode`)
    directly, with the keyword defaults those functions had before they took the whole section: max_repeat 0 (no
    limit; DecodingConfig's own default is 3) and, when sampling, beam_size 1; otherwise DecodingConfig's defaults
    (beam_size 4, length_penalty 0.6, n_best 1, max_len_a 1.5, max_len_b 10, min_len 0, no_repeat_ngram_size 0).
    With sampling, n_best is the number of samples per sentence."""
    values = {"max_repeat": 0, **changes}
    if values.get("sampling"):
        values.setdefault("beam_size", 1)
    return DecodingConfig(**values)


def longest_run(tokens: list) -> int:
    """The length of the longest run of one token in `tokens` (0 for none)."""
    return max((len(list(run)) for _, run in itertools.groupby(tokens)), default=0)


def random_tokens(batch: int, length: int, vocab: int, lengths: list[int] | None = None, seed: int = 0):
    """`(batch, length)` random ids in [4, vocab), padded with PAD after lengths[i] tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (batch, length), generator=g)
    if lengths is not None:
        for i, n in enumerate(lengths):
            tokens[i, n:] = PAD
    return tokens


SLOW_FIXTURES = {"trained_run", "multi30k_subset"}
"""Tests that use these (a model trained through the CLI, real data) are marked slow: `make test-fast` skips them."""


def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    """Each device-parametrized test runs on the CPU always and on CUDA when a GPU is present (`pytest -m cuda`
    selects the CUDA half)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


@pytest.fixture(params=[False, True], ids=["post-norm", "pre-norm"])
def model(request) -> Transformer:
    return tiny_model(norm_first=request.param)


# --------------------------------------------------------------------------------------------------
# A small model trained briefly on real Multi30k data, shared by the end-to-end tests.
# --------------------------------------------------------------------------------------------------

import gzip  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

MULTI30K = Path(os.environ.get("MULTI30K_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "data"
                / "multi30k")
"""The Multi30k files ({split}.{lang}.gz): $MULTI30K_DIR, else ../shared/data/multi30k beside the repository."""
N_PAIRS = {"train": 4000, "val": 100, "test_2016_flickr": 100}

SMALL_CONFIG = {
    "model": {"d_model": 64, "n_heads": 4, "d_ff": 256, "n_encoder_layers": 2, "n_decoder_layers": 2,
              "dropout": 0.1, "max_positions": 128, "share_all_embeddings": True},
    "data": {"src_lang": "de", "tgt_lang": "en", "vocab_size": 1000, "max_len": 64,
             "max_tokens_per_batch": 2048},
    "training": {"max_steps": 150, "warmup_steps": 50, "lr_scale": 0.5, "log_every_steps": 25,
                 "eval_every_steps": 75, "seed": 7, "threads": 2, "keep_last_checkpoints": 1},
    "decoding": {"beam_size": 4, "batch_size": 32, "max_len_b": 10},
}


def write_multi30k_subset(folder: Path) -> Path:
    """The first N_PAIRS lines of each Multi30k de/en split, as {split}.{lang}.gz in `folder`."""
    if not MULTI30K.is_dir():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in N_PAIRS.items():
        for lang in ("de", "en"):
            lines = gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8").read().split("\n")[:n]
            (folder / f"{split}.{lang}.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return folder


def write_small_config(folder: Path, data_path: Path, **sections) -> Path:
    raw = yaml.safe_load(yaml.safe_dump(SMALL_CONFIG))
    raw["data"]["path"] = str(data_path)
    for section, values in sections.items():
        raw[section].update(values)
    path = folder / "small.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="session", autouse=True)
def token_cache_dir(tmp_path_factory) -> Path:
    """Token caches of the whole test run (in-process and subprocess runs) go to a temporary folder."""
    import os

    folder = tmp_path_factory.mktemp("token_cache")
    previous = os.environ.get("TRANSFORMER_NMT_CACHE")
    os.environ["TRANSFORMER_NMT_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("TRANSFORMER_NMT_CACHE", None)
    else:
        os.environ["TRANSFORMER_NMT_CACHE"] = previous


@pytest.fixture(scope="session")
def multi30k_subset(tmp_path_factory) -> Path:
    return write_multi30k_subset(tmp_path_factory.mktemp("multi30k"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, multi30k_subset) -> Path:
    """Train the small config for 150 steps through the CLI; returns the run directory."""
    from transformer.cli import main

    folder = tmp_path_factory.mktemp("run")
    config = write_small_config(folder, multi30k_subset)
    run_dir = folder / "run"
    assert main(["train", "--config", str(config), "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture(scope="session")
def looping_checkpoint(trained_run, tmp_path_factory) -> Path:
    """`trained_run`'s best.pt made to loop on one piece: the last decoder layer's last LayerNorm gets weight 0 and
    a bias along that piece's (tied) embedding, so every step's logits are the same, that piece first. Without
    decoding.max_repeat every output repeats it up to the length cap; the rest of the model is the trained one."""
    from transformer.checkpoint import save_checkpoint

    state = torch.load(trained_run / "checkpoints" / "best.pt", weights_only=True)
    weights = state["model"]
    last = max(int(k.split(".")[2]) for k in weights if k.startswith("decoder.layers."))
    embeddings = weights["output_projection.weight"]
    piece = next(i for i in range(4, len(embeddings)) if int((embeddings @ embeddings[i]).argmax()) == i)
    weights[f"decoder.layers.{last}.norm3.weight"].zero_()
    weights[f"decoder.layers.{last}.norm3.bias"].copy_(4 * embeddings[piece])
    path = tmp_path_factory.mktemp("looping") / "looping.pt"
    save_checkpoint(state, path)
    return path

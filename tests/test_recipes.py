"""Every recipe in configs/ loads, and the paper's WMT14 recipes train a few steps on a small local slice."""

import gzip
from pathlib import Path

import pytest

from transformer.checkpoint import load_checkpoint
from transformer.config import load_config
from transformer.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_recipe_loads(path):
    config = load_config(path)
    assert config.model.share_all_embeddings == config.data.joint_vocab


def test_wmt14_recipes_follow_table_3():
    base = load_config(ROOT / "configs/wmt14_en_de_base.yaml")
    big = load_config(ROOT / "configs/wmt14_en_de_big.yaml")
    for config, d_model, d_ff, heads, dropout, steps, keep in ((base, 512, 2048, 8, 0.1, 100_000, 5),
                                                               (big, 1024, 4096, 16, 0.3, 300_000, 20)):
        m, t = config.model, config.training
        assert (m.n_encoder_layers, m.n_decoder_layers, m.d_model, m.d_ff, m.n_heads, m.dropout) == \
            (6, 6, d_model, d_ff, heads, dropout)
        assert (t.max_steps, t.warmup_steps, t.lr_schedule, t.label_smoothing, t.keep_last_checkpoints) == \
            (steps, 4000, "inverse_sqrt", 0.1, keep)
        assert (config.data.hf_dataset, config.data.hf_config, config.data.vocab_size) == ("wmt14", "de-en", 37000)
        assert (config.decoding.beam_size, config.decoding.length_penalty) == (4, 0.6)
        # world_size x accumulate_steps = 8 batches of 3,584 padded tokens per update (about 25k real tokens).
        assert t.accumulate_steps * config.data.max_tokens_per_batch == 8 * 3584


@pytest.fixture(scope="module")
def wmt_slice(tmp_path_factory, multi30k_subset):
    """The Multi30k subset under WMT14's split names, en/de."""
    folder = tmp_path_factory.mktemp("wmt_slice")
    for ours, theirs in (("train", "train"), ("val", "validation"), ("test_2016_flickr", "test")):
        for lang in ("de", "en"):
            lines = gzip.open(multi30k_subset / f"{ours}.{lang}.gz", "rt", encoding="utf-8").read()
            (folder / f"{theirs}.{lang}").write_text(lines, encoding="utf-8")
    return folder


@pytest.mark.parametrize("name", ["wmt14_en_de_base", "wmt14_en_de_big"])
def test_wmt14_recipe_trains_a_few_steps(tmp_path, wmt_slice, name):
    # The recipe's model, optimizer and schedule; data-sized keys shrunk for a CPU test. The big model (177M
    # parameters here, ~9 s an update on 2 cores) takes one update without accumulation; the base one, two with it.
    steps = 1 if name.endswith("big") else 2
    config = load_config(ROOT / f"configs/{name}.yaml", [
        f"data.path={wmt_slice}", "data.vocab_size=1000", "data.max_len=64", "data.max_tokens_per_batch=256",
        "data.valid_max_sentences=4", f"training.max_steps={steps}", f"training.eval_every_steps={steps}",
        f"training.accumulate_steps={steps}", "training.device=cpu", "training.threads=2",
        "decoding.max_len_a=0", "decoding.max_len_b=4",  # validation's greedy BLEU: an untrained model never stops
        "training.keep_last_checkpoints=0",  # last.pt and best.pt only: the big model's full state is ~2 GB a file
        # the recipes' bf16 is for GPUs; a CPU without fast bf16 matmuls emulates it (100x slower on some)
        "training.precision=auto"])
    state = train(config, tmp_path / "run")
    assert state.step == steps
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert saved["config"]["model"]["d_model"] == load_config(ROOT / f"configs/{name}.yaml").model.d_model
    assert saved["train_state"]["step"] == steps


def test_multi30k_recipes_differ_only_in_direction():
    de_en, en_de = (load_config(ROOT / f"configs/multi30k_{pair}.yaml").to_dict() for pair in ("de_en", "en_de"))
    assert (de_en["data"].pop("src_lang"), de_en["data"].pop("tgt_lang")) == ("de", "en")
    assert (en_de["data"].pop("src_lang"), en_de["data"].pop("tgt_lang")) == ("en", "de")
    assert de_en == en_de
    training = de_en["training"]
    assert de_en["data"]["subword_sampling"] and training["max_steps"] % training["eval_every_steps"] == 0


@pytest.mark.parametrize("pair", ["de_en", "en_de"])
def test_back_translation_recipes_are_their_bilingual_recipe_plus_the_reverse_models_corpus(pair):
    """The BT recipe adds the synthetic corpus that `make backtranslate` writes (task 2's target-language text
    translated by the reverse recipe's model, the Makefile's BT_CORPUS) and nothing else."""
    src, tgt = pair.split("_")
    plain = load_config(ROOT / f"configs/multi30k_{pair}.yaml").to_dict()
    bt = load_config(ROOT / f"configs/multi30k_{pair}_bt.yaml").to_dict()
    assert bt["data"].pop("synthetic") == [{"path": f"runs/synthetic/task2_{tgt}_{src}", "name": "bt", "tag": "<bt>",
                                           "weight": 1.0, "direction": ""}]
    assert bt["data"].pop("parallel_weight") == 4.0  # the parallel pairs about half of each epoch
    plain["data"].pop("synthetic"), plain["data"].pop("parallel_weight")
    schedule = {"max_steps": 10000, "eval_every_steps": 2500}  # for about 5x the data (docs/experiments.md)
    assert {key: bt["training"].pop(key) for key in schedule} == schedule
    assert bt == {**plain, "training": {k: v for k, v in plain["training"].items() if k not in schedule}}
    makefile = (ROOT / "Makefile").read_text()
    assert "BT_CORPUS := runs/synthetic/task2_$(BT_TGT)_$(BT_SRC)" in makefile

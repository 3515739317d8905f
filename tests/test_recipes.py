"""Every recipe in configs/ loads, and the paper's WMT14 recipes train a few steps on a small local slice."""

import gzip
import json
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


def test_every_recipe_loads_to_the_config_it_had_when_each_stated_every_key():
    """The recipes rewritten as deltas (`base:`) resolve to exactly the configs their full forms gave (the file holds
    those, saved before the rewrite), apart from what says how a run's inputs are made."""
    before = json.loads((ROOT / "tests" / "recipes_before_base.json").read_text())
    for name, full in before.items():
        config = load_config(ROOT / "configs" / f"{name}.yaml").to_dict()
        for entry in config["data"]["synthetic"]:
            assert entry.pop("made_by") is not None  # every committed corpus says how it is made
        if str(config["training"]["init_from"]).endswith(".yaml"):
            config["training"]["init_from"] = None  # the second stage names the first's recipe
        assert config["data"].pop("language_tokens") == {}  # a key added since, for imported OPUS-MT models
        assert json.loads(json.dumps(config)) == full, name


def test_the_french_recipes_are_the_german_ones_for_another_pair():
    for name, pair in (("multi30k_fr_en", ("fr", "en")), ("multi30k_en_fr", ("en", "fr")),
                       ("multi30k_fr_en_bt", ("fr", "en"))):
        config = load_config(ROOT / "configs" / f"{name}.yaml")
        assert (config.data.src_lang, config.data.tgt_lang) == pair
    bt = load_config(ROOT / "configs/multi30k_fr_en_bt.yaml")
    made = bt.data.synthetic[0].made_by
    assert made.model == [str(ROOT / "configs" / "multi30k_en_fr_reverse.yaml")]
    assert all(path.endswith(".en.gz") for path in made.input + made.exclude)  # English captions into French
    assert load_config(ROOT / "configs/multi30k_en_fr_reverse.yaml").training.max_steps == 3000

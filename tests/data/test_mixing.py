"""Multilingual data: the language tokens, the `data.directions` checks, and the mixing of the directions into an
epoch by temperature sampling (`data/mixing.py`)."""

import numpy as np
import pytest

from transformer.config import ConfigError, DataConfig, config_from_dict
from transformer.config.languages import Corpus, language_token, target_languages
from transformer.data import EncodedPairs, token_batches
from transformer.data.mixing import (
    direction_probabilities,
    direction_shares,
    draw_indices,
    mix_directions,
)


def test_language_tokens_are_named_as_opus_mt_names_them():
    assert [language_token(c) for c in ("de", "en", "fr", "cs")] == [">>deu<<", ">>eng<<", ">>fra<<", ">>ces<<"]
    assert language_token("cmn_Hans") == ">>cmn_Hans<<" and language_token("x") == ">>x<<"  # others as given


def test_a_run_is_a_list_of_corpora_made_once_from_either_form():
    data = DataConfig(path="d", directions=["de-en", "fr-en", "en-fr"])
    assert target_languages(data) == ["en", "fr"]
    assert data.corpora == (Corpus("de", "en", "de-en", "de-en", ">>eng<<"),
                            Corpus("fr", "en", "fr-en", "fr-en", ">>eng<<"),
                            Corpus("en", "fr", "en-fr", "en-fr", ">>fra<<"))
    view = data.corpora[1].section(data)
    assert (view.src_lang, view.tgt_lang, view.corpus.source_pieces) == ("fr", "en", (">>eng<<",))
    assert view.directions == ["fr-en"]  # the section reads that corpus's files, caches and samples
    bilingual = DataConfig(path="d", src_lang="en", tgt_lang="cs")
    assert bilingual.corpora == (Corpus("en", "cs", "en-cs"),) and bilingual.corpus.source_pieces == ()  # no token
    assert bilingual.corpus.files == "" and bilingual.corpus.suffix == ""  # the run's own file names
    assert bilingual.corpus.section(bilingual) == bilingual
    assert target_languages(bilingual) == ["cs"]
    assert "corpora" not in config_from_dict({"model": {}, "data": {"path": "d"}}).to_dict()["data"]  # derived
    with pytest.raises(ValueError, match="Corpus.section"):
        _ = data.corpus
    tagged = Corpus("en", "de", "bt", "bt", ">>deu<<", tag="<bt>")  # a later corpus kind: its tag follows the token
    assert tagged.source_pieces == (">>deu<<", "<bt>") and tagged.section(data).corpus == tagged


@pytest.mark.parametrize("changes, key, message", [
    ({"directions": ["de-en", "deen"]}, "data.directions", "'deen'"),
    ({"directions": ["de-de"]}, "data.directions", "two different language codes"),
    ({"directions": ["de-en", "de-en"]}, "data.directions", "de-en listed more than once"),
    ({"directions": ["de-en"], "joint_vocab": False}, "data.joint_vocab", "one joint vocabulary"),
    ({"direction_temperature": 0.5}, "data.direction_temperature", "at least 1"),
    ({"directions": "de-en"}, "data.directions", "expected a list"),
    ({"directions": [1]}, "data.directions[0]", "expected a string"),
])
def test_a_bad_direction_setting_names_its_key(changes, key, message):
    raw = {"model": {}, "data": {"path": "d", **changes}}
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(raw, vocab_sizes=(100, 100))
    assert err.value.key == key or str(err.value).startswith(key)


def test_the_temperature_goes_from_proportional_to_uniform():
    sizes = [9000, 900, 100]
    assert np.allclose(direction_probabilities(sizes, 1.0), [0.9, 0.09, 0.01])
    p5 = direction_probabilities(sizes, 5.0)
    assert np.allclose(p5, np.array(sizes) ** 0.2 / (np.array(sizes) ** 0.2).sum())
    assert np.allclose(direction_probabilities(sizes, 1e9), [1 / 3] * 3)
    shares = direction_shares(sizes, 5.0)
    assert shares.sum() == sum(sizes) and np.all(np.abs(shares - p5 * sum(sizes)) <= 1)


def test_a_corpus_of_weight_0_adds_no_pairs_to_the_epoch():
    """The references beside a distilled student's corpora (data.parallel_weight 0): the epoch is the weighted
    corpora's pairs, each once at weight 1, not padded to the size of all of them."""
    sizes = [29000, 28974, 141000]
    shares = direction_shares(sizes, 1.0, [0.0, 1.0, 1.0])
    assert shares.tolist() == [0, 28974, 141000]
    assert direction_shares(sizes, 1.0, [0.0, 1.0, 2.0]).sum() == 28974 + 141000
    assert direction_shares(sizes, 1.0, [1.0, 1.0, 1.0]).tolist() == sizes


def _pairs(n: int, direction: int) -> EncodedPairs:
    """n pairs whose source is [direction token, 10 + i % 7, eos] and target [i]: each pair names its direction and
    index."""
    rng = np.random.default_rng(direction)
    lengths = rng.integers(1, 6, n)
    return EncodedPairs.from_lists([[4 + direction] + [10] * int(k) + [3] for k in lengths], [[i] for i in range(n)])


def test_direction_counts_over_many_epochs_follow_the_temperature():
    """Count, over every batch of 40 epochs, which direction each pair comes from: the shares are those of the
    temperature, each direction's pairs within an epoch are distinct (drawn without replacement) while its share is
    below its size, and the subset changes from epoch to epoch."""
    sizes = [3000, 600, 150]
    parts = [_pairs(n, d) for d, n in enumerate(sizes)]
    for temperature in (1.0, 2.0, 5.0, 100.0):
        counts = np.zeros(3)
        seen_first = set()
        for epoch in range(40):
            mixed = mix_directions(parts, sizes, temperature, seed=3, epoch=epoch)
            batches = token_batches(mixed.src_lengths, mixed.tgt_lengths, 256, seed=3, epoch=epoch)
            directions = np.concatenate([mixed.direction[b] for b in batches])
            counts += np.bincount(directions, minlength=3)
            for d in range(3):
                drawn = mixed.index[mixed.direction == d]
                if len(drawn) <= sizes[d]:
                    assert len(set(drawn.tolist())) == len(drawn)
            if epoch < 2:
                seen_first.add(tuple(sorted(mixed.index[mixed.direction == 0].tolist())))
        assert np.allclose(counts / counts.sum(), direction_probabilities(sizes, temperature), atol=1e-3)
        if temperature > 1:
            assert len(seen_first) == 2  # the large direction, under-sampled, gives another subset each epoch


def test_an_epoch_is_fixed_by_the_seed_and_the_epoch_and_its_batches_hold_the_directions_pairs():
    sizes = [50, 20]
    parts = [_pairs(n, d) for d, n in enumerate(sizes)]
    a, b = mix_directions(parts, sizes, 5.0, 1, 4), mix_directions(parts, sizes, 5.0, 1, 4)
    assert np.array_equal(a.direction, b.direction) and np.array_equal(a.index, b.index)
    assert not np.array_equal(a.index, mix_directions(parts, sizes, 5.0, 1, 5).index)
    assert len(a) == 70 and np.bincount(a.direction).tolist() == direction_shares(sizes, 5.0).tolist()
    batch = a.batch([0, len(a) - 1])
    for row, i in enumerate([0, len(a) - 1]):
        part, k = parts[a.direction[i]], int(a.index[i])
        assert batch.src[row, :len(part.src(k))].tolist() == part.src(k).tolist()
        assert batch.src[row, 0].item() == 4 + a.direction[i]  # the direction's token starts the source
        assert batch.tgt_out[row, 0].item() == k
        assert a.src_lengths[i] == part.src_lengths[k] and a.tgt_lengths[i] == part.tgt_lengths[k]


def test_a_share_above_the_size_takes_every_pair_once_per_pass():
    drawn = draw_indices(10, 25, np.random.default_rng(0))
    assert sorted(np.bincount(drawn, minlength=10).tolist()) == [2] * 5 + [3] * 5
    assert sorted(drawn[:10].tolist()) == list(range(10)) and sorted(drawn[10:20].tolist()) == list(range(10))


def test_one_corpus_is_its_epoch_as_it_is_in_order():
    """A bilingual run's epoch is the same `MixedPairs` as any run's, holding its pairs in their order, whatever the
    seed, epoch, temperature or weight: there is nothing to mix, and training sees what it saw without mixing."""
    part = _pairs(30, 0)
    for seed, epoch, weight in ((1, 0, [1.0]), (7, 3, [4.0])):
        mixed = mix_directions([part], [30], 5.0, seed, epoch, weight)
        assert mixed.index.tolist() == list(range(30)) and set(mixed.direction.tolist()) == {0}
        assert np.array_equal(mixed.src_lengths, part.src_lengths)
        assert np.array_equal(mixed.tgt_lengths, part.tgt_lengths)

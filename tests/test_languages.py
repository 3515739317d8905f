"""transformer/config/languages.py: OPUS-MT's target-language tokens and how a user's code names a model's language."""

import pytest

from transformer.config import ConfigError
from transformer.config.languages import (
    find_language,
    language_token,
    parse_direction,
    token_language,
)
from transformer.request import (
    WrittenLanguageError,
    without_written_token,
    written_language,
    written_runs,
)


def test_tokens_are_opus_mt_names_and_read_back():
    assert [language_token(c) for c in ("de", "en", "fr", "cs", "cmn_Hans", "x")] == [
        ">>deu<<", ">>eng<<", ">>fra<<", ">>ces<<", ">>cmn_Hans<<", ">>x<<"]
    tokens = (">>deu<<", ">>fra<<", ">>cmn_Hans<<", ">>fr<<", ">>de<<", "fra", ">>a b<<")
    assert [token_language(t) for t in tokens] == [
        "de", "fr", "cmn_Hans", "fr", "de", None, None]  # two-letter tokens too (older OPUS-MT vocabularies)


@pytest.mark.parametrize("code,expected", [("fr", "fr"), ("fra", "fr"), ("FR", "fr"), ("Fra", "fr"), ("ces", "cs"),
                                           ("en", "en"), ("es", None), ("spa", None), ("f", None)])
def test_a_code_names_the_model_language_with_the_same_token(code, expected):
    assert find_language(code, ["en", "de", "fr", "cs"]) == expected


def test_a_model_named_with_three_letter_codes_takes_two_letter_ones_and_ambiguity_names_none():
    assert find_language("en", ["eng", "deu"]) == "eng" and find_language("cmn_hans", ["cmn_Hans"]) == "cmn_Hans"
    assert find_language("fr", ["fra", "FR"]) is None  # two of the model's codes share a token: no guess


def test_a_direction_is_two_different_codes():
    assert parse_direction("de-en") == ("de", "en")
    for bad in ("de", "de-de", "de-en-fr", "de_en", "-en"):
        with pytest.raises(ConfigError, match="data.directions"):
            parse_direction(bad)


@pytest.mark.parametrize("written", [">>fra<<", ">>FRA<<", ">>fr<<", ">>Fra<<", "  >>fra<<"])
def test_a_written_token_in_any_spelling_of_the_target_is_taken_out(written):
    assert without_written_token([f"{written} A dog runs.", "A cat."], "fr") == ["A dog runs.", "A cat."]


def test_another_languages_token_is_refused_naming_it_and_one_later_in_a_sentence_is_text():
    with pytest.raises(WrittenLanguageError, match="starts with >>deu<< but the target language is fr") as err:
        without_written_token(["A cat.", ">>deu<< A dog."], "fr")
    assert err.value.sentence == 1
    assert without_written_token(["A >>deu<< dog."], "fr") == ["A >>deu<< dog."]
    assert "given by tgt_lang" in str(err.value)
    with pytest.raises(WrittenLanguageError, match=r"fr \('>>deu<< A dog.'\): the model translates into fr only$"):
        without_written_token([">>deu<< A dog."], "fr", only=True)  # a bilingual model: no tgt_lang was chosen


def test_the_written_language_is_the_one_every_sentence_names():
    assert written_language([">>fra<< A.", ">>FR<<B."], ["en", "fr"]) == "fr"
    assert written_language(["A.", "B >>fra<<."], ["en", "fr"]) is None  # only the start of a sentence is read
    assert written_language([">>eng<< A.", "B."], ["en"]) == "en"  # one target: a sentence without a token is plain
    for sentences, message in (([">>eng<< A.", "B."], "sentence 1 starts with >>eng<< and sentence 2 with no language"),
                               (["A.", ">>fra<< B.", ">>eng<< C."], "sentence 2 starts with >>fra<< and sentence 3"),
                               ([">>deu<< A."], "does not translate into: it translates into en, fr")):
        with pytest.raises(WrittenLanguageError, match=message):
            written_language(sentences, ["en", "fr"])


def test_written_runs_split_where_the_named_language_changes():
    lines = [">>fra<< a", ">>fr<< b", "c", "d", ">>eng<< e", ">>xx<< f", ">>xx<< g"]
    assert written_runs(lines, ["en", "fr"]) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert written_runs([], ["en"]) == []

"""Decoding options are declared once, as the fields of `DecodingConfig`: the command line's flags, the server's
request fields and the keywords of `Translator.translate` are made from them, with the short list of exceptions that
`decoding/options.py` documents. An option added the documented way reaches all three."""

import dataclasses
import inspect

import pytest

from transformer import cli
from transformer.config import DecodingConfig
from transformer.config.sections import _option
from transformer.decoding import options as decoding_options
from transformer.decoding.options import SERVER_BATCHING, option_fields

FIELDS = {f.name for f in dataclasses.fields(DecodingConfig)}
EXCEPTIONS = {"translate": set(), "evaluate": {"n_best"}, "attention": {"n_best"}}
"""Per command, the fields it has no flag for (documented in decoding/options.py and docs/decoding.md)."""


def _decoding_flags(command: str) -> dict[str, str]:
    """{dest: flag} of the command's decoding group."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    group = next(g for g in sub._action_groups if g.title.startswith("decoding"))
    return {a.dest: a.option_strings[0] for a in group._group_actions}


@pytest.mark.parametrize("command", sorted(EXCEPTIONS))
def test_each_command_has_a_flag_per_option(command):
    assert set(_decoding_flags(command)) == FIELDS - EXCEPTIONS[command]


def test_flags_are_spelt_from_the_field_names():
    flags = _decoding_flags("translate")
    assert flags["beam_size"] == "--beam-size" and flags["no_repeat_ngram_size"] == "--no-repeat-ngram-size"
    assert flags["copy_unknown"] == "--no-copy-unknown"  # on by default: the flag turns it off
    args = cli.build_parser().parse_args(["translate", "--checkpoint", "x", "--no-copy-unknown", "--top-p", "0.5",
                                          "--sampling", "--max-tokens-per-batch", "900"])
    given = {k: v for k, v in cli._decoding_kwargs(args).items() if v is not None}
    assert given == {"copy_unknown": False, "top_p": 0.5, "sampling": True, "max_tokens_per_batch": 900}


def test_server_request_fields_are_the_options_but_its_batching():
    pytest.importorskip("fastapi")
    from transformer.serve.app import AttentionRequest, TranslateRequest

    options = {f.name for f in option_fields(SERVER_BATCHING)}
    assert options == FIELDS - {"batch_size", "max_tokens_per_batch"}
    assert set(TranslateRequest.model_fields) - {"text", "prefix", "alignment"} == options
    assert set(AttentionRequest.model_fields) - {"text"} == options - {"n_best"}
    for name in options:  # the help of the field is the field's description
        help_text = DecodingConfig.__dataclass_fields__[name].metadata["help"]
        assert TranslateRequest.model_fields[name].description == help_text


def test_translator_takes_every_option_as_a_keyword(trained_run):
    from transformer import Translator

    translator = Translator.from_checkpoint(trained_run / "checkpoints" / "best.pt")
    defaults = {f.name: getattr(translator.config.decoding, f.name) for f in option_fields(("n_best",))}
    sentence = ["Ein Hund rennt über die Wiese."]
    assert translator.translate(sentence, **defaults) == translator.translate(sentence)
    with pytest.raises(ValueError, match="unknown decoding option 'beam'"):
        translator.translate(sentence, beam=2)


CALL_ARGUMENTS = {"translate": {"prefixes"}, "translate_n_best": {"n_best", "scores", "prefixes", "should_stop"}}
"""Per `Translator` method, its named keywords; every other keyword is an option (a field). Those beyond n_best are
arguments of the call, not options (docs/decoding.md): per-sentence prefixes, whether to compute scores, and a
server's check between batches."""


def test_the_translator_s_named_keywords_are_n_best_and_arguments_of_the_call():
    from transformer import Translator

    for name, expected in CALL_ARGUMENTS.items():
        parameters = inspect.signature(getattr(Translator, name)).parameters
        named = {p for p, v in parameters.items() if v.kind is not v.VAR_KEYWORD} - {"self", "sentences"}
        assert named == expected, name
        assert not (named - {"n_best"}) & FIELDS


def test_an_option_added_as_a_field_reaches_the_command_line(monkeypatch):
    """The documented way to add an option (docs/decoding.md): a field with its default and help. The flag follows
    without another edit."""
    extended = dataclasses.make_dataclass(
        "DecodingConfig", [("repetition_penalty", float, _option(1.0, "divide the logits of produced tokens by this"))],
        bases=(DecodingConfig,), frozen=True)
    monkeypatch.setattr(decoding_options, "DecodingConfig", extended)
    for command in EXCEPTIONS:
        assert _decoding_flags(command)["repetition_penalty"] == "--repetition-penalty"
    args = cli.build_parser().parse_args(["translate", "--checkpoint", "x", "--repetition-penalty", "1.2"])
    assert cli._decoding_kwargs(args)["repetition_penalty"] == 1.2

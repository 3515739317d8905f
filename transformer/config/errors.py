"""Configuration errors: `ConfigError` (a bad value in a recipe, naming its key) and `OptionError` (a bad argument of
a library call, naming the parameter), and `_require`, the check every section uses."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Optional


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range: `message` as printed (naming the
    key), `key` the key path at fault where one is ("decoding.n_best"; else None), `detail` the message without it."""

    def __init__(
        self, message: str, key: Optional[str] = None, detail: Optional[str] = None
    ) -> None:
        super().__init__(message)
        self.key, self.detail = key, detail if detail is not None else message


class OptionError(ConfigError):
    """An argument of a library call (a `Translator` option, say) that cannot be honoured.

    The message names the parameters as `{name}` fields of `template`: `str(err)` spells them as Python
    (`workers=2`), `as_flags()` as the command line does (`--workers 2`). Only the fields of `values` are
    replaced; any other text, braces included (a path), is kept as it is.

    Args:
        template: the message, with a `{name}` field for each parameter it names.
        values: each named parameter's value.
    """

    def __init__(self, template: str, **values: object) -> None:
        self.template, self.values = template, values
        super().__init__(self._spell(lambda name, value: f"{name}={value!r}"))

    def as_flags(self) -> str:
        """The message with each parameter spelled as its command-line flag."""
        return self._spell(
            lambda name, value: (
                f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
            )
        )

    def _spell(self, spelling: Callable[[str, object], str]) -> str:
        return re.sub(
            r"\{(\w+)\}",
            lambda m: (
                spelling(m.group(1), self.values[m.group(1)])
                if m.group(1) in self.values
                else m.group(0)
            ),
            self.template,
        )


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}", key=key, detail=message)

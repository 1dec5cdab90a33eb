"""The validation helpers every config section checks its keys with, and :class:`ConfigError`.

Each helper raises :class:`ConfigError` with one line that names the key (``actor.tp``), its
value and what is wrong, so the CLI can print it and exit 2 before anything starts.
``_choice(key, value, CHOICES)`` is also how a key's accepted values reach the configuration
reference: ``tools/gen_config_reference.py`` reads those calls from each section's source.
Pure code: no megarl imports at all, so every section module can use it.
"""

from __future__ import annotations

from enum import Enum


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{key}={value!r}: must be one of {', '.join(choices)}")


def _values(choices: type[Enum]) -> tuple[str, ...]:
    """The config spellings of an enum's members, in declaration order."""
    return tuple(str(member.value) for member in choices)


def _positive(key: str, value: float) -> None:
    _require(value > 0, f"{key}={value}: must be > 0")


def _in_unit_interval(key: str, value: float) -> None:
    """[0, 1): a decay rate or a probability that must leave something behind."""
    _require(0 <= value < 1, f"{key}={value}: must be in [0, 1)")


def _optional_positive(key: str, value: object) -> None:
    """None (automatic) or a number > 0."""
    _require(
        value is None
        or (isinstance(value, int | float) and not isinstance(value, bool) and value > 0),
        f"{key}={value!r}: must be a number > 0, or null for automatic",
    )


def _optional_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    _require(
        value is None or value in choices,
        f"{key}={value!r}: must be one of {', '.join(choices)}, or null",
    )


def _optional_number(key: str, value: object) -> None:
    _require(
        value is None or (isinstance(value, int | float) and not isinstance(value, bool)),
        f"{key}={value!r}: expected a number, or null",
    )

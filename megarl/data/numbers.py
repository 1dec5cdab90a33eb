"""Parsing and normalising the numbers that answers and responses are compared on.

Ground truth and model output spell numbers differently (``"1,234"``, ``"$5"``, ``"5.0"``);
everything is reduced to one canonical string here so rewards compare values, not spellings.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A plain decimal number after commas and currency signs are removed: "-12", "3.5", "7.".
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def normalize_number(text: str) -> str | None:
    """Return the canonical spelling of the number in ``text``, or None if it is not one.

    Commas, ``$`` and whitespace are dropped and a unicode minus becomes ``-``. Integral
    values lose their fractional part (``"5.0"`` -> ``"5"``, ``"-0"`` -> ``"0"``) because
    GSM8K-style sources write the same integer both ways; other decimals keep the digits
    they were given (``"2.50"`` stays ``"2.50"``), which still compares equal numerically.
    """
    cleaned = re.sub(r"[\s,$]", "", text).replace("\u2212", "-")
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    value = _to_decimal(cleaned)
    if value is None:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return cleaned.lstrip("+").rstrip(".")


def numbers_equal(left: str, right: str) -> bool:
    """Compare two number strings by value, so ``"42"`` equals ``"42.0"`` and ``"1,234"``.

    Decimal rather than float keeps large integers exact; anything that does not parse as a
    number is never equal to anything.
    """
    left_norm = normalize_number(left)
    right_norm = normalize_number(right)
    if left_norm is None or right_norm is None:
        return False
    return _to_decimal(left_norm) == _to_decimal(right_norm)


def _to_decimal(text: str) -> Decimal | None:
    """Parse an already-cleaned number string, returning None instead of raising."""
    try:
        return Decimal(text)
    except InvalidOperation:
        return None

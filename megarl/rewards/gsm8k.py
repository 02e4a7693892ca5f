"""GSM8K: the final number of a response against the reference number, the two ways evaluations do it.

  gsm8k            strict: the number after the last `#### ` marker (the format GSM8K's own solutions
                   end with, and what the recipe prompt asks for); no marker, no credit.
  gsm8k_flexible   the last number anywhere in the response, marker or not.

A number is digits with optional sign, thousands commas, a decimal point and a leading `$`:
`#### $1,234.50` reads as 1234.50. Numbers are compared by exact decimal value, so `18`, `18.0` and
`18.00` agree with a reference of `18`; there is no exponent syntax, so `#### 1e999` reads as `1`.
A response scores 1.0 for the right number and 0.0 otherwise (no format credit, as in verl's default).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from megarl.rewards import REWARDS

NUMBER = r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?"
STRICT = re.compile(r"####\s*(" + NUMBER + ")")
ANY_NUMBER = re.compile(NUMBER)


def to_decimal(text: str) -> Decimal | None:
    """The value of a number as the regexes above match it, or of a reference answer; None if it is not one."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def strict_answer(response: str) -> str | None:
    found = STRICT.findall(response)
    return found[-1] if found else None


def flexible_answer(response: str) -> str | None:
    found = ANY_NUMBER.findall(response)
    return found[-1] if found else None


def _matches(extracted: str | None, answer: str) -> float:
    reference = to_decimal(answer)
    if reference is None:
        raise ValueError(f"GSM8K reference answer {answer!r} is not a number")
    return float(extracted is not None and to_decimal(extracted) == reference)


@REWARDS.register("gsm8k")
def gsm8k_strict(response: str, answer: str, sample: dict) -> float:
    return _matches(strict_answer(response), answer)


@REWARDS.register("gsm8k_flexible")
def gsm8k_flexible(response: str, answer: str, sample: dict) -> float:
    return _matches(flexible_answer(response), answer)

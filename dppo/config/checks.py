"""The small checks every config section uses: each raises ConfigError naming the key, the value and what was
expected, in one line. Checks of values only: what the machine has is dppo.launch.machine's to ask."""

from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or has an impossible value."""


INT64_MAX = 2**63 - 1


def shown(value: object) -> str:
    """repr(value), shortened: an error message stays one readable line whatever the value."""
    text = repr(value)
    if isinstance(value, str) or len(text) <= 60:
        return text
    return f"{text[:24]}...({len(text)} characters)"


def require(ok: bool, key: str, value: object, expected: str) -> None:
    """Raise ConfigError naming key, value and what was expected unless ok."""
    if not ok:
        raise ConfigError(f"{key}={shown(value)}: expected {expected}")


def check_numbers(section: object, prefix: str, unbounded: tuple[str, ...] = ()) -> None:
    """Every float field of section finite; every int field within int64 (except those named in unbounded,
    which check their own range). Runs before the section's own rules, which may then compute freely."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}.{f.name}"
        if isinstance(value, bool) or f.name in unbounded:
            continue
        if isinstance(value, float):
            require(math.isfinite(value), key, value, "a finite number")
        elif isinstance(value, int):
            require(-INT64_MAX - 1 <= value <= INT64_MAX, key, value, "an integer within int64 (|value| < 2**63)")


def positive(key: str, value: float) -> None:
    require(value > 0, key, value, "a value > 0")


def nonnegative(key: str, value: float) -> None:
    require(value >= 0, key, value, "a value >= 0")


def one_of(key: str, value: object, choices: tuple) -> None:
    require(value in choices, key, value, "one of " + ", ".join(repr(c) for c in choices))

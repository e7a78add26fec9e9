"""Sizes as people write them (``80GB``, ``1.5TiB``, ``70B`` parameters) and as the plan prints them. Torch-free."""

from __future__ import annotations

import re

from stratagem.errors import ConfigurationError

#: Decimal units as disk and network vendors use them, binary ones as ``nvidia-smi`` reports memory.
BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, what: str = "--memory") -> int:
    """``"80GB"`` -> 80_000_000_000, ``"80GiB"`` -> 85_899_345_920; a number without a unit is refused (is
    ``80`` gigabytes or bytes?)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ConfigurationError(f"{what}={text}: give a positive number of bytes.")
        return text
    match = _NUMBER.match(str(text))
    units = _UNIT_NAMES
    if match is None or float(match.group(1)) <= 0:
        raise ConfigurationError(
            f"{what}={text!r}: give a positive size with a unit, e.g. 80GB or 80GiB ({units})."
        )
    number, unit = match.groups()
    if not unit:
        raise ConfigurationError(
            f"{what}={text!r} has no unit: write {number}GB (10^9 bytes) or {number}GiB (2^30 bytes, what "
            f"nvidia-smi reports). Units: {units}."
        )
    factor = BYTE_UNITS.get(unit.lower())
    if factor is None:
        raise ConfigurationError(f"{what}={text!r}: unknown unit {unit!r}. Units: {units}.")
    return round(float(number) * factor)


def parse_count(text: str | int, what: str) -> int:
    """``"70B"`` -> 70_000_000_000 (``K``, ``M``, ``B``, ``T``; a plain number is a count)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _NUMBER.match(str(text))
    factor = COUNT_UNITS.get(match.group(2).lower()) if match else None
    if match is None or factor is None or float(match.group(1)) <= 0:
        raise ConfigurationError(f"{what}={text!r}: give a positive count, e.g. 1B, 70B, 1T or 350M.")
    return round(float(match.group(1)) * factor)


def format_bytes(value: float | None) -> str:
    """Binary units, three significant figures: ``1.86 GiB``."""
    if value is None:
        return "-"
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{int(value)} B"

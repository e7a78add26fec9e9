"""Strategy names with options, as the Engine (``Trainer(strategy=...)``, ``stratagem run``/``demo
--strategy``), ``stratagem compare --strategies`` and the contract suite's ``--stratagem-strategy`` take them:
``fsdp``, ``fsdp[SHARD_GRAD_OP]``, ``fsdp_tp[tensor_parallel_size=2]``.
Imports nothing heavy (the contract suite's pytest plugin reads these at start-up)."""

from __future__ import annotations

import re
from typing import Any

from stratagem.errors import ConfigurationError

#: ``name[VALUE]`` is short for ``name[sharding_strategy=VALUE]``, the columns of the seeds' table.
SHORTHAND_OPTION = "sharding_strategy"
_LABEL = re.compile(r"^([a-z0-9_]+)(?:\[(.*)\])?$")


def split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: ``ddp,fsdp[a=1,b=2]`` -> ``["ddp", "fsdp[a=1,b=2]"]``."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _option_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_label(item: str, option: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name[options]`` -> the registered name and its options.

    Options are ``key=value`` pairs separated by commas (values: numbers, ``true``/``false``, ``none`` or
    text); a single bare value is the sharding strategy (``fsdp[NO_SHARD]``). ``option`` names where the text
    came from, for the error.
    """
    match = _LABEL.match(item)
    if match is None:
        raise ConfigurationError(
            f"{option}: cannot read {item!r}. Write registered names separated by commas, each "
            "optionally with options in brackets: ddp,fsdp,fsdp[SHARD_GRAD_OP],fsdp[cpu_offload=true]."
        )
    name, inner = match.group(1), match.group(2)
    options: dict[str, Any] = {}
    if inner is not None:
        pairs = [p.strip() for p in inner.split(",") if p.strip()]
        if len(pairs) == 1 and "=" not in pairs[0]:
            options[SHORTHAND_OPTION] = pairs[0]
        for pair in pairs:
            if "=" not in pair:
                if SHORTHAND_OPTION in options:
                    continue
                raise ConfigurationError(
                    f"{option}: option {pair!r} of {item!r} needs a value (key=value); only a single "
                    f"bare value is allowed, meaning {SHORTHAND_OPTION}."
                )
            key, _, value = pair.partition("=")
            options[key.strip()] = _option_value(value.strip())
    return name, options

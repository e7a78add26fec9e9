"""What to run: the columns of ``stratagem compare`` (a strategy name, optionally with options) and the job."""

from __future__ import annotations

import re
from typing import Any

import attrs

from stratagem.errors import ConfigurationError


@attrs.frozen
class Column:
    """One column of the table: a registered strategy and the options it is created with.

    ``label`` is how the user wrote it: ``fsdp``, ``fsdp[SHARD_GRAD_OP]``, ``ddp[static_graph=true]``.
    """

    label: str
    strategy: str
    options: dict[str, Any] = attrs.field(factory=dict, hash=False)


#: ``name[VALUE]`` is short for ``name[sharding_strategy=VALUE]``, the columns of the seeds' table.
SHORTHAND_OPTION = "sharding_strategy"
_COLUMN = re.compile(r"^([a-z0-9_]+)(?:\[(.*)\])?$")


def _split_top_level(text: str) -> list[str]:
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


def parse_columns(text: str) -> list[Column]:
    """Parse ``--strategies``: comma-separated names, each optionally followed by ``[options]``.

    Options are ``key=value`` pairs separated by commas (values: numbers, ``true``/``false``, ``none`` or
    text); a single bare value is the sharding strategy (``fsdp[NO_SHARD]``).
    """
    columns: list[Column] = []
    for item in _split_top_level(text):
        match = _COLUMN.match(item)
        if match is None:
            raise ConfigurationError(
                f"--strategies: cannot read {item!r}. Write registered names separated by commas, each "
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
                        f"--strategies: option {pair!r} of {item!r} needs a value (key=value); only a single "
                        f"bare value is allowed, meaning {SHORTHAND_OPTION}."
                    )
                key, _, value = pair.partition("=")
                options[key.strip()] = _option_value(value.strip())
        if any(c.label == item for c in columns):
            raise ConfigurationError(f"--strategies: {item!r} is listed twice.")
        columns.append(Column(label=item, strategy=name, options=options))
    if not columns:
        raise ConfigurationError("--strategies: name at least one strategy (see `stratagem strategies`).")
    return columns


@attrs.frozen(kw_only=True)
class Job:
    """What every column runs: the same model, data and number of steps."""

    model: str
    steps: int
    batch_size: int
    warmup: int
    seed: int
    accelerator: str
    devices: int
    progress_path: str = ""


def default_warmup(steps: int) -> int:
    """Steps left out of the iterations-per-second figure (allocation, first collectives)."""
    return max(1, min(3, steps // 5)) if steps > 1 else 0

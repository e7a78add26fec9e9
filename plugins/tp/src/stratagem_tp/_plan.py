"""Where a model's tensor-parallel plan comes from, and its checks before anything is split.

Looked for in this order: the strategy's ``plan=`` option, the model's ``tp_plan`` attribute (Hugging Face
transformers models expose their ``base_model_tp_plan`` there, prefixed and merged with the head's entry), and
otherwise none: the model is replicated over the tensor-parallel dimension, with a warning. A plan is a dict of
module-name globs (``fnmatch`` per dotted component, as torch's ``parallelize_module`` matches them) to a style
name or a ``ParallelStyle``, or a callable ``parallelize(model, mesh)`` that applies tensor parallelism itself.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import Any

import attrs
import torch
from torch.distributed.tensor.parallel import ParallelStyle

from stratagem.errors import ConfigurationError
from stratagem_tp import _styles

#: Attributes that hold a head count, on attention modules and on a Hugging Face config.
HEAD_ATTRIBUTES = (
    "num_heads",
    "n_heads",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
)


@attrs.frozen
class ResolvedPlan:
    """What will be applied: concrete module names to styles, or a callable; and where it came from."""

    source: str  # "option", "model.tp_plan", "none"
    styles: dict[str, Any] = attrs.field(factory=dict)  # module name -> ParallelStyle (None: replicate)
    callable: Callable[..., Any] | None = None


def find(option: Any, model: torch.nn.Module) -> tuple[str, Any]:
    """``(source, plan)`` in the documented order of precedence."""
    if option is not None:
        return "option", option
    model_plan = getattr(model, "tp_plan", None)
    if model_plan:
        return "model.tp_plan", model_plan
    return "none", None


def resolve(source: str, plan: Any, model: torch.nn.Module) -> ResolvedPlan:
    """Expand globs to module names and make one style per module; errors name what is wrong."""
    if plan is None:
        return ResolvedPlan(source="none")
    if callable(plan) and not isinstance(plan, Mapping):
        return ResolvedPlan(source=source, callable=plan)
    if not isinstance(plan, Mapping):
        raise ConfigurationError(
            f"tensor-parallel plan from {source}: got {type(plan).__name__}; give a dict of module-name globs to "
            "styles, or a callable parallelize(model, mesh)."
        )
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    styles: dict[str, Any] = {}
    for pattern, entry in plan.items():
        matched = match(pattern, names)
        if not matched:
            raise ConfigurationError(no_match_message(pattern, names, source))
        for name in matched:
            module = modules[name]
            if isinstance(entry, ParallelStyle):
                label, style = type(entry).__name__, entry
            else:
                label = _styles.canonical(entry, pattern)
                style = _styles.style_for(label, module)
            _styles.check_applicable(label, name, module, style)
            # A later entry for the same module wins, as in a dict update.
            styles[name] = style
    return ResolvedPlan(source=source, styles=styles)


def match(pattern: str, names: list[str]) -> list[str]:
    """Module names matching ``pattern`` component by component (``layers.*.attn`` never spans dots)."""
    parts = pattern.split(".")
    return [
        n
        for n in names
        if len(n.split(".")) == len(parts) and all(fnmatch(a, p) for a, p in zip(n.split("."), parts))
    ]


def no_match_message(pattern: str, names: list[str], source: str) -> str:
    close = difflib.get_close_matches(pattern, names, n=3)
    shown = names if len(names) <= 40 else [*names[:40], f"... ({len(names) - 40} more)"]
    hint = f" Closest: {', '.join(close)}." if close else ""
    return (
        f"tensor-parallel plan from {source}: the glob {pattern!r} matches no module.{hint} The model's modules "
        f"are: {', '.join(shown)}. Globs match one dotted component per '*' (e.g. 'blocks.*.mlp.fc1')."
    )


def check_heads(model: torch.nn.Module, plan: ResolvedPlan, tp_size: int) -> None:
    """Each rank must hold whole attention heads: every head count the split modules live under, and the
    model config's, must be divisible by the tensor-parallel size."""
    split = [n for n, s in plan.styles.items() if s is not None and not _replicating(s)]
    if tp_size <= 1 or not split:
        return
    owners: list[tuple[str, Any]] = []
    config = getattr(model, "config", None)
    if config is not None:
        owners.append(("model.config", config))
    # Every module a split one lives under (itself included), gathered once: asked per module, the question
    # cost the modules times the split ones (a thousand layers: millions of comparisons per rank planned).
    under = {name.rsplit(".", depth)[0] for name in split for depth in range(name.count(".") + 1)}
    for name, module in model.named_modules():
        if name and name in under:
            owners.append((name, module))
    for where, owner in owners:
        for attribute in HEAD_ATTRIBUTES:
            heads = getattr(owner, attribute, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 and heads % tp_size:
                raise ConfigurationError(
                    f"tensor parallelism splits attention by heads: {where}.{attribute}={heads} is not divisible "
                    f"by the tensor-parallel size {tp_size}, so some rank would hold part of a head. Choose a "
                    f"tensor_parallel_size that divides {heads} (each rank then holds {attribute} / tp heads), or "
                    "change the model's head count."
                )


def _replicating(style: Any) -> bool:
    from torch.distributed.tensor.parallel import SequenceParallel

    return isinstance(style, SequenceParallel)

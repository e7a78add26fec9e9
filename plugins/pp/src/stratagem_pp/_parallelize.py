"""The steps applied to each stage view, in torchtitan's order: tensor parallelism on the ``tp`` mesh,
activation checkpointing, compile (each of the stage's blocks, with its checkpointing inside), then
``fully_shard`` over the ``dp`` mesh (the stage's blocks as units, the view as the root, which
``torch.distributed.pipelining`` recognises to synchronise gradients once per step)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from stratagem.errors import ConfigurationError
from stratagem.strategies.compiling import Compiler
from stratagem_fsdp import _wrap
from stratagem_fsdp._policy import Policy
from stratagem_pp._split import Split, inside
from stratagem_pp._stage import Skipped
from stratagem_tp import _plan


def check_tensor_parallel(option: Any, model: torch.nn.Module, tp_size: int) -> tuple[str, Any]:
    """Find the plan and check it on the whole model, before the split: a glob that matches nothing there is a
    mistake, while on one stage it may just name another stage's module."""
    source, raw = _plan.find(option, model)
    resolved = _plan.resolve(source, raw, model)
    if resolved.callable is None and resolved.source != "none":
        _plan.check_heads(model, resolved, tp_size)
    return source, raw


def tensor_parallel(
    view: torch.nn.Module, source: str, raw: Any, tp_mesh: Any, deferred: bool
) -> dict[str, str]:
    """Apply the plan's entries that match modules of this stage; return module -> style name."""
    from torch.distributed.tensor.parallel import parallelize_module

    if raw is None:
        return {}
    if callable(raw) and not isinstance(raw, Mapping):
        # A callable receives each stage; modules of other stages are Skipped (falsy) there.
        raw(view, tp_mesh)
        return {"<callable>": getattr(raw, "__name__", type(raw).__name__)}
    names = [n for n, m in view.named_modules() if n and not isinstance(m, Skipped)]
    here = {pattern: style for pattern, style in raw.items() if _plan.match(pattern, names)}
    resolved = _plan.resolve(source, here, view)
    styles = {name: style for name, style in resolved.styles.items() if style is not None}
    if styles:
        # src_data_rank=0: every tp rank keeps rank 0's values (one-process semantics); meta tensors have none.
        parallelize_module(view, tp_mesh, styles, src_data_rank=None if deferred else 0)
    return {name: type(style).__name__ for name, style in styles.items()}


def checkpoint_activations(view: torch.nn.Module, policy: Policy | None) -> int:
    return len(_wrap.checkpoint_activations(view, policy))


def compile_regions(model: torch.nn.Module, compiler: Compiler) -> list[str] | None:
    """The regions ``compile=`` chooses in the whole model, before the split (``None``: compile each stage view
    whole). Chosen on the whole model because a stage may hold a single block, which alone does not repeat."""
    if not compiler.enabled:
        return []
    from stratagem.strategies import region_names

    assert compiler.options is not None
    found = region_names(model, compiler.options)
    return None if "" in found else found


def compile_stage(view: torch.nn.Module, regions: list[str] | None, compiler: Compiler) -> list[str]:
    """Compile this stage's share of ``regions`` in place, each whole (its names stay the model's); return the
    names compiled. The compiler is called on every stage, so that the Engine sees it was (a no-op when the run
    does not compile)."""
    if regions is None or compiler.options is None:
        return compiler(view)
    # Called, even on a stage none of whose modules is a region (the embedding alone): the Engine checks it.
    compiler.called = True
    mine = [n for n in regions if _in_view(view, n)]
    if not mine and compiler.options.regional is None:
        # A stage without blocks (the embedding alone; under a V schedule, rank 0's first and last stages):
        # compiled whole, as a model without repeated blocks is. Named regions (regional=) compile only them.
        return compiler(view)
    whole = Compiler(attrs.evolve(compiler.options, regional=False))
    names = [name for n in mine for name in whole(view.get_submodule(n), prefix=n)]
    compiler.regions += names
    return names


def _in_view(view: torch.nn.Module, name: str) -> bool:
    try:
        return not isinstance(view.get_submodule(name), Skipped)
    except AttributeError:
        return False


def stage_blocks(view: torch.nn.Module, split: Split, index: int) -> list[torch.nn.Module]:
    """The repeated blocks this stage owns, as modules of the view."""
    owned = split.stages[index]
    return [view.get_submodule(b) for b in split.blocks if any(inside(b, o) for o in owned)]


def shard(
    view: torch.nn.Module,
    blocks: list[torch.nn.Module],
    policy: Policy | None,
    dp_mesh: Any,
    mp_policy: Any,
    reshard_after_forward: bool | None,
) -> list[str]:
    """``fully_shard`` each unit (the stage's blocks, or what ``policy`` selects), then the view; return the
    units' names."""
    if _wrap.is_sharded(view):
        return []
    if policy is None:
        ids = {id(b) for b in blocks}
        policy = Policy("predicate", lambda m: id(m) in ids, "the stage's blocks")
    units = _wrap.select_units(view, policy)
    kwargs = {"mesh": dp_mesh, "mp_policy": mp_policy}
    # Kept gathered from forward to backward by default: a pipeline runs many micro-batches through a stage,
    # and the zero-bubble schedules need the parameters until the weight gradients (see PPConfig).
    reshard = False if reshard_after_forward is None else reshard_after_forward
    _wrap.shard_units(units, kwargs, reshard)
    names = {id(m): n for n, m in view.named_modules()}
    _wrap.shard_root(view, kwargs, reshard)
    return [names[id(u)] for u in units]


def check_no_prior_sharding(model: torch.nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()) or _wrap.has_sharded_submodule(model):
        raise ConfigurationError(
            "the model has sharded or tensor-parallel parameters already (stratagem.wrap or parallelize_module "
            "in configure_model); a pipeline strategy splits the whole model first and shards each stage "
            "afterwards. Build the model plainly and give the plans as options (tp_plan=, auto_wrap_policy=)."
        )

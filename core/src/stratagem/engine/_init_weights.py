"""``Engine.setup(..., init_weights=...)``: the model checked against Hugging Face weights, wrapped by the
strategy allocating only, then filled (see :mod:`stratagem.checkpoint._hf_load`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stratagem.checkpoint._hf_load import FROM_CHECKPOINT, Loader, initialise, needing_init
from stratagem.strategies.wrapping import allocating_only, has_meta_tensors

if TYPE_CHECKING:
    from stratagem.engine._strategy_runtime import StrategyRuntime


def wrap_and_load(
    runtime: StrategyRuntime, model: torch.nn.Module, init_weights: Any, wrap: Callable[[], Any]
) -> Any:
    """``wrap()`` the model; with ``init_weights`` (the path or URL of Hugging Face safetensors: a model folder,
    a file, an index; or an ``HFWeights``), first check the model against them, and let a meta model be
    allocated without being initialised, then filled, each rank reading only the parts it holds."""
    if init_weights is None:
        return wrap()
    if init_weights is FROM_CHECKPOINT:
        return _for_checkpoint(runtime.strategy, model, wrap)
    # Checked before anything is allocated: a mismatch costs nothing, on every rank alike.
    loader = Loader(runtime.strategy, model, init_weights)
    # A meta model is allocated shard by shard and not initialised: its values are read next.
    with allocating_only() if has_meta_tensors(model) else contextlib.nullcontext():
        wrapped = wrap()
    loader.load(lambda: runtime.hooks.weight_shards(wrapped, "load"))
    return wrapped


def _for_checkpoint(strategy: Any, model: torch.nn.Module, wrap: Callable[[], Any]) -> Any:
    """A model whose values a checkpoint gives next (a resume won over Hugging Face weights): allocated, with
    only what no checkpoint holds initialised (non-persistent buffers); nothing read."""
    names = needing_init(model, set())
    # From the whole model before wrapping, the same on every rank: all ranks broadcast or none.
    random_state = strategy.broadcast(torch.get_rng_state(), 0) if names else None
    with allocating_only():
        wrapped = wrap()
    if random_state is not None:
        initialise(model, names, random_state)
    return wrapped

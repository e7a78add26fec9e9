"""``Engine.setup(..., init_weights=...)``: the model checked against Hugging Face weights, wrapped by the
strategy allocating only, then filled (see :mod:`stratagem.checkpoint._hf_load`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from stratagem.checkpoint._hf_load import Loader
from stratagem.strategies.wrapping import allocating_only, has_meta_tensors


def wrap_and_load(engine: Any, model: torch.nn.Module, init_weights: Any, wrap: Callable[[], Any]) -> Any:
    """``wrap()`` the model; with ``init_weights`` (the path or URL of Hugging Face safetensors: a model folder,
    a file, an index; or an ``HFWeights``), first check the model against them, and let a meta model be
    allocated without being initialised, then filled, each rank reading only the parts it holds."""
    if init_weights is None:
        return wrap()
    # Checked before anything is allocated: a mismatch costs nothing, on every rank alike.
    loader = Loader(engine.strategy, model, init_weights)
    # A meta model is allocated shard by shard and not initialised: its values are read next.
    with allocating_only() if has_meta_tensors(model) else contextlib.nullcontext():
        wrapped = wrap()
    loader.load(lambda: engine._hooks.weight_shards(wrapped, "load"))
    return wrapped

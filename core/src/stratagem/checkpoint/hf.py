"""Hugging Face weights in and out of every strategy.

- **Load**: ``Trainer(init_weights="path/to/hf_folder")`` or ``engine.setup(model, opt, init_weights=...)`` fill
  a model built on the meta device from safetensors (a folder, a file, an index; local or at a URL), each rank
  reading only the bytes of the parts it holds. :func:`load_weights` does it for a model already set up.
- **Names**: a ``transformers`` model needs nothing; another model declares an adapter (``hf_adapter``
  attribute, or ``adapter=``): a function ``to_hf(name)`` (or an object with a ``to_hf`` method) returning the
  checkpoint's name, a :class:`Fused` (the model fuses checkpoint tensors: q, k, v into qkv), a :class:`Slice`
  (the model keeps apart what the checkpoint fuses), or ``None``. Exports derive the reverse from it.
- **Export**: :func:`export_checkpoint` (``stratagem checkpoint export CKPT OUT --format hf``) writes a
  stratagem checkpoint of any strategy as ``model-0000X-of-0000N.safetensors`` shards and
  ``model.safetensors.index.json``, with the config and tokenizer files of the folder the run started from;
  :func:`save_weights` (and the ``HFExport`` callback) writes a running model's, every rank writing its parts.

A strategy takes part through one hook, ``weight_shards`` (:func:`in_place_shards` for one that shards the
model in place); see docs/hugging-face.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from stratagem.checkpoint._hf_export import export_checkpoint, save_live, unwrapped
from stratagem.checkpoint._hf_load import Loader, _tensors
from stratagem.checkpoint._hf_match import HFWeights
from stratagem.checkpoint._hf_names import Fused, Slice
from stratagem.checkpoint._hf_shards import WeightShard, in_place_shards

__all__ = [
    "Fused",
    "HFWeights",
    "Slice",
    "WeightShard",
    "export_checkpoint",
    "in_place_shards",
    "load_weights",
    "save_weights",
]


def _shards(engine: Any, model: torch.nn.Module, purpose: str) -> list[WeightShard]:
    # Through the Engine's hook caller: add-ons wrapped around the strategy see the call too.
    return engine.weight_shards(model, purpose)


def load_weights(
    engine: Any,
    model: torch.nn.Module,
    source: str | os.PathLike[str],
    *,
    adapter: Any = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Fill ``model``, set up by ``engine`` (``engine.setup``) and before its optimizers are, from the Hugging
    Face safetensors at ``source``, each rank reading the parts it holds. Call it on every rank.

    For a model built on the meta device, pass ``init_weights=`` to ``engine.setup`` instead: there the weights
    are checked before anything is allocated, and nothing is initialised only to be overwritten.

    :returns: ``tensors`` loaded, ``bytes_read`` by this rank, ``seconds``.
    """
    import torch.distributed as dist

    plain = unwrapped(model)
    tensors = _tensors(plain)
    if engine.world_size > 1:  # a pipeline stage holds some tensors only: check against every rank's
        every: list[Any] = [None] * engine.world_size
        dist.all_gather_object(every, tensors)
        tensors = {k: v for part in every for k, v in part.items()}
    loader = Loader(
        engine.strategy, plain, HFWeights(source, adapter=adapter, strict=strict), tensors=tensors
    )
    return loader.load(lambda: _shards(engine, model, "load"))


def save_weights(
    engine: Any,
    model: torch.nn.Module,
    output: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``model`` (set up by ``engine``) as a Hugging Face folder at ``output`` (a directory every rank
    sees, or a store prefix from one node): each part of each tensor written once, by a rank that holds it, in
    place; nothing gathered, no checkpoint first. Call it on every rank. The optimizer state is not written.

    :param max_shard_size: the most data per ``.safetensors`` file (``"5GB"``: 5 x 10**9 bytes, as Hugging
        Face counts; ``"500MiB"``; or bytes).
    :param overwrite: replace an existing non-empty ``output``.
    :returns: ``files``, ``bytes``; this rank's ``bytes_written`` and ``peak_bytes``, the most bytes of tensors
        it held at once beside the model's own (its casts and copies).
    """
    shards = _shards(engine, model, "export")
    return save_live(
        engine.strategy, shards, unwrapped(model), output, max_shard_size=max_shard_size, overwrite=overwrite
    )

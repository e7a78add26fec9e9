"""How a model's tensor names relate to a Hugging Face checkpoint's, and the checks on names, shapes, dtypes.

A model whose names are the checkpoint's needs nothing; a ``transformers`` model held inside a stratagem
Module (``self.model = LlamaForCausalLM(config)``) has its attribute's prefix dropped. Any other model declares
an *adapter*: a function ``to_hf(name)`` (or an object with a ``to_hf`` method), given as ``adapter=`` or as the
module's ``hf_adapter`` attribute, that returns for each of the model's tensor names

- the checkpoint's name of the same tensor (a rename);
- :class:`Fused` — the model's tensor is the checkpoint's tensors concatenated (a fused q/k/v);
- :class:`Slice` — the model's tensor is a part of one checkpoint tensor (the checkpoint fuses what the
  model keeps apart);
- ``None`` — the tensor is not in the checkpoint.

The reverse direction (an export) comes from the same declaration, so an adapter says it once.
Internally each model tensor becomes *links*: a range along one dimension of the model tensor that is a
range along the same dimension of one checkpoint tensor.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

#: At most this many names are listed per kind of mismatch; the rest are counted.
SHOWN = 10


@attrs.frozen
class Slice:
    """Part of the checkpoint tensor ``name``: elements ``start:stop`` along ``dim`` (``stop=None``: to the
    end). The model's tensor is that part."""

    name: str
    dim: int = 0
    start: int = 0
    stop: int | None = None


@attrs.frozen
class Fused:
    """The model's tensor is the checkpoint tensors ``parts`` (names or :class:`Slice`) concatenated along
    ``dim``. ``sizes``: each part's extent along ``dim``; by default the model tensor splits evenly
    (give them for unequal parts, such as q, k, v under grouped-query attention)."""

    parts: Sequence[str | Slice]
    dim: int = 0
    sizes: Sequence[int] | None = None


@attrs.frozen
class Link:
    """Model tensor ``model``'s elements ``start:stop`` along ``dim`` are checkpoint tensor ``hf``'s
    elements ``hf_start:hf_start + (stop - start)`` along the same dimension (other dimensions equal)."""

    model: str
    dim: int
    start: int
    stop: int
    hf: str
    hf_start: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.hf_start == 0


def transformers_prefix(model: torch.nn.Module) -> tuple[str | None, list[str]]:
    """``(prefix, found)``: the attribute path (with a trailing dot) of the one outermost ``transformers``
    model inside ``model`` (``""`` for the model itself), or ``None`` when there is none or several."""
    outer: list[str] = []
    for name, module in model.named_modules():
        if any(name == o or name.startswith(o + ".") for o in outer if o) or "" in outer:
            continue
        if is_transformers_model(module):
            outer.append(name)
    if len(outer) != 1:
        return None, outer
    return (outer[0] + "." if outer[0] else ""), outer


def is_transformers_model(module: Any) -> bool:
    # By class name and module, so that transformers is never imported for a model that does not use it.
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def resolve_adapter(model: torch.nn.Module | None, adapter: Any) -> tuple[Callable[[str], Any], str | None]:
    """``(to_hf, prefix)``: the adapter given, else the module's ``hf_adapter``, else dropping the prefix of
    the model's one ``transformers`` model (``prefix``; ``None`` when there is no adapter at all)."""
    if adapter is None and model is not None:
        adapter = getattr(model, "hf_adapter", None)
    if adapter is not None:
        function = getattr(adapter, "to_hf", adapter)
        if not callable(function):
            raise TypeError(
                f"adapter={adapter!r}: give a function to_hf(name) or an object with a to_hf(name) method."
            )
        return function, None
    prefix = transformers_prefix(model)[0] if model is not None else None
    return with_prefix(prefix or ""), prefix


def with_prefix(prefix: str) -> Callable[[str], Any]:
    def to_hf(name: str) -> str:
        return name[len(prefix) :] if prefix and name.startswith(prefix) else name

    return to_hf


def adapter_path(adapter: Any) -> str | None:
    """``module:name`` an export can import the adapter by later, or ``None`` when it cannot (a lambda, a
    script's ``__main__``): the export then needs ``--adapter``."""
    if adapter is None:
        return None
    target = adapter if callable(adapter) and not hasattr(adapter, "to_hf") else type(adapter)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        return None
    return f"{module}:{name}"


def links_for(
    name: str, shape: tuple[int, ...], spec: Any, hf_shape: Callable[[str], tuple[int, ...] | None]
) -> list[Link]:
    """The links of model tensor ``name`` (of ``shape``) from what its adapter returned. ``hf_shape(name)``
    gives a checkpoint tensor's shape where it is known (a load), else ``None`` (an export)."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = Slice(spec, 0, 0, None)
    if isinstance(spec, Slice):
        spec = Fused([spec], dim=spec.dim, sizes=None)
    if not isinstance(spec, Fused):
        raise TypeError(f"the adapter returned {spec!r} for {name!r}: give a str, Slice, Fused or None.")
    dim = spec.dim % max(len(shape), 1)
    extent = shape[dim] if shape else 1
    parts = [Slice(p, dim) if isinstance(p, str) else p for p in spec.parts]
    if spec.sizes is not None:
        sizes = list(spec.sizes)
    elif len(parts) == 1:
        sizes = [extent]
    elif all(p.stop is not None for p in parts):
        sizes = [p.stop - p.start for p in parts]  # type: ignore[operator]
    else:
        sizes = [extent // len(parts)] * len(parts)
    if len(sizes) != len(parts) or sum(sizes) != extent:
        raise ValueError(
            f"{name}: its {len(parts)} parts along dim {dim} measure {sizes}, which do not add up to the "
            f"model's {extent} (shape {shape}); give Fused(..., sizes=[...])."
        )
    links, position = [], 0
    for part, size in zip(parts, sizes):
        if part.dim % max(len(shape), 1) != dim:
            raise ValueError(f"{name}: a part along dim {part.dim} inside a fusion along dim {dim}.")
        links.append(Link(name, dim, position, position + size, part.name, part.start))
        position += size
    return links


def hf_shapes(links: list[Link], shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors an export writes and their shapes, from the links of every model tensor."""
    found: dict[str, tuple[int, ...]] = {}
    for link in links:
        shape = list(shapes[link.model])
        if shape:
            shape[link.dim] = link.hf_start + link.stop - link.start
        known = found.get(link.hf)
        if known is not None and shape:
            shape[link.dim] = max(shape[link.dim], known[link.dim])
        found[link.hf] = tuple(shape)
    return found


def closest(name: str, candidates: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def listing(names: Sequence[str], candidates: Sequence[str], where: str) -> str:
    """Up to :data:`SHOWN` names, each with the closest of ``candidates``, then how many more."""
    shown = []
    for name in list(names)[:SHOWN]:
        near = closest(name, candidates)
        shown.append(f"{name}" + (f" (closest {where}: {near})" if near else ""))
    more = len(names) - SHOWN
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def can_take(model_dtype: torch.dtype, saved: torch.dtype) -> bool:
    """Whether a model tensor of ``model_dtype`` takes checkpoint values of ``saved``: the same dtype, or a
    floating-point one into a floating-point one (bfloat16 weights fine-tuned in float32)."""
    return model_dtype == saved or (model_dtype.is_floating_point and saved.is_floating_point)

"""Matching a model's tensors with a Hugging Face checkpoint's before anything is read or allocated: every name
found (through the adapter), every shape and dtype fitting, or one error that lists what does not."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs
import torch

from stratagem.checkpoint._hf_names import SHOWN, Link, can_take, links_for, listing
from stratagem.checkpoint._hf_source import Source
from stratagem.errors import CheckpointError


@attrs.frozen
class HFWeights:
    """Hugging Face weights to start from, with options: ``init_weights=HFWeights(path, strict=False)``.

    :param source: a Hugging Face model folder, a ``.safetensors`` file or a ``model.safetensors.index.json``,
        local or at an object-store URL (``s3://...``).
    :param adapter: how the model's tensor names map onto the checkpoint's (a function ``to_hf(name)`` or an
        object with a ``to_hf`` method; see :mod:`stratagem.checkpoint.hf`). Default: the module's
        ``hf_adapter`` attribute, else the names as they are (a ``transformers`` model inside the module has
        its attribute's prefix dropped).
    :param strict: refuse missing or unexpected tensors and mismatched shapes or dtypes (the default); with
        ``False`` they are listed once, the rest is loaded, and what was not loaded is initialised by its
        module (``reset_parameters``, or the ``transformers`` model's own initialisation).
    """

    source: str | os.PathLike[str] = attrs.field(
        converter=lambda s: s if isinstance(s, str) else os.fspath(s)
    )
    adapter: Any = None
    strict: bool = True


def as_request(init_weights: Any) -> HFWeights:
    """An ``init_weights=`` value as :class:`HFWeights`; anything else is refused, naming what is accepted."""
    if isinstance(init_weights, HFWeights):
        return init_weights
    if isinstance(init_weights, (str, os.PathLike)):
        return HFWeights(init_weights)
    raise TypeError(
        f"init_weights={init_weights!r}: give the path or URL of Hugging Face weights (a model folder, a "
        ".safetensors file or its index), or stratagem.checkpoint.hf.HFWeights(path, adapter=..., strict=...)."
    )


def checked_request(init_weights: Any) -> HFWeights:
    """:func:`as_request`, and a local source that does not exist refused at once (before any launch)."""
    from stratagem.checkpoint._hf_source import check_exists

    request = as_request(init_weights)
    check_exists(request.source)
    return request


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: first name}`` of parameters registered under several names (tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


@attrs.define
class Match:
    """Each model tensor's links into the checkpoint; the tensors not loaded (``strict=False``); casts."""

    links: dict[str, list[Link]]
    skipped: set[str]
    casts: dict[tuple[torch.dtype, torch.dtype], int]


def match(
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    source: Source,
    to_hf: Callable[[str], Any],
    tied: dict[str, str],
    strict: bool,
) -> tuple[Match, str | None]:
    """Link every model tensor (``{name: (shape, dtype)}``) to the checkpoint's. Returns the match and, if
    anything does not fit, the message (raised when ``strict``)."""
    entries = source.entries
    links: dict[str, list[Link]] = {}
    missing: dict[str, str] = {}  # checkpoint name expected -> model name
    wrong: list[str] = []
    skipped: set[str] = set()
    casts: dict[tuple[torch.dtype, torch.dtype], int] = {}
    used: set[str] = set()
    # Tied aliases last: one the checkpoint stores once (lm_head tied to the embedding) takes its twin's links.
    for name in sorted(tensors, key=lambda n: n in tied):
        shape, dtype = tensors[name]
        try:
            spec = to_hf(name)
            mine = links_for(name, shape, spec, lambda n: entries[n].shape if n in entries else None)
        except (TypeError, ValueError) as error:
            raise CheckpointError(source.where, f"the adapter cannot map {name!r}: {error}") from error
        absent = [link.hf for link in mine if link.hf not in entries]
        if (absent or spec is None) and tied.get(name) in links:
            links[name] = links[tied[name]]
            continue
        if spec is None:
            missing[f"{name} (the adapter maps it to nothing)"] = name
        for hf in absent:
            missing[hf] = name
        problems = [] if absent else [p for link in mine for p in _fit(link, shape, dtype, entries[link.hf])]
        wrong += problems
        if spec is None or absent or problems:
            skipped.add(name)
            continue
        for link in mine:
            used.add(link.hf)
            saved = entries[link.hf].dtype
            if saved != dtype:
                casts[(saved, dtype)] = casts.get((saved, dtype), 0) + 1
        links[name] = mine
    unexpected = sorted(set(entries) - used)
    if not (missing or unexpected or wrong):
        return Match(links, skipped, casts), None
    lines = ["the model does not match these Hugging Face weights:"]
    if missing:
        lines.append(
            f"  {len(missing)} missing from the checkpoint: {listing(list(missing), unexpected, 'there')}"
        )
    if unexpected:
        expected = [m for m in missing if " " not in m] or sorted({x.hf for ls in links.values() for x in ls})
        lines.append(
            f"  {len(unexpected)} in the checkpoint but not the model: {listing(unexpected, expected, 'expected')}"
        )
    if wrong:
        more = f"; and {len(wrong) - SHOWN} more" if len(wrong) > SHOWN else ""
        lines.append(f"  {len(wrong)} that do not fit: " + "; ".join(wrong[:SHOWN]) + more)
    return Match(links, skipped, casts), "\n".join(lines)


def _fit(link: Link, shape: tuple[int, ...], dtype: torch.dtype, entry: Any) -> list[str]:
    """Why the checkpoint tensor of ``link`` cannot fill its part of the model tensor, if it cannot."""
    hf_shape, problems = entry.shape, []
    size = link.stop - link.start
    expected = list(shape)
    if expected:
        expected[link.dim] = size
    if (
        len(hf_shape) != len(shape)
        or any(hf_shape[d] != expected[d] for d in range(len(shape)) if d != link.dim)
        or (shape and link.hf_start + size > hf_shape[link.dim])
    ):
        what = (
            f"{link.hf}"
            if link.whole and size == (shape[link.dim] if shape else 1)
            else (f"{link.hf}[{link.hf_start}:{link.hf_start + size}] along dim {link.dim}")
        )
        problems.append(
            f"shape of {link.model}: checkpoint {what} is {tuple(hf_shape)}, model {tuple(shape)}"
        )
    elif not can_take(dtype, entry.dtype):
        problems.append(
            f"dtype of {link.model}: checkpoint {str(entry.dtype).removeprefix('torch.')}, model "
            f"{str(dtype).removeprefix('torch.')} (a {str(dtype).removeprefix('torch.')} tensor cannot take those "
            "values; only floating-point dtypes convert into each other)"
        )
    return problems

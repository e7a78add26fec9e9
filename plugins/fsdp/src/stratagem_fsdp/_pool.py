"""Allocating a sharded meta model's tensors that a checkpoint fills next, in one block of memory.

``to_empty`` allocates each shard on its own, and the first write into a fresh allocation faults its pages in
one 4 KiB page at a time: reading a model's weights into freshly allocated shards cost three times the copy
itself (``benchmarks/hf_load_phases.py``), and most shards of a transformer block at 4 ranks (1 to 3 MiB) are
too small for the kernel's 2 MiB pages. One block holding all of a rank's shards, with transparent huge pages
asked for (``madvise``; a no-op where the kernel does not offer them), is faulted in 2 MiB at a time.

The tensors are views of the block: the block is freed when the last of them is. DCP copies a view before
writing it (its storage is larger than the view), so checkpoints stay the size of the shards.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

# A multiple of every dtype's size and of torch's own alignment of CPU allocations.
_ALIGN = 64
_HUGE_PAGE = 2 << 20


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def _pooled(tensor: torch.Tensor) -> bool:
    """A meta tensor whose allocation FSDP keeps as given: FSDP re-allocates an unevenly sharded one padded."""
    if not tensor.is_meta or not _local(tensor).is_contiguous():
        return False
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        return all(
            not isinstance(p, Shard) or tensor.shape[p.dim] % mesh.size(i) == 0
            for i, p in enumerate(tensor.placements)
        )
    return True


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _advise_huge_pages(block: torch.Tensor) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not sys.platform.startswith("linux"):
        return
    start = -(-block.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (block.data_ptr() + block.numel()) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, advice)  # advice only: a refusal leaves ordinary pages


def _like(tensor: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor of ``tensor``'s layout over ``local``. Its spec (mesh, placements, global shape, stride, dtype)
    is shared, not rebuilt: ``DTensor.from_local`` makes a new one and runs an autograd function per tensor,
    most of the allocation's time (FSDP makes its own shards' DTensors this way too). No gradient is asked for:
    ``_apply`` makes the parameter, with the meta parameter's ``requires_grad``."""
    # DTensor's constructor and ``_spec`` are private (FSDP2 calls them so): torch's stubs leave them untyped.
    return DTensor(local, tensor._spec, requires_grad=False)  # type: ignore[call-arg]


def to_empty_in_one_block(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)``, with the meta tensors placed in one block on the CPU (see the module's
    docstring). A tensor already on ``device`` keeps its memory and values, where ``to_empty`` would give it
    fresh memory: one the meta build made on the CPU, or a tied parameter met a second time."""
    if device.type != "cpu":
        model.to_empty(device=device)
        return
    metas = {id(t): t for t in (*model.parameters(), *model.buffers()) if _pooled(t)}
    total = sum(_aligned(_local(t).numel() * t.element_size()) for t in metas.values())
    block = torch.empty(total, dtype=torch.uint8, device=device)
    _advise_huge_pages(block)
    used = 0

    def allocate(tensor: torch.Tensor) -> Any:
        nonlocal used
        if not tensor.is_meta and tensor.device == device:
            # Made off the meta device, or a tied parameter whose block tensor the first visit swapped in.
            if isinstance(tensor, DTensor):
                # The local tensor itself (``to_local`` would run an autograd function); private, untyped.
                return _like(tensor, tensor._local_tensor)  # type: ignore[attr-defined]
            return tensor.detach()
        if not tensor.is_meta:
            return torch.empty_like(tensor, device=device)
        local = _local(tensor)
        nbytes = local.numel() * local.element_size()
        if id(tensor) not in metas or used + nbytes > total:
            return torch.empty_like(tensor, device=device)
        mine = block[used : used + nbytes].view(local.dtype).view(local.shape)
        used += _aligned(nbytes)
        return _like(tensor, mine) if isinstance(tensor, DTensor) else mine

    model._apply(allocate)

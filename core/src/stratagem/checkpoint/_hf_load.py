"""Loading Hugging Face safetensors into a model set up under any strategy, each rank reading only the bytes of
the parts it holds.

The order (``Engine.setup(..., init_weights=...)``):

1. before wrapping, on the plain (usually meta) model: find the weights, link every tensor name to the
   checkpoint's (:mod:`._hf_match`), and refuse a mismatch before anything is allocated;
2. the strategy wraps the model inside :func:`~stratagem.strategies.wrapping.allocating_only`: a meta model is
   allocated, shard by shard, and not initialised;
3. what no checkpoint holds is initialised by its module: non-persistent buffers (rotary frequencies), and
   under ``strict=False`` the tensors that were not found;
4. the strategy's ``weight_shards`` hook says what this rank holds of each tensor, as live views; each is
   filled from the byte runs of its checkpoint tensors (:mod:`._hf_shards`).

A rank that fails makes every rank fail with its error, before the first step.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stratagem.checkpoint._hf_match import HFWeights, Match, as_request, match, tied_names
from stratagem.checkpoint._hf_names import adapter_path, is_transformers_model, resolve_adapter
from stratagem.checkpoint._hf_progress import Progress, agree, size_text
from stratagem.checkpoint._hf_shards import WeightShard, transfers
from stratagem.checkpoint._hf_source import Source
from stratagem.errors import CheckpointError

#: Where a loaded model keeps what an export needs later (the folder it came from, how names map).
RECORD = "_stratagem_hf"
#: ``init_weights`` when a checkpoint loaded right after gives the values (a resume wins over Hugging Face
#: weights): the meta model is allocated, what no checkpoint holds is initialised, nothing is read.
FROM_CHECKPOINT = "(weights from the checkpoint loaded next)"
#: This rank's figures of the last load into a model (tensors, bytes read, seconds), for reports and tests.
REPORT = "_stratagem_hf_report"


def _tensors(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    # A ZeRO-3 parameter's own shape is (0,) once partitioned; DeepSpeed keeps the real one as ds_shape.
    return {
        name: (tuple(getattr(value, "ds_shape", value.shape)), value.dtype)
        for name, value in model.state_dict(keep_vars=True).items()
        if isinstance(value, torch.Tensor)
    }


class Loader:
    """One load of ``request`` into ``model`` under ``strategy``; made before the model is wrapped."""

    def __init__(
        self,
        strategy: Any,
        model: torch.nn.Module,
        request: HFWeights | Any,
        tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        self.strategy = strategy
        self.request = as_request(request)
        self.model = model
        self.source = Source(self.request.source)
        self.adapter = self.request.adapter or getattr(model, "hf_adapter", None)
        to_hf, self.prefix = resolve_adapter(model, self.adapter)
        self.tied = tied_names(model)
        tensors = _tensors(model) if tensors is None else tensors
        self.match, problem = match(tensors, self.source, to_hf, self.tied, self.request.strict)
        if problem is not None:
            if self.request.strict:
                raise CheckpointError(
                    self.source.where,
                    f"{problem}\nNothing was loaded. If the names differ, give the model an adapter (hf_adapter; "
                    "see docs/hugging-face.md); HFWeights(path, strict=False) loads what fits and initialises the "
                    "rest.",
                )
            if strategy.is_global_zero:
                warnings.warn(
                    f"init_weights: loading what fits; {problem}\nWhat was not loaded is initialised by its module.",
                    stacklevel=3,
                )
        self.to_initialise = needing_init(model, self.match.skipped)

    def load(self, shards: Callable[[], list[WeightShard]]) -> dict[str, Any]:
        """Initialise what the checkpoint lacks, then fill this rank's shards; return the report."""
        # to_initialise comes from the whole model before wrapping, the same on every rank: all or none broadcast.
        random_state = self.strategy.broadcast(torch.get_rng_state(), 0) if self.to_initialise else None
        started = time.monotonic()
        report, error = None, None
        try:
            if random_state is not None:
                initialise(self.model, self.to_initialise, random_state)
            report = self._read(shards())
        except Exception as exc:  # every rank raises it below, together
            error = exc
        agree(self.strategy, self.source.where, error, "loading Hugging Face weights")
        self.source.close()
        assert report is not None
        report["seconds"] = time.monotonic() - started
        self.model.__dict__[RECORD] = record(self.source, self.prefix, self.adapter, self.tied)
        self.model.__dict__[REPORT] = report
        if self.strategy.is_global_zero:
            print(describe(report, self.source, self.match), flush=True)
        return report

    def _read(self, shards: list[WeightShard]) -> dict[str, Any]:
        entries = self.source.entries
        work = []
        for shard in shards:
            if shard.name in self.match.skipped:
                continue
            if shard.name not in self.match.links:
                raise CheckpointError(
                    self.source.where,
                    f"the strategy's weight_shards names {shard.name!r}, which the model's state dict (checked "
                    "against the checkpoint before wrapping) does not have.",
                )
            for link in self.match.links[shard.name]:
                work += [(entries[link.hf], t) for t in transfers(shard, link, entries[link.hf].shape)]
        total = sum(t.local.numel() * entry.dtype.itemsize for entry, t in work)
        progress = Progress("init_weights", total, enabled=self.strategy.is_global_zero)
        for entry, t in work:
            local = t.local
            if local.is_contiguous() and local.dtype == entry.dtype and local.device.type == "cpu":
                self.source.read_runs(entry, t.starts, t.length, local)
            else:  # a cast, a strided part or a device tensor: through a buffer of this part alone
                buffer = torch.empty(local.shape, dtype=entry.dtype)
                self.source.read_runs(entry, t.starts, t.length, buffer)
                with torch.no_grad():
                    local.copy_(buffer)
            progress.advance(local.numel() * entry.dtype.itemsize)
        progress.close()
        return {"tensors": len(self.match.links), "bytes_read": self.source.bytes_read, "parts": len(work)}


def record(source: Source, prefix: str | None, adapter: Any, tied: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint of this run keeps for an export: plain values only (checkpoints hold no code)."""
    return {
        "source": str(source.folder),
        "prefix": prefix or "",
        "adapter": adapter_path(adapter),
        "tied": dict(tied),
    }


def describe(report: dict[str, Any], source: Source, found: Match) -> str:
    total = sum(e.nbytes for e in source.entries.values())
    line = (
        f"init_weights: {report['tensors']} tensors from {source.where} ({len(source.files)} files, "
        f"{size_text(total)}); rank 0 read {size_text(report['bytes_read'])} (the parts it holds) in "
        f"{report['seconds']:.1f} s"
    )
    for (saved, dtype), count in sorted(found.casts.items(), key=str):
        line += f"; {count} cast from {str(saved)[6:]} to {str(dtype)[6:]}"
    return line + "."


# -------------------------------------------------------------------------------------------------
# what the checkpoint does not hold
# -------------------------------------------------------------------------------------------------


def needing_init(model: torch.nn.Module, skipped: set[str]) -> list[str]:
    """Modules with meta tensors that no checkpoint fills: non-persistent buffers, and tensors not loaded."""
    names = []
    for name, module in model.named_modules():
        own = [
            (b, t)
            for b, t in module._buffers.items()
            if t is not None and b in module._non_persistent_buffers_set
        ]
        lacking = any(t.is_meta for _, t in own) or any(
            f"{name}.{p}".lstrip(".") in skipped and t is not None and t.is_meta
            for p, t in [*module._parameters.items(), *module._buffers.items()]
        )
        if lacking:
            names.append(name)
    return names


def _owner(model: torch.nn.Module, name: str) -> Any:
    """The innermost ``transformers`` model that contains module ``name``, or ``None``."""
    found, module = None, model
    if is_transformers_model(module):
        found = module
    for part in name.split(".") if name else []:
        module = module._modules.get(part)  # type: ignore[assignment]
        if module is None:
            break
        if is_transformers_model(module):
            found = module
    return found


def initialise(model: torch.nn.Module, names: list[str], random_state: torch.Tensor) -> None:
    """Initialise modules ``names`` of ``model`` as one process would: the ``transformers`` model's
    ``_init_weights(module)`` for its modules, else ``module.reset_parameters()``; sharded parameters through
    whole stand-ins, of which each rank keeps its part. A module another pipeline stage holds is skipped."""
    unable = []
    with torch.no_grad(), _random_state(random_state):
        for name in names:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue  # pruned: another stage's
            owner = _owner(model, name)
            if owner is not None:
                init = getattr(owner, "_init_weights")  # noqa: B009 - transformers' per-module initialiser
                with _whole(module):
                    init(module)
            elif callable(getattr(module, "reset_parameters", None)):
                with _whole(module):
                    module.reset_parameters()  # type: ignore[operator]
            else:
                unable.append(name or type(model).__name__)
    if unable:
        raise CheckpointError(
            "(init_weights)",
            f"modules {unable} have tensors that the checkpoint does not hold (non-persistent buffers, or tensors "
            "strict=False left out) and no reset_parameters() to initialise them; give them one.",
        )


@contextlib.contextmanager
def _random_state(state: torch.Tensor) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


@contextlib.contextmanager
def _whole(module: torch.nn.Module) -> Iterator[None]:
    """Give ``module`` whole plain parameters in place of its sharded ones for the block; then each rank keeps
    its slice. Every rank draws the same numbers, so the slices form one tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    for n, p in sharded.items():
        whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
        module._parameters[n] = torch.nn.Parameter(whole, requires_grad=p.requires_grad)
    try:
        yield
        for n, p in sharded.items():
            mine = distribute_tensor(
                module._parameters[n].detach(), p.device_mesh, p.placements, src_data_rank=None
            )
            p.to_local().copy_(mine.to_local())
    finally:
        for n, p in sharded.items():
            module._parameters[n] = p

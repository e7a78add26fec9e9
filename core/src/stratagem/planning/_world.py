"""A simulated world: one rank of many, in this process, on fake tensors.

The plan sets a strategy up as if this process were rank ``r`` of ``n``: a process group of that size whose
collectives move no data (each records what it would send, :mod:`stratagem.planning._trace`), and torch's
``FakeTensorMode``, in which tensors have shapes, dtypes and devices but no storage. A trillion parameters cost
nothing but the Python objects that describe them.

torch 2.13 ships a fake process group (``backend="fake"``), but its works complete with no value, and
``DistributedDataParallel``'s reducer needs the reduced bucket back from its all-reduce; the group here is a
Python ``ProcessGroup`` (as torch's own threaded test group is) whose works hand the tensors back.

Four things a real world has and this one fakes, each undone when the world closes (checked against torch's
source, torch 2.13):

- object collectives (``broadcast_object_list``, ``all_gather_object``) carry pickles in tensors, and a group
  that moves no data would hand each rank garbage to unpickle. Every simulated rank is this process, holding
  what the source rank would: each keeps its own object.
- ``DistributedDataParallel`` checks at construction that every rank's parameters have the same shapes, reading
  the data of a tensor it fills; the ranks are one model here, so the check is skipped.
- ``DeviceMesh`` computes its ranks' coordinates with index tensors, which must hold values: its construction
  runs outside fake-tensor mode.
- FSDP2 cuts every parameter into one view per rank and keeps one; with fake tensors each view costs tens of
  microseconds, which at 2048 ranks made sharding take minutes. The same views are made on demand instead.

One more, in the fake-tensor mode itself (:func:`fake_tensors`): torch keeps every fake tensor it creates in a
weak-valued memo, and ``swap_tensors`` (which ``Module.to`` uses on fake parameters) refuses a tensor with a weak
reference, so ``model.to(device)`` fails on any model of fake parameters. The mode made here does not memoise
the tensors its operations create (the memo only matters for tensors converted from real ones).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.futures import Future

from stratagem.errors import ConfigurationError
from stratagem.planning._trace import Trace, current_trace

BACKEND = "stratagem_simulated"
_registered = False
_lock = threading.Lock()


def _done(value: Any) -> Any:
    future: Future = Future()
    future.set_result(value)
    return _create_work_from_future(future)


def _bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors)


class SimulatedGroup(dist.ProcessGroup):
    """A process group that moves no data: each collective records its payload in the current trace and
    completes at once, handing its output tensors back as a real group's work would."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._size = size

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names[self]

    def _record(self, op: str, payload: int) -> None:
        trace = current_trace()
        if trace is not None:
            trace.record(op, self._size, payload)

    # Each method's payload is what the trace's per-op rule is written for: the whole reduced tensor, the whole
    # gathered output, the whole input of a reduce-scatter.
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._record("all_reduce", _bytes(tensors))
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._record("all_reduce", _bytes(tensors))
        return _done(tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._record("all_gather", _bytes(inputs) * self._size)
        return _done(outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._record("all_gather", _bytes(output))
        return _done([output])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._record("all_gather", _bytes(outputs))
        return _done(outputs)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        self._record("reduce_scatter", _bytes(outputs) * self._size)
        return _done(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._record("reduce_scatter", _bytes(input))
        return _done([output])

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._record("reduce_scatter", _bytes(inputs))
        return _done(outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._record("broadcast", _bytes(tensors))
        return _done(tensors)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        self._record("all_to_all", _bytes(input))
        return _done([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        self._record("all_to_all", _bytes(inputs))
        return _done(outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        self._record("send", _bytes(tensors))
        return _done(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return _done([])


def _create_group(store: Any, rank: int, world_size: int, timeout: Any) -> SimulatedGroup:
    return SimulatedGroup(rank, world_size)


def _register_backend() -> None:
    global _registered
    with _lock:
        if not _registered:
            dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])
            _registered = True


def fake_tensors() -> FakeTensorMode:
    """Torch's fake-tensor mode, with real tensors allowed as inputs (a strategy's index and random-state
    tensors), and without the memo of created tensors that breaks ``Module.to`` (see the module docstring)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def from_meta_and_device(
        fake_mode: FakeTensorMode,
        t: torch.Tensor,
        device: torch.device,
        pytype: Any = None,
        dispatch_keys: Any = None,
    ) -> FakeTensor:
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)

    mode.fake_tensor_converter.from_meta_and_device = from_meta_and_device  # type: ignore[method-assign]
    return mode


class _LazyChunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` items (FSDP2's ``_chunk_with_empty``),
    each chunk made when asked for: the same views, for the one or two that FSDP2 reads."""

    def __init__(self, tensor: torch.Tensor, chunks: int, dim: int) -> None:
        self.tensor, self.chunks, self.dim = tensor, chunks, dim
        size = tensor.size(dim)
        self.size = size
        self.step = -(-size // chunks) if size else 0  # torch.chunk's: ceil(size / chunks)

    def __len__(self) -> int:
        return self.chunks

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -self.chunks <= index < self.chunks:
            raise IndexError(index)
        index %= self.chunks
        start = index * self.step
        if start < self.size or self.size == 0:  # an empty tensor gives as many empty chunks as asked
            return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))
        # torch.chunk gives fewer chunks than asked when they run out; FSDP2 pads with empties like chunk 0.
        return self[0].new_empty(0)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(self.chunks))


def _object_broadcast(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    return None  # every simulated rank holds what the source holds: its own object


def _object_all_gather(object_list: list[Any], obj: Any, group: Any = None) -> None:
    object_list[:] = [obj] * len(object_list)


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    if not hasattr(target, name):
        yield  # this torch has no such thing to stand in for: run without the stand-in
        return
    saved = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, saved)


def _mesh_init_outside_fake_tensors(original: Any) -> Any:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    return init


@contextlib.contextmanager
def simulated_world(rank: int, world_size: int) -> Iterator[Trace]:
    """This process as rank ``rank`` of ``world_size``: the default process group is a :class:`SimulatedGroup`,
    torch's distributed helpers are made to work without data (see the module docstring), and the
    collectives go to the trace yielded. Everything is undone on exit."""
    if dist.is_initialized():
        raise ConfigurationError(
            "stratagem plan simulates a world of its own, but this process has a process group already "
            f"(backend {dist.get_backend()!r}, world size {dist.get_world_size()}). Plan in a process that has "
            "none: before the Trainer or Engine sets up, or with `stratagem plan` from the command line."
        )
    from torch.distributed import device_mesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.nn.parallel import distributed as ddp

    _register_backend()
    _forget_meshes()
    trace = Trace()
    # init_process_group prefixes this process's tracebacks with the rank ([rank3]: ...), once per group.
    excepthook = sys.excepthook
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(trace.active())
            stack.enter_context(_patched(dist, "broadcast_object_list", _object_broadcast))
            stack.enter_context(_patched(dist, "all_gather_object", _object_all_gather))
            stack.enter_context(
                _patched(ddp, "_verify_param_shape_across_processes", lambda *args, **kwargs: None)
            )
            mesh_init = device_mesh.DeviceMesh.__init__
            stack.enter_context(
                _patched(device_mesh.DeviceMesh, "__init__", _mesh_init_outside_fake_tensors(mesh_init))
            )
            stack.enter_context(_patched(_fsdp_param, "_chunk_with_empty", _LazyChunks))
            yield trace
    finally:
        dist.destroy_process_group()
        _forget_meshes()
        sys.excepthook = excepthook


def _forget_meshes() -> None:
    """Empty DTensor's caches of shardings and redistribution plans. They are keyed by a mesh's layout, which
    every simulated rank's mesh shares, and hold the mesh they were made on: a rank simulated after another would
    run its collectives on the other's mesh, whose groups are not its own (or are gone)."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch's cache
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()

"""Measuring inside each worker: local bytes of parameters, gradients and optimizer state, RSS, step times."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from stratagem.cli.compare._columns import Column, Job
from stratagem.cli.compare._model_choice import _make_optimizer, _training_loss, load_model_factory

MB = 2**20


def current_rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``; the peak so far elsewhere)."""
    try:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def local_bytes(tensor: Any) -> int:
    """Bytes this rank holds for ``tensor``: the local shard of a DTensor, the whole of anything else."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def parameter_bytes(model: Any) -> int:
    return sum(local_bytes(p) for p in model.parameters())


def gradient_bytes(model: Any, optimizers: Sequence[Any] = ()) -> int:
    """Gradients alive now: the model's, those of parameters an optimizer keeps apart from the model (flat
    master partitions), and gradient partitions a ZeRO-style optimizer holds itself (``averaged_gradients``,
    ``grads_in_partition``; counted once per buffer, since they are views of it)."""
    import torch

    seen = {id(p) for p in model.parameters()}
    total = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    total += sum(local_bytes(p.grad) for p in _optimizer_own_params(optimizers, seen) if p.grad is not None)
    held: list[Any] = []
    for optimizer in optimizers:
        for inner in _inner_optimizers(optimizer):
            attributes = getattr(inner, "__dict__", {})
            partitions = attributes.get("averaged_gradients")
            if isinstance(partitions, dict):
                for value in partitions.values():
                    held += [value] if isinstance(value, torch.Tensor) else list(value or [])
            held.append(attributes.get("grads_in_partition"))
    buffers: dict[int, int] = {}
    for tensor in held:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            buffers[storage.data_ptr()] = storage.nbytes()
    return total + sum(buffers.values())


def _inner_optimizers(optimizer: Any) -> Iterator[Any]:
    """The optimizer and those it wraps: ``.optimizer`` chains (stratagem's wrapper, ZeRO optimizers) and an
    ``.engine.optimizer`` beside them (an optimizer that steps through a training engine)."""
    seen: set[int] = set()
    pending = [optimizer]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.append(getattr(current, "optimizer", None))
        pending.append(getattr(getattr(current, "engine", None), "optimizer", None))


def _optimizer_own_params(optimizers: Sequence[Any], model_params: set[int]) -> Iterator[Any]:
    import torch

    seen = set(model_params)
    for optimizer in optimizers:
        for inner in _inner_optimizers(optimizer):
            for group in getattr(inner, "param_groups", []):
                for param in group.get("params", []):
                    if isinstance(param, torch.Tensor) and id(param) not in seen:
                        seen.add(id(param))
                        yield param


def optimizer_bytes(model: Any, optimizers: Sequence[Any]) -> int:
    """Optimizer state (moments, steps) plus parameters the optimizer holds apart from the model (masters)."""
    import torch

    counted: set[int] = set()
    total = 0
    for optimizer in optimizers:
        for inner in _inner_optimizers(optimizer):
            state = getattr(inner, "state", None)
            if not isinstance(state, dict):
                continue
            for per_param in state.values():
                if not isinstance(per_param, dict):
                    continue
                for value in per_param.values():
                    if isinstance(value, torch.Tensor) and id(value) not in counted:
                        counted.add(id(value))
                        total += local_bytes(value)
    model_params = {id(p) for p in model.parameters()}
    total += sum(local_bytes(p) for p in _optimizer_own_params(optimizers, model_params))
    return total


def _write_progress(path: str, text: str) -> None:
    if path:
        try:
            with open(path, "w") as file:
                file.write(text)
        except OSError:
            pass


def _move(batch: Any, device: Any) -> Any:
    if hasattr(batch, "to"):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_move(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: _move(value, device) for key, value in batch.items()}
    return batch


def _measure(column: Column, job: Job) -> dict[str, Any]:
    """One worker of one column: build, train ``job.steps`` steps, return this rank's figures."""
    import torch

    from stratagem.engine import Engine
    from stratagem.registry._manager import get_registry

    strategy: Any = column.strategy
    if column.options:
        strategy = get_registry().get(column.strategy).create(**column.options)
    engine = Engine(strategy=strategy, accelerator=job.accelerator, devices=job.devices)
    engine.setup_environment()
    rank, device = engine.rank, engine.device
    progress = job.progress_path if rank == 0 else ""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    baseline_rss = current_rss_bytes()
    baseline_cuda = torch.cuda.memory_allocated(device) if cuda else 0

    engine.seed_everything(job.seed)
    factory = load_model_factory(job.model)
    with engine.init_module(empty_init=True):
        module = factory()
        if callable(getattr(module, "configure_model", None)):
            module.configure_model()
    wrapped, optimizer = engine.setup(module, _make_optimizer(module))
    # Batches follow the data-parallel rank, as a sampler's would: ranks that split layers between them (tensor
    # parallelism) must compute on the same samples.
    data = engine.strategy.distributed_sampler_kwargs()
    generator = torch.Generator().manual_seed(job.seed * 1_000_003 + data["rank"])
    times, losses, grads = [], [], 0
    for step in range(job.steps):
        batch = _move(module.example_batch(job.batch_size, generator), device)
        start = time.perf_counter()
        with engine.forward_context():
            loss = _training_loss(wrapped, module, batch, step)
        engine.backward(loss, wrapped)
        if step == job.steps - 1:
            # Gradients are alive between backward and the optimizer step; count them there.
            grads = gradient_bytes(wrapped, [optimizer])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach().float().cpu()))
        _write_progress(progress, str(step + 1))
    engine.barrier("compare-end")
    params = parameter_bytes(wrapped)
    opt_state = optimizer_bytes(wrapped, [optimizer])
    peak_rss = peak_rss_bytes()
    result = {
        "rank": rank,
        "parameter_bytes": params,
        "gradient_bytes": grads,
        "optimizer_bytes": opt_state,
        "state_bytes": params + grads + opt_state,
        "peak_rss_bytes": peak_rss,
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_above_baseline_bytes": max(0, peak_rss - baseline_rss),
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "cuda_baseline_bytes": baseline_cuda if cuda else None,
        "step_times_s": times,
        "losses": losses,
        "final_loss": losses[-1],
        "samples_per_step": job.batch_size * data["num_replicas"],
        "allocator_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
        "threads": torch.get_num_threads(),
    }
    engine.teardown()
    return result

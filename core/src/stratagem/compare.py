"""``stratagem compare``: train the same model on the same data under several strategies, one launch each, and
report per-rank memory and iterations per second side by side (the shape of the seeds' DDP vs FSDP tables).

Each column is a real multi-process run started by stratagem's launcher; every worker builds an
:class:`~stratagem.Engine` for the column's strategy and measures itself:

- the bytes of its parameters, gradients and optimizer state, counting only what the rank holds (the local
  shard of a ``DTensor``);
- on CPU its peak RSS (``ru_maxrss``) and the same peak minus the RSS it had before the model was built
  (the interpreter, torch and the process group are in the baseline, so the difference is what training took);
- on CUDA ``torch.cuda.max_memory_allocated`` of its device (and the RSS figures too);
- the time of each step; iterations per second are counted on rank 0 after a few warm-up steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from stratagem.errors import ConfigurationError

MB = 2**20

# -------------------------------------------------------------------------------------------------
# what to run
# -------------------------------------------------------------------------------------------------


@attrs.frozen
class Column:
    """One column of the table: a registered strategy and the options it is created with.

    ``label`` is how the user wrote it: ``fsdp``, ``fsdp[SHARD_GRAD_OP]``, ``ddp[static_graph=true]``.
    """

    label: str
    strategy: str
    options: dict[str, Any] = attrs.field(factory=dict, hash=False)


#: ``name[VALUE]`` is short for ``name[sharding_strategy=VALUE]``, the columns of the seeds' table.
SHORTHAND_OPTION = "sharding_strategy"
_COLUMN = re.compile(r"^([a-z0-9_]+)(?:\[(.*)\])?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: ``ddp,fsdp[a=1,b=2]`` -> ``["ddp", "fsdp[a=1,b=2]"]``."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _option_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_columns(text: str) -> list[Column]:
    """Parse ``--strategies``: comma-separated names, each optionally followed by ``[options]``.

    Options are ``key=value`` pairs separated by commas (values: numbers, ``true``/``false``, ``none`` or
    text); a single bare value is the sharding strategy (``fsdp[NO_SHARD]``).
    """
    columns: list[Column] = []
    for item in _split_top_level(text):
        match = _COLUMN.match(item)
        if match is None:
            raise ConfigurationError(
                f"--strategies: cannot read {item!r}. Write registered names separated by commas, each "
                "optionally with options in brackets: ddp,fsdp,fsdp[SHARD_GRAD_OP],fsdp[cpu_offload=true]."
            )
        name, inner = match.group(1), match.group(2)
        options: dict[str, Any] = {}
        if inner is not None:
            pairs = [p.strip() for p in inner.split(",") if p.strip()]
            if len(pairs) == 1 and "=" not in pairs[0]:
                options[SHORTHAND_OPTION] = pairs[0]
            for pair in pairs:
                if "=" not in pair:
                    if SHORTHAND_OPTION in options:
                        continue
                    raise ConfigurationError(
                        f"--strategies: option {pair!r} of {item!r} needs a value (key=value); only a single "
                        f"bare value is allowed, meaning {SHORTHAND_OPTION}."
                    )
                key, _, value = pair.partition("=")
                options[key.strip()] = _option_value(value.strip())
        if any(c.label == item for c in columns):
            raise ConfigurationError(f"--strategies: {item!r} is listed twice.")
        columns.append(Column(label=item, strategy=name, options=options))
    if not columns:
        raise ConfigurationError("--strategies: name at least one strategy (see `stratagem strategies`).")
    return columns


@attrs.frozen(kw_only=True)
class Job:
    """What every column runs: the same model, data and number of steps."""

    model: str
    steps: int
    batch_size: int
    warmup: int
    seed: int
    accelerator: str
    devices: int
    progress_path: str = ""


def default_warmup(steps: int) -> int:
    """Steps left out of the iterations-per-second figure (allocation, first collectives)."""
    return max(1, min(3, steps // 5)) if steps > 1 else 0


# -------------------------------------------------------------------------------------------------
# models
# -------------------------------------------------------------------------------------------------


def load_model_factory(spec: str) -> Callable[[], Any]:
    """``small``/``medium``, ``path/to/file.py:Class`` or ``package.module:Class`` -> a no-argument factory."""
    from stratagem import _bench_models

    if spec in _bench_models.MODELS:
        return _bench_models.MODELS[spec]
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigurationError(
            f"--model {spec!r}: give {' or '.join(sorted(_bench_models.MODELS))}, or PATH:Class "
            "(a .py file or an importable module, and a model class in it taking no arguments)."
        )
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise ConfigurationError(f"--model {spec!r}: {where} is not a file.")
        name = f"_stratagem_compare_model_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(name, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ConfigurationError(f"--model {spec!r}: cannot import {where!r} ({error}).") from error
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigurationError(f"--model {spec!r}: {where} has no attribute {attr!r}.")
    if isinstance(factory, type) and not hasattr(factory, "example_batch"):
        raise ConfigurationError(
            f"--model {spec!r}: {attr} has no example_batch(batch_size, generator) method. A compared model "
            "makes its own batches from the generator it is given, so that every strategy sees the same data."
        )
    return factory


def _training_loss(wrapped: Any, module: Any, batch: Any, batch_idx: int) -> Any:
    """The loss through the wrapper's forward (where DDP and FSDP do their work)."""
    from stratagem._model_calls import redirected_forward
    from stratagem.module import Module

    has_step = isinstance(module, Module) and type(module).overrides("training_step")
    if not has_step:
        items = batch if isinstance(batch, (tuple, list)) else (batch,)
        return wrapped(*items)
    # Through the wrapper's call also when it wrapped in place (FSDP2): its hooks gather the root's parameters.
    with redirected_forward(module, "training_step"):
        return wrapped(batch, batch_idx)


def _make_optimizer(module: Any) -> Any:
    import torch

    from stratagem.module import Module

    configured = module.configure_optimizers() if isinstance(module, Module) else None
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)):
        configured = configured[0] if configured else None
    return configured if configured is not None else torch.optim.AdamW(module.parameters(), lr=1e-4)


# -------------------------------------------------------------------------------------------------
# measuring (in each worker)
# -------------------------------------------------------------------------------------------------


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

    from stratagem._manager import get_registry
    from stratagem.engine import Engine

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
    generator = torch.Generator().manual_seed(job.seed * 1_000_003 + rank)
    times, grads = [], 0
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
        "final_loss": float(loss.detach().float().cpu()),
        "allocator_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
        "threads": torch.get_num_threads(),
    }
    engine.teardown()
    return result


# -------------------------------------------------------------------------------------------------
# running (in the parent)
# -------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ColumnResult:
    column: Column
    ranks: list[dict[str, Any]]
    warmup: int
    wall_s: float

    @property
    def timed_steps(self) -> list[float]:
        times = self.ranks[0]["step_times_s"]
        return times[self.warmup :] or times

    @property
    def iterations_per_second(self) -> float:
        return len(self.timed_steps) / sum(self.timed_steps)

    def largest(self, key: str) -> float | None:
        values = [r[key] for r in self.ranks if r.get(key) is not None]
        return max(values) if values else None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.column.label,
            "strategy": self.column.strategy,
            "options": self.column.options,
            "iterations_per_second": self.iterations_per_second,
            "median_step_s": statistics.median(self.timed_steps),
            "warmup_steps": self.warmup,
            "wall_s": self.wall_s,
            "ranks": self.ranks,
        }


def check_columns(columns: Sequence[Column], accelerator: str, devices: int) -> None:
    """Fail before launching anything: unknown names, capabilities, missing dependencies, bad options."""
    from stratagem._manager import get_registry

    registry = get_registry()
    for column in columns:
        info = registry.check_request(
            column.strategy, accelerator=accelerator, precision="32-true", world_size=devices
        )
        if column.options:
            try:
                info.create(**column.options)
            except (TypeError, ValueError) as error:
                raise ConfigurationError(
                    f"--strategies {column.label!r}: {column.strategy} does not take these options: {error}"
                ) from error


class _Progress:
    """A bar in the launching process: which column runs, and its steps (rank 0 writes them to a file)."""

    def __init__(self, columns: Sequence[Column], steps: int, enabled: bool) -> None:
        self.columns, self.steps, self.enabled = columns, steps, enabled
        self._rich: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.path = ""

    def __enter__(self) -> _Progress:
        if not self.enabled:
            return self
        handle, self.path = tempfile.mkstemp(prefix="stratagem-compare-", suffix=".step")
        os.close(handle)
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._rich.start()
            self._overall = self._rich.add_task("strategies", total=len(self.columns))
            self._steps = self._rich.add_task("", total=self.steps, visible=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self._end_poll()
        if self._rich is not None:
            self._rich.stop()
        if self.path:
            with_suppress(os.remove, self.path)

    def start(self, index: int, column: Column) -> None:
        self._t0 = time.monotonic()
        if not self.enabled:
            return
        _write_progress(self.path, "0")
        if self._rich is None:
            print(
                f"compare [{index + 1}/{len(self.columns)}] {column.label} ...", file=sys.stderr, flush=True
            )
            return
        self._rich.update(self._steps, description=f"{column.label} steps", completed=0, visible=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                done = int(Path(self.path).read_text() or 0)
            except (OSError, ValueError):
                continue
            self._rich.update(self._steps, completed=done)

    def _end_poll(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finish(self, column: Column) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self._t0
        if self._rich is None:
            print(f"compare {column.label}: done in {elapsed:.1f} s", file=sys.stderr, flush=True)
            return
        self._end_poll()
        self._rich.update(self._steps, completed=self.steps)
        self._rich.advance(self._overall)


def with_suppress(function: Callable[..., Any], *args: Any) -> None:
    try:
        function(*args)
    except OSError:
        pass


def run(
    columns: Sequence[Column],
    *,
    model: str = "medium",
    steps: int = 20,
    devices: int = 2,
    accelerator: str = "auto",
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> list[ColumnResult]:
    """Run every column, one launch after the other, and return their measurements."""
    from stratagem import launcher
    from stratagem.cluster import resolve_accelerator

    for name, value in (("--steps", steps), ("--devices", devices), ("--batch-size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} {value!r}: give a positive number.")
    accelerator = resolve_accelerator(accelerator)
    load_model_factory(model)  # a bad --model fails here, not in every worker
    check_columns(columns, accelerator, devices)
    warmup = default_warmup(steps)
    results = []
    with _Progress(columns, steps, progress) as bar:
        for index, column in enumerate(columns):
            job = Job(
                model=model,
                steps=steps,
                batch_size=batch_size,
                warmup=warmup,
                seed=seed,
                accelerator=accelerator,
                devices=devices,
                progress_path=bar.path,
            )
            bar.start(index, column)
            start = time.perf_counter()
            per_rank = launcher.launch_function(
                _measure, (column, job), nproc_per_node=devices, accelerator=accelerator
            )
            wall = time.perf_counter() - start
            bar.finish(column)
            ranks = [per_rank[r] for r in sorted(per_rank)]
            results.append(ColumnResult(column=column, ranks=ranks, warmup=warmup, wall_s=wall))
    return results


# -------------------------------------------------------------------------------------------------
# reporting
# -------------------------------------------------------------------------------------------------


def _mb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / MB:,.1f}" if value < 10 * MB else f"{value / MB:,.0f}"


def table_rows(results: Sequence[ColumnResult]) -> list[tuple[str, list[str]]]:
    """The rows of the table (label, one cell per column); memory is the largest rank's."""
    cuda = any(r.ranks[0].get("cuda_max_allocated_bytes") is not None for r in results)
    first = results[0]

    def ratio(key: str) -> list[str]:
        base = first.largest(key)
        return [
            "-" if not base or r.largest(key) is None else f"{r.largest(key) / base:.2f}x" for r in results
        ]

    rows: list[tuple[str, list[str]]] = [
        ("Params + grads + optimizer (MB)", [_mb(r.largest("state_bytes")) for r in results]),
        (f"  vs {first.column.label}", ratio("state_bytes")),
    ]
    if cuda:
        rows += [
            ("Peak CUDA memory (MB)", [_mb(r.largest("cuda_max_allocated_bytes")) for r in results]),
            (f"  vs {first.column.label}", ratio("cuda_max_allocated_bytes")),
        ]
    rows += [
        ("Peak RSS (MB)", [_mb(r.largest("peak_rss_bytes")) for r in results]),
        ("Peak RSS above baseline (MB)", [_mb(r.largest("peak_rss_above_baseline_bytes")) for r in results]),
        (f"  vs {first.column.label}", ratio("peak_rss_above_baseline_bytes")),
        ("Iterations per second", [f"{r.iterations_per_second:.2f}" for r in results]),
    ]
    return rows


def format_table(results: Sequence[ColumnResult], *, model: str, devices: int, steps: int) -> str:
    rows = table_rows(results)
    header = ["", *[r.column.label for r in results]]
    cells = [header, *[[label, *values] for label, values in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for i, row in enumerate(cells):
        lines.append(
            "  ".join(
                cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j]) for j, cell in enumerate(row)
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    accelerator = "CUDA" if results[0].ranks[0].get("cuda_max_allocated_bytes") is not None else "CPU"
    allocator = results[0].ranks[0].get("allocator_env") or {}
    notes = [
        f"model {model}, {devices} process(es) on {accelerator}, {steps} steps "
        f"(iterations per second after {results[0].warmup} warm-up steps, rank 0).",
        "Memory is per rank (the largest rank's); baseline = RSS after the process group, before the model.",
    ]
    if accelerator == "CPU":
        setting = ", ".join(f"{k}={v}" for k, v in sorted(allocator.items())) or "glibc default"
        notes.append(f"Allocator: {setting}.")
    return "\n".join([*lines, "", *notes])


def to_json(
    results: Sequence[ColumnResult], *, model: str, devices: int, steps: int, batch_size: int
) -> dict[str, Any]:
    import torch

    return {
        "model": model,
        "devices": devices,
        "steps": steps,
        "batch_size": batch_size,
        "accelerator": "cuda" if results[0].ranks[0].get("cuda_max_allocated_bytes") is not None else "cpu",
        "torch": torch.__version__,
        "columns": [r.to_json() for r in results],
    }


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigurationError(
            "--plot needs matplotlib, which is not installed. Install it with: pip install 'stratagem[plot]'"
        ) from None
    return matplotlib


def plot(results: Sequence[ColumnResult], path: str, *, model: str, devices: int) -> None:
    """A bar chart of the table: memory per rank (MB) on the left, iterations per second on the right."""
    require_matplotlib().use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.column.label for r in results]
    cuda = results[0].ranks[0].get("cuda_max_allocated_bytes") is not None
    series = [("params + grads + optimizer", "state_bytes")]
    if cuda:
        series.append(("peak CUDA allocated", "cuda_max_allocated_bytes"))
    series += [("peak RSS", "peak_rss_bytes"), ("peak RSS above baseline", "peak_rss_above_baseline_bytes")]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(max(8.0, 2.2 * len(labels) + 4), 4.8), gridspec_kw={"width_ratios": [3, 2]}
    )
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        values = [(r.largest(key) or 0) / MB for r in results]
        bars = left.bar(xs, values, width, label=name)
        left.bar_label(bars, fmt="%.0f", fontsize=7)
    left.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    left.set_xlabel("strategy")
    left.set_ylabel("memory per rank (MB)")
    left.set_title("Memory per rank (largest rank)")
    top = max((r.largest(key) or 0) / MB for _, key in series for r in results)
    # Head room above the tallest bar keeps the legend clear of the bars.
    left.set_ylim(0, top * 1.45 or 1)
    left.legend(fontsize=8, loc="upper right")
    speeds = [r.iterations_per_second for r in results]
    bars = right.bar(range(len(labels)), speeds, 0.6, color="tab:green")
    right.bar_label(bars, fmt="%.2f", fontsize=8)
    right.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    right.set_xlabel("strategy")
    right.set_ylabel("iterations per second (it/s)")
    right.set_title("Training speed")
    fig.suptitle(f"stratagem compare: model {model}, {devices} process(es), {'CUDA' if cuda else 'CPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

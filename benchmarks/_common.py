"""Small helpers shared by the benchmark scripts (timing, tables). Not part of any package."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any


def time_command(argv: Sequence[str], repeats: int, env: dict[str, str] | None = None) -> list[float]:
    """Wall-clock seconds of ``repeats`` runs of a command (after one warm-up run)."""
    subprocess.run(argv, check=True, capture_output=True, env=env)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def python() -> str:
    return sys.executable


def timed_step(loop, *batch) -> float:
    """Seconds of one ``loop.step(*batch)`` across ranks: it ends when the slower rank is done."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loop.step(*batch)
    dist.barrier()
    return time.perf_counter() - start


def paired_step_times(loops: dict, data: Sequence, warmup: int = 3) -> dict[str, float]:
    """Median step time of ``loops["raw"]`` and ``loops["stratagem"]`` and the median ratio of paired steps.

    Steps alternate between the loops, each going first every other time, so that a burst of load from
    elsewhere on the machine hits both alike; neighbouring steps form the pairs.
    """
    for loop in loops.values():  # warm-up: lazy init, allocator, bucket rebuild, autograd caches
        for batch in data[:warmup]:
            timed_step(loop, *batch)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for i, batch in enumerate(data):
        for name in list(loops) if i % 2 == 0 else list(reversed(loops)):
            times[name].append(timed_step(loops[name], *batch))
    ratios = [ours / raw for raw, ours in zip(times["raw"], times["stratagem"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "raw": statistics.median(times["raw"]),
        "stratagem": statistics.median(times["stratagem"]),
        "ratio": statistics.median(ratios),
        "ratio_iqr": (q1, q3),
        "ratio_of_medians": statistics.median(times["stratagem"]) / statistics.median(times["raw"]),
    }


def ratio_lines(result: dict[str, Any]) -> str:
    """The ratio as the step benchmarks print it: paired median, its spread, and the ratio of the medians."""
    q1, q3 = result["ratio_iqr"]
    return (
        f"ratio stratagem/raw:     {result['ratio']:8.3f}  (median of paired steps, IQR {q1:.3f}-{q3:.3f}; "
        f"target <= 1.03)\n"
        f"ratio of the medians:    {result['ratio_of_medians']:8.3f}  (the two loops' median steps divided)"
    )


def step_benchmark_arguments(doc: str, *, depth: int, steps: int):
    """The options every step-time benchmark takes (model size, batch, timed steps, threads)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=depth)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per loop")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return parser.parse_args()


class EngineLoop:
    """A training step through ``stratagem.Engine``: the side the step-time benchmarks compare with raw torch."""

    def __init__(self, engine, model, optimizer) -> None:
        self.engine = engine
        self.model, self.opt = engine.setup(model, optimizer)

    def step(self, x, y) -> None:
        import torch.nn.functional as F

        with self.engine.forward_context():
            loss = F.mse_loss(self.model(x), y)
        self.engine.backward(loss, self.model)
        self.opt.step()
        self.opt.zero_grad()

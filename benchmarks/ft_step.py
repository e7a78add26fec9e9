"""What per-step fault tolerance costs and what it saves: ``ft_ddp`` (stratagem-ft on torchft) against a raw
data-parallel step over the same two processes, and the time from a replica group's loss to the survivor's
next step.

Step time: two replica groups of one process (the ``replica_groups`` launcher, a lighthouse of its own). In
each process a raw loop averages its gradients with a plain gloo all-reduce over the same two processes (the
step ``ddp`` takes), and a loop through stratagem's Engine under ``ft_ddp`` averages them through torchft's
Manager (a quorum per step, a fault-tolerant all-reduce, a commit). Their steps alternate, each going first
every other time; prints the median step times and the median ratio of neighbouring steps with its spread
(target: at most 1.05).

Recovery: ``--trials`` launches in which group 1 kills itself (SIGKILL) at step 10; prints, per trial and in
all, the longest gap between two of the survivor's steps and the survivor's median step (the gap is what the
loss cost it: torchft's lighthouse drops a group after its heartbeat timeout, 5 s by default).

    python benchmarks/ft_step.py [--width 256 [1024 ...]] [--depth 3] [--batch 32] [--steps 60] [--trials 10]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import stratagem as sg

sys.path.insert(0, str(Path(__file__).parent))
from _common import EngineLoop, median, table

STRATEGY = "ft_ddp[num_replica_groups=2]"


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


def batches(n: int, batch: int, width: int, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(replica)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 16, generator=g)) for _ in range(n)]


class RawLoop:
    """The data-parallel step without fault tolerance: one flat all-reduce of the gradients over ``group``."""

    def __init__(self, model: torch.nn.Module, group: Any) -> None:
        self.model, self.group = model, group
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(self.model(x), y).backward()
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.group.allreduce([flat]).wait()
        flat.div_(2)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def step_times(engine: sg.Engine, args: argparse.Namespace) -> dict[str, Any]:
    """One replica group's side of the step-time comparison (both groups run it)."""
    torch.set_num_threads(args.threads)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    store = dist.TCPStore("127.0.0.1", args.port, 2, is_master=replica == 0)
    group = dist.ProcessGroupGloo(store, replica, 2, datetime.timedelta(seconds=60))
    model = make_model(args.width, args.depth)
    loops = {
        "raw": RawLoop(make_model(args.width, args.depth), group),
        "ft_ddp": EngineLoop(engine, model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)),
    }
    data = batches(args.steps + 3, args.batch, args.width, replica)
    times: dict[str, list[float]] = {name: [] for name in loops}
    cpu: dict[str, list[float]] = {name: [] for name in loops}

    def timed(name: str, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        group.barrier().wait()  # both processes start the step together, as a ddp step's ranks do
        began, began_cpu = time.perf_counter(), time.process_time()
        loops[name].step(x, y)
        group.barrier().wait()
        # The CPU seconds of every thread of this process (torchft's Manager server and quorum thread included;
        # the lighthouse runs in the launcher's process): what a loaded machine does not distort.
        return time.perf_counter() - began, time.process_time() - began_cpu

    for x, y in data[:3]:  # warm-up
        for name in loops:
            timed(name, x, y)
    for i, (x, y) in enumerate(data[3:]):
        for name in list(loops) if i % 2 == 0 else list(reversed(loops)):
            wall, used = timed(name, x, y)
            times[name].append(wall)
            cpu[name].append(used)
    ratios = [ours / raw for raw, ours in zip(times["raw"], times["ft_ddp"], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "raw": median(times["raw"]),
        "ft_ddp": median(times["ft_ddp"]),
        "ratio": median(ratios),
        "iqr": (q1, q3),
        "cpu": {name: median(cpu[name]) for name in loops},
    }


def survivor_gaps(engine: sg.Engine, args: argparse.Namespace) -> dict[str, float]:
    """One trial of the recovery measure: group 1 dies at step 10; group 0's step times are returned."""
    torch.set_num_threads(args.threads)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    model = make_model(args.width, args.depth)
    loop = EngineLoop(engine, model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    stamps = []
    for step, (x, y) in enumerate(batches(30, args.batch, args.width, replica), start=1):
        loop.step(x, y)
        stamps.append(time.perf_counter())
        if replica == 1 and step == 10:
            os.kill(os.getpid(), signal.SIGKILL)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"max_gap": max(gaps), "median_step": median(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--width",
        type=int,
        nargs="+",
        default=[256, 512],
        help="MLP widths: one step-time comparison each (torchft's cost is per step: the ratio falls as the "
        "step grows)",
    )
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per loop")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--trials", type=int, default=10, help="launches with a replica group lost")
    parser.add_argument("--port", type=int, default=29611, help="the raw loop's store")
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")

    def engine() -> sg.Engine:
        return sg.Engine(strategy=STRATEGY, accelerator="cpu", devices=1, launcher="replica_groups")

    # torchft's cost is per step (a quorum, a commit vote), not per byte: the ratio falls as the step grows.
    for width in args.width:
        result = engine().launch(step_times, argparse.Namespace(**{**vars(args), "width": width}))
        q1, q3 = result["iqr"]
        print(f"step, {width}x{args.depth} MLP, batch {args.batch} per group, {args.steps} paired steps:")
        print(
            table(
                [
                    [name, f"{result[name] * 1000:.2f} ms", f"{result['cpu'][name] * 1000:.2f} ms"]
                    for name in ("raw", "ft_ddp")
                ],
                ["loop", "median step", "its median CPU time (group 0's process)"],
            )
        )
        extra = (result["ft_ddp"] - result["raw"]) * 1000
        print(
            f"ratio ft_ddp/raw: {result['ratio']:.3f} (median of paired steps, IQR {q1:.3f}-{q3:.3f}; target"
            f" <= 1.05: {'met' if result['ratio'] <= 1.05 else 'NOT met'}); ft_ddp's extra per step: "
            f"{extra:.2f} ms\n"
        )
    args.width = args.width[0]
    rows, worst = [], []
    for trial in range(args.trials):
        gaps = engine().launch(survivor_gaps, args)
        worst.append(gaps["max_gap"])
        rows.append([trial + 1, f"{gaps['max_gap']:.2f} s", f"{gaps['median_step'] * 1000:.1f} ms"])
    if rows:
        print(f"\na replica group lost at step 10, {args.trials} trials:")
        print(table(rows, ["trial", "survivor's longest gap", "its median step"]))
        print(
            f"median of the longest gaps: {median(worst):.2f} s (min {min(worst):.2f}, max {max(worst):.2f})"
        )


if __name__ == "__main__":
    main()

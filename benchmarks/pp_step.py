"""``pp`` through the Trainer against a hand-written ``torch.distributed.pipelining`` loop, and the bubble of
``gpipe`` and ``1f1b`` against the theory.

Two gloo processes on CPU, one launch, a 2-stage pipeline of the same residual MLP (an input layer, ``depth``
blocks of LayerNorm + Linear w -> 4w -> w, a head), the first half of the blocks on rank 0.

1. Step time, per schedule (``gpipe``, ``1f1b``): the Trainer (``PPStrategy``, the module's ``compute_loss``,
   AdamW; the step hook, the loss broadcast from the last stage, the optimizer step, the Trainer's logging)
   against the raw loop: a ``PipelineStage`` over this rank's half, torch's schedule class, ``schedule.step``,
   AdamW. The raw loop runs inside the Trainer's own run, one raw step beside each Trainer step on the same
   batch, first every other time; each step is timed between barriers (the slower rank ends it). Printed: the
   median of each and the median ratio of paired steps with its IQR (target at most 1.03).
2. Bubble: in the raw loop, each rank's time inside its stage's forward and backward of each micro-batch
   (``forward_one_chunk``, ``backward_one_chunk``), against the step's wall time: bubble = 1 - busy / step,
   for m micro-batches, beside the theoretical (p - 1) / (m + p - 1) for p = 2 stages. The theory assumes
   stages of equal cost and free communication; the measurement has neither (the last stage also runs the
   loss, and gloo's send and receive take time).

    python benchmarks/pp_step.py [--width 256] [--depth 8] [--batch 32] [--microbatches 4] [--steps 40]
"""

from __future__ import annotations

import argparse
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
from _common import ratio_lines, table

WARMUP = 3
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class PipeMLP(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class PipeModule(PipeMLP, sg.Module):
    def compute_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def make(cls: type, args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    return cls(args.width, args.depth)


def timed_stage_class() -> type:
    """torch's ``PipelineStage``, adding up the time of each micro-batch's forward and backward here."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        busy = 0.0

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super().backward_one_chunk(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start

    return TimedStage


class RawPipeline:
    """What a user writes with torch alone: this rank's half of the model as a stage, the schedule, AdamW."""

    def __init__(self, args: argparse.Namespace, schedule: str, microbatches: int) -> None:
        from torch.distributed.pipelining import schedules

        model = make(PipeMLP, args)
        rank, half = dist.get_rank(), args.depth // 2
        if rank == 0:
            part = torch.nn.Sequential(model.inp, *model.blocks[:half])
        else:
            part = torch.nn.Sequential(*model.blocks[half:], model.head)
        self.first, self.last = rank == 0, rank == dist.get_world_size() - 1
        self.stage = timed_stage_class()(part, rank, dist.get_world_size(), torch.device("cpu"))
        cls = getattr(schedules, SCHEDULES[schedule])
        self.schedule = cls(self.stage, n_microbatches=microbatches, loss_fn=F.mse_loss, scale_grads=True)
        self.opt = torch.optim.AdamW(part.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.first:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=[])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _barrier_time() -> float:
    dist.barrier()
    return time.perf_counter()


class Pairing:
    """Times each Trainer step (batch start to batch end, between barriers) and runs one raw step beside it on
    the same batch: after it on even batches, before it on odd ones."""

    def __init__(self, args: argparse.Namespace, schedule: str) -> None:
        self.args, self.schedule = args, schedule
        self.raw: RawPipeline | None = None
        self.times: dict[str, list[float]] = {"raw": [], "stratagem": []}
        self._start = 0.0

    def _raw_step(self, batch: Any) -> None:
        assert self.raw is not None
        start = _barrier_time()
        self.raw.step(*batch)
        self.times["raw"].append(_barrier_time() - start)

    @sg.hookimpl
    def on_fit_start(self, trainer: Any) -> None:
        # The process group is the Trainer's: the raw pipeline is built in it.
        self.raw = RawPipeline(self.args, self.schedule, self.args.microbatches)

    @sg.hookimpl
    def on_train_batch_start(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % 2:
            self._raw_step(batch)
        self._start = _barrier_time()

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        self.times["stratagem"].append(_barrier_time() - self._start)
        if batch_idx % 2 == 0:
            self._raw_step(batch)


def _data(args: argparse.Namespace, steps: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * args.batch, args.width, generator=g)
    y = torch.randn(steps * args.batch, 16, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch)


def step_times(args: argparse.Namespace, schedule: str, root: str) -> dict[str, Any]:
    from stratagem_pp import PPStrategy

    pairing = Pairing(args, schedule)
    steps = WARMUP + args.steps
    trainer = sg.Trainer(
        strategy=PPStrategy(schedule=schedule, microbatches=args.microbatches),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=steps,
        default_root_dir=root,
        enable_progress_bar=False,
        callbacks=[pairing],
    )
    trainer.fit(make(PipeModule, args), _data(args, steps))
    trainer.engine.teardown()
    raw, ours = pairing.times["raw"][WARMUP:], pairing.times["stratagem"][WARMUP:]
    ratios = [o / r for r, o in zip(raw, ours)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "raw": statistics.median(raw),
        "stratagem": statistics.median(ours),
        "ratio": statistics.median(ratios),
        "ratio_iqr": (q1, q3),
        "ratio_of_medians": statistics.median(ours) / statistics.median(raw),
    }


def bubble(args: argparse.Namespace, schedule: str, microbatches: int) -> dict[str, float]:
    """The raw loop's bubble on each rank for ``microbatches`` micro-batches (median over the timed steps)."""
    loop = RawPipeline(args, schedule, microbatches)
    data = list(_data(args, WARMUP + args.steps))
    fractions = []
    for i, (x, y) in enumerate(data):
        loop.stage.busy = 0.0
        start = _barrier_time()
        loop.step(x, y)
        wall = _barrier_time() - start
        if i >= WARMUP:
            fractions.append(1.0 - loop.stage.busy / wall)
    mine = torch.tensor([statistics.median(fractions)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {f"rank {r}": float(v) for r, v in enumerate(every)}


def run(engine: sg.Engine, args: argparse.Namespace, root: str) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"steps": {}, "bubbles": {}}
    # First, in the launch's process group (each Trainer's teardown below leaves it).
    for schedule in SCHEDULES:
        for m in args.bubble_microbatches:
            out["bubbles"][(schedule, m)] = bubble(args, schedule, m)
    for schedule in SCHEDULES:
        out["steps"][schedule] = step_times(args, schedule, f"{root}/{schedule}")
    return out


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="samples per step (one pipeline)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches of the step-time runs")
    parser.add_argument("--bubble-microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        result = sg.Engine(strategy="pp", accelerator="cpu", devices=2).launch(run, args, root)
    print(
        f"model: Linear {args.width} + {args.depth} blocks of LayerNorm + Linear {args.width}->{4 * args.width}->"
        f"{args.width} + head, 2 stages, batch {args.batch}, AdamW, 2 processes, gloo"
    )
    for schedule, timing in result["steps"].items():
        print(f"\n{schedule}, {args.microbatches} micro-batches, {args.steps} paired steps:")
        print(f"raw torch.distributed.pipelining: {timing['raw'] * 1e3:8.2f} ms/step (median)")
        print(f"stratagem pp (Trainer):           {timing['stratagem'] * 1e3:8.2f} ms/step")
        print(ratio_lines(timing))
    p = 2
    rows = []
    for (schedule, m), per_rank in result["bubbles"].items():
        theory = (p - 1) / (m + p - 1)
        measured = " / ".join(f"{v:.3f}" for v in per_rank.values())
        rows.append((schedule, m, f"{theory:.3f}", measured))
    print("\nbubble fraction of the raw loop (1 - time in forward and backward / step time), p = 2:")
    print(table(rows, ["schedule", "micro-batches m", "(p-1)/(m+p-1)", "measured rank 0 / rank 1"]))


if __name__ == "__main__":
    main()

"""Step time of ``ddp`` through stratagem's Engine against a raw DistributedDataParallel loop, in the same run.

Two gloo processes on CPU. Both loops train the same MLP on the same batches over the same process group;
their steps alternate so that machine noise falls on both alike. Prints each loop's median step time and the
median ratio of neighbouring steps (stratagem / raw; the target is at most 1.03).

    python benchmarks/ddp_step.py [--width 1024] [--depth 3] [--batch 64] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import stratagem as sg

sys.path.insert(0, str(Path(__file__).parent))
from _common import EngineLoop, paired_step_times, ratio_lines, step_benchmark_arguments


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


def batches(n: int, batch: int, width: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 16, generator=g)) for _ in range(n)]


class RawLoop:
    def __init__(self, width: int, depth: int) -> None:
        self.model = DistributedDataParallel(make_model(width, depth))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def run(engine: sg.Engine, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    data = batches(args.steps, args.batch, args.width, engine.rank)
    model = make_model(args.width, args.depth)
    loops = {
        "raw": RawLoop(args.width, args.depth),
        "stratagem": EngineLoop(engine, model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)),
    }
    return paired_step_times(loops, data)


def main() -> None:
    args = step_benchmark_arguments(__doc__, depth=3, steps=200)

    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2)
    result = engine.launch(run, args)
    print(f"model: MLP width={args.width} depth={args.depth}, batch {args.batch} per rank, 2 processes, gloo")
    print(f"raw DistributedDataParallel: {result['raw'] * 1e3:8.2f} ms/step (median of {args.steps} steps)")
    print(f"stratagem ddp (Engine):      {result['stratagem'] * 1e3:8.2f} ms/step")
    print(ratio_lines(result))


if __name__ == "__main__":
    main()

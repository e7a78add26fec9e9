"""Step time of ``fsdp`` through stratagem's Engine against a hand-written ``fully_shard`` loop, in one run.

Two gloo processes on CPU. Both loops shard the same MLP the same way (one ``fully_shard`` unit per block,
then the root, FULL_SHARD) over a 1D mesh of the same process group, and train on the same batches with
AdamW; their steps alternate so that machine noise falls on both alike. Prints each loop's median step time
and the median ratio of neighbouring steps (stratagem / raw; the target is at most 1.03).

    python benchmarks/fsdp_step.py [--width 1024] [--depth 4] [--batch 64] [--steps 100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import stratagem as sg

sys.path.insert(0, str(Path(__file__).parent))
from _common import EngineLoop, paired_step_times, ratio_lines, step_benchmark_arguments


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(depth)], torch.nn.Linear(width, 16))


class RawLoop:
    def __init__(self, width: int, depth: int) -> None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = make_model(width, depth)
        for block in model[:-1]:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        self.model = fully_shard(model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _stratagem_loop(width: int, depth: int) -> EngineLoop:
    from stratagem_fsdp import FSDPStrategy

    engine = sg.Engine(strategy=FSDPStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=2)
    model = make_model(width, depth)
    return EngineLoop(engine, model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def run(engine: sg.Engine, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(engine.rank)
    data = [
        (torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 16, generator=g))
        for _ in range(args.steps)
    ]
    loops = {"raw": RawLoop(args.width, args.depth), "stratagem": _stratagem_loop(args.width, args.depth)}
    return paired_step_times(loops, data)


def main() -> None:
    args = step_benchmark_arguments(__doc__, depth=4, steps=100)

    result = sg.Engine(strategy="fsdp", accelerator="cpu", devices=2).launch(run, args)
    print(
        f"model: {args.depth} blocks of Linear {args.width}->{2 * args.width}->{args.width} + head, "
        f"batch {args.batch} per rank, AdamW, 2 processes, gloo, FULL_SHARD per block + root"
    )
    print(f"raw fully_shard loop:   {result['raw'] * 1e3:8.2f} ms/step (median of {args.steps} steps)")
    print(f"stratagem fsdp (Engine): {result['stratagem'] * 1e3:8.2f} ms/step")
    print(ratio_lines(result))


if __name__ == "__main__":
    main()

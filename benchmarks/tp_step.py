"""``fsdp_tp`` against a hand-written ``parallelize_module`` + ``fully_shard`` loop, and per-rank memory of
``ddp``, ``fsdp``, ``tp`` and ``fsdp_tp``, in one 4-process run.

Four gloo processes on CPU, one launch.

1. Step time: both loops split the same residual MLP the same way on a 2 x 2 mesh ``("dp", "tp")``: each
   block's ``up`` colwise and ``down`` rowwise on ``tp`` (``parallelize_module``), then one ``fully_shard`` unit
   per block and the root on ``dp``; same batches (one per dp rank), AdamW. Their steps alternate, each going
   first every other time; printed: each loop's median step and the median ratio of paired steps with its IQR
   (target at most 1.03).
2. Memory: per rank, bytes of parameters + gradients + AdamW state (``to_local()`` of every DTensor) after a
   step with the gradients still alive, for each strategy at 4 processes, and the ratio to ddp's.

    python benchmarks/tp_step.py [--width 256] [--depth 4] [--batch 16] [--steps 40]

The same model, with its plan as a ``tp_plan`` attribute, runs under ``stratagem compare``:

    stratagem compare --strategies ddp,fsdp,tp,fsdp_tp --devices 4 --model benchmarks/tp_step.py:TPMLP
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import stratagem as sg

sys.path.insert(0, str(Path(__file__).parent))
from _common import EngineLoop, paired_step_times, ratio_lines, table

PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
OUT = 16


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TPMLP(Net):
    """For ``stratagem compare``: the benchmark's default size, with its plan where the strategies look."""

    tp_plan = PLAN

    def __init__(self) -> None:
        super().__init__(width=256, depth=4)

    def example_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, 256, generator=generator), torch.randn(
            batch_size, OUT, generator=generator
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return out if y is None else F.mse_loss(out, y)


def make_model(width: int, depth: int) -> Net:
    torch.manual_seed(0)
    return Net(width, depth)


class RawLoop:
    """What a user writes by hand with torch: TP on the tp dimension, then FSDP2 on dp."""

    def __init__(self, width: int, depth: int) -> None:
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
        model = make_model(width, depth)
        plan: dict[str, Any] = {}
        for i in range(depth):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        self.model = fully_shard(model, mesh=mesh["dp"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _fsdp_tp_loop(width: int, depth: int) -> EngineLoop:
    from stratagem_tp import FSDPTPStrategy

    strategy = FSDPTPStrategy(plan=PLAN, tensor_parallel_size=2, auto_wrap_policy={Block})
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=dist.get_world_size())
    model = make_model(width, depth)
    return EngineLoop(engine, model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def state_bytes(strategy: Any, args: argparse.Namespace) -> dict[str, int]:
    """Parameters, gradients and AdamW state held by this rank after one step (gradients still alive)."""
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=dist.get_world_size())
    model = make_model(args.width, args.depth)
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, OUT, generator=g)
    engine.backward(F.mse_loss(model(x), y), model)
    opt.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(
        _local_bytes(v)
        for state in opt.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    engine.teardown()
    return {"params": params, "grads": grads, "optimizer": states, "total": params + grads + states}


def run(engine: sg.Engine, args: argparse.Namespace) -> dict[str, Any]:
    from stratagem_tp import FSDPTPStrategy, TPStrategy

    torch.set_num_threads(args.threads)
    dp_rank = engine.rank // 2
    g = torch.Generator().manual_seed(dp_rank)  # the two ranks of a tp group see the same batch
    data = [
        (torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, OUT, generator=g))
        for _ in range(args.steps)
    ]
    loops = {"raw": RawLoop(args.width, args.depth), "stratagem": _fsdp_tp_loop(args.width, args.depth)}
    timing = paired_step_times(loops, data)
    memory = {}
    for name, strategy in (
        ("ddp", "ddp"),
        ("fsdp", "fsdp"),
        ("tp", TPStrategy(plan=PLAN)),
        ("fsdp_tp (2 x 2)", FSDPTPStrategy(plan=PLAN, tensor_parallel_size=2)),
    ):
        mine = state_bytes(strategy, args)
        # The largest rank's figure: what must fit on every device.
        memory[name] = {k: max(engine.all_gather(torch.tensor([v]))).item() for k, v in mine.items()}
    return {"timing": timing, "memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="samples per dp rank")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per loop")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    result = sg.Engine(strategy="fsdp_tp", accelerator="cpu", devices=4).launch(run, args)
    print(
        f"model: {args.depth} blocks of LayerNorm + Linear {args.width}->{4 * args.width}->{args.width} + head, "
        f"batch {args.batch} per dp rank, AdamW, 4 processes, gloo"
    )
    timing = result["timing"]
    print(
        f"raw parallelize_module + fully_shard: {timing['raw'] * 1e3:8.2f} ms/step (median of {args.steps})"
    )
    print(f"stratagem fsdp_tp (Engine):          {timing['stratagem'] * 1e3:8.2f} ms/step")
    print(ratio_lines(timing))
    memory = result["memory"]
    ddp = memory["ddp"]["total"]
    rows = [
        (
            name,
            f"{m['params'] / 2**20:.2f}",
            f"{m['grads'] / 2**20:.2f}",
            f"{m['optimizer'] / 2**20:.2f}",
            f"{m['total'] / 2**20:.2f}",
            f"{m['total'] / ddp:.3f}",
        )
        for name, m in memory.items()
    ]
    print("\nper-rank bytes (largest rank), parameters + gradients + AdamW state, 4 processes:")
    print(table(rows, ["strategy", "params MiB", "grads MiB", "AdamW MiB", "total MiB", "vs ddp"]))


if __name__ == "__main__":
    main()

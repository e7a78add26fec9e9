"""Per-rank memory of fsdp's sharding strategies against ddp, counted from local shards, in one run.

Two gloo processes on CPU, one launch; each configuration trains the same MLP (AdamW) for a few steps in
turn. Per rank it reports:

- persistent: bytes of parameters + gradients + AdamW state held by this rank (``to_local()`` of every
  DTensor; whole tensors under ddp), after an optimizer step with the gradients still allocated;
- gathered: bytes of parameters held unsharded when forward ends (FSDP2 registers a gathered parameter as a
  plain tensor while its unit is unsharded; SHARD_GRAD_OP keeps them until backward);
- peak RSS: the rise of the resident-set high-water mark above the size before the configuration was built
  (``/proc/self/clear_refs`` resets it; the stratagem launcher sets ``MALLOC_MMAP_THRESHOLD_`` so freed
  buffers go back to the system).

Targets: FULL_SHARD persistent <= 1.05 x (ddp / world size); NO_SHARD and SHARD_GRAD_OP in between, in the
order of the seeds' table (peak RSS: ddp > NO_SHARD > SHARD_GRAD_OP > FULL_SHARD). "gathered" explains the
order: it is held on top of the persistent bytes during forward (not all of it at the same moment as the
gradients, so persistent + gathered is an upper bound of the step's peak).

    python benchmarks/fsdp_memory.py [--width 1024] [--depth 6] [--batch 32]
"""

from __future__ import annotations

import argparse
import gc
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import stratagem as sg

MB = 1024 * 1024


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(depth)])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _rss_kb() -> tuple[int, int]:
    text = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def gathered_bytes(model: torch.nn.Module, shards: set[int]) -> int:
    """Bytes of gathered parameters that do not share memory with a shard (``shards``: data pointers)."""
    # Under FSDP2, a unit's parameters are DTensors when sharded and plain tensors while gathered; with a
    # shard dimension of size 1 (NO_SHARD) the gathered tensor may be the shard's own memory.
    return sum(
        p.numel() * p.element_size()
        for m in model.modules()
        for p in m._parameters.values()
        if p is not None and not isinstance(p, DTensor) and p.untyped_storage().data_ptr() not in shards
    )


def measure(strategy: Any, args: argparse.Namespace, rank: int) -> dict[str, float]:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    rss_before, _ = _rss_kb()
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=2)
    model = make_model(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.setup(model, opt)
    g = torch.Generator().manual_seed(rank)
    gathered = 0
    shards = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g)
        loss = model(x).square().mean()
        gathered = max(gathered, gathered_bytes(model, shards))
        engine.backward(loss, model)
        opt.step()
        if _ < args.steps - 1:
            opt.zero_grad()
    params = sum(_nbytes(p) for p in model.parameters())
    grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(_nbytes(v) for s in opt.optimizer.state.values() for v in s.values() if v.dim() > 0)
    _, peak = _rss_kb()
    result = {
        "params": params / MB,
        "grads": grads / MB,
        "optimizer": states / MB,
        "persistent": (params + grads + states) / MB,
        "gathered": gathered / MB,
        "peak_rss_delta": (peak - rss_before) / 1024,
    }
    del model, opt
    engine.teardown()
    return result


def run(engine: sg.Engine, args: argparse.Namespace) -> dict[int, dict[str, dict[str, float]]]:
    from stratagem_fsdp import FSDPStrategy

    torch.set_num_threads(1)
    configs = {
        "ddp": "ddp",
        "NO_SHARD": FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="NO_SHARD"),
        "SHARD_GRAD_OP": FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP"),
        "FULL_SHARD": FSDPStrategy(auto_wrap_policy={Block}),
    }
    mine = {name: measure(strategy, args, engine.rank) for name, strategy in configs.items()}
    return {
        src: engine.broadcast(mine if engine.rank == src else None, src) for src in range(engine.world_size)
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    result = sg.Engine(strategy="fsdp", accelerator="cpu", devices=2).launch(run, args)
    full = sum(p.numel() for p in make_model(args.width, args.depth).parameters()) * 4 / MB
    print(
        f"model: {args.depth} blocks of Linear {args.width}->{4 * args.width}->{args.width}, "
        f"{full:.1f} MB float32; AdamW; 2 processes, gloo"
    )
    print(
        "| rank | strategy | params MB | grads MB | AdamW MB | persistent MB | gathered after forward MB "
        "| step peak (persistent + gathered) MB | peak RSS rise MB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rank, table in sorted(result.items()):
        for name, r in table.items():
            print(
                f"| {rank} | {name} | {r['params']:.1f} | {r['grads']:.1f} | {r['optimizer']:.1f} | "
                f"{r['persistent']:.1f} | {r['gathered']:.1f} | {r['persistent'] + r['gathered']:.1f} | "
                f"{r['peak_rss_delta']:.0f} |"
            )
    for rank, table in sorted(result.items()):
        ratio = table["FULL_SHARD"]["persistent"] / (table["ddp"]["persistent"] / 2)
        peaks = {n: r["peak_rss_delta"] for n, r in table.items()}
        order = peaks["ddp"] > peaks["NO_SHARD"] > peaks["SHARD_GRAD_OP"] > peaks["FULL_SHARD"]
        print(
            f"rank {rank}: FULL_SHARD persistent / (ddp / 2) = {ratio:.3f} (target <= 1.05); "
            f"peak RSS order ddp > NO_SHARD > SHARD_GRAD_OP > FULL_SHARD (the seeds' table): {order}"
        )


if __name__ == "__main__":
    main()

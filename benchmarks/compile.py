"""``compile=`` measured: compiled against eager step time, cold compile time against depth, and the first step
of a resumed run against a cold one. CPU, inductor, torch 2.13.

1. **step**: the demo's language model (``stratagem demo``'s ``CharLM``, 2 blocks of width 64, batch 16 x 64
   characters per rank) under ``ddp`` and ``fsdp`` on 2 gloo processes. Each launch sets up the model twice
   through one Engine, plain and with ``compile=True`` (inductor, each block once), and alternates their steps
   (each going first every other step) after warm-up, with the same model set up by hand with torch alone
   (``DistributedDataParallel`` or ``fully_shard``; compiled: ``torch.compile`` of each block's forward before
   wrapping), eager and compiled, in the same rotation. Prints the median step of each, the median of paired
   ratios compiled / eager with its interquartile range (goal: at most 0.85), each stratagem loop against
   its torch counterpart, and where the time goes: medians of forward, backward (with the gradient
   all-reduce) and optimizer step.
2. **depth**: cold compile of ``CharLM`` with 4 and with 32 blocks (regional: each block once), each in a new
   process with an empty inductor cache, in alternating order. Compile time is the first training step minus
   the median of the next five. Prints medians and the median of paired ratios 32 / 4 (goal: at most 1.3).
3. **restart**: a ``Trainer(strategy="ddp", devices=2, compile=True)`` run of 3 steps with a checkpoint, then
   a new run resuming from it (what a restart through ``max_restarts`` does: new processes, same cache). The
   first step of each, on rank 0; prints the ratio resumed / cold per pair (goal: at most 0.3).

    python benchmarks/compile.py [--parts step,depth,restart] [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem.cli.demo.model import CharLM, CharWindows, load_text

HERE = Path(__file__).resolve()
INDUCTOR = {"backend": "inductor"}


def spread(values: list[float]) -> str:
    if len(values) >= 3:
        q1, _, q3 = statistics.quantiles(values, n=4)
        return f"IQR {q1:.3f}-{q3:.3f}"
    if len(values) == 2:
        return f"range {min(values):.3f}-{max(values):.3f}"
    return "one pair"


def data(batch: int, rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    windows = CharWindows(load_text(), block=64, stride=37)
    loader = DataLoader(
        windows, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(rank)
    )
    out = []
    while len(out) < n:
        out += list(loader)
    return out[:n]


def lm(layers: int, seed: int = 0) -> CharLM:
    torch.manual_seed(seed)
    model = CharLM(len(set(load_text())), layers=layers)
    model.configure_model()
    return model


# -------------------------------------------------------------------------------------------------
# 1. compiled / eager step time
# -------------------------------------------------------------------------------------------------


class Loop:
    """One model and optimizer: set up by stratagem (``raw=False``) or by hand with torch alone (``raw=True``:
    ``DistributedDataParallel``, or ``fully_shard`` per block then the root; compiled with ``torch.compile``
    per block before the data-parallel wrapping, as the framework does)."""

    def __init__(self, engine: sg.Engine, compile: Any, raw: bool = False) -> None:
        model = lm(2)
        self.engine, self.raw = engine, raw
        if raw:
            self.model = self._by_hand(model, engine.strategy_name, bool(compile))
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            self.model, self.optimizer = engine.setup(model, optimizer, compile=compile)
        self.phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

    @staticmethod
    def _by_hand(model: torch.nn.Module, strategy: str, compile: bool) -> torch.nn.Module:
        if compile:
            for block in model.blocks:  # each block's forward, so that FSDP2's hooks stay outside
                block.forward = torch.compile(block.forward, backend="inductor")
        if strategy == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model)
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        # The root's parameters stay gathered from forward to backward, as stratagem's fsdp does by default.
        return fully_shard(model, reshard_after_forward=False)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.model(x), y.reshape(-1))
        t1 = time.perf_counter()
        if self.raw:
            loss.backward()
        else:
            self.engine.backward(loss, self.model)
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        t3 = time.perf_counter()
        dist.barrier()
        end = time.perf_counter()
        for name, seconds in zip(self.phases, (t1 - t0, t2 - t1, t3 - t2)):
            self.phases[name].append(seconds)
        return end - t0


def step_worker(engine: sg.Engine, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    batches = data(16, engine.rank, steps + 5)
    loops = {
        "eager": Loop(engine, False),
        "compiled": Loop(engine, INDUCTOR),
        "torch eager": Loop(engine, False, raw=True),
        "torch compiled": Loop(engine, INDUCTOR, raw=True),
    }
    for x, y in batches[:5]:  # warm-up; the compiled loops compile here
        for loop in loops.values():
            loop.step(x, y)
    for loop in loops.values():
        loop.phases = {name: [] for name in loop.phases}
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for i, (x, y) in enumerate(batches[5:]):
        # Each loop goes first in turn, and the order reverses every other round.
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order if (i // len(names)) % 2 == 0 else reversed(order):
            times[name].append(loops[name].step(x, y))

    def paired(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(times[a], times[b])]

    return {
        "median": {name: statistics.median(t) for name, t in times.items()},
        "ratios": paired("compiled", "eager"),
        "vs_torch": {
            "eager": paired("eager", "torch eager"),
            "compiled": paired("compiled", "torch compiled"),
            "torch compiled/eager": paired("torch compiled", "torch eager"),
        },
        "phases": {n: {p: statistics.median(v) for p, v in loop.phases.items()} for n, loop in loops.items()},
        "regions": loops["compiled"].engine.compiled_regions,
    }


def part_step(args: argparse.Namespace) -> None:
    loops_shown = ("eager", "compiled", "torch eager", "torch compiled")
    print(
        f"1. step time, demo LM (2 blocks, width 64), batch 16 x 64 per rank, 2 processes, {args.steps} steps"
    )
    for strategy in ("ddp", "fsdp"):
        result = sg.Engine(strategy=strategy, accelerator="cpu", devices=2).launch(step_worker, args.steps)
        ratio = statistics.median(result["ratios"])
        med = result["median"]
        print(
            f"  {strategy:5s} eager {med['eager'] * 1e3:7.2f} ms  compiled {med['compiled'] * 1e3:7.2f} ms  "
            f"compiled/eager {ratio:.3f} (median of paired steps, {spread(result['ratios'])}; goal <= 0.85)"
        )
        print(
            f"        raw torch: eager {med['torch eager'] * 1e3:7.2f} ms  compiled "
            f"{med['torch compiled'] * 1e3:7.2f} ms"
        )
        for label, ratios in result["vs_torch"].items():
            label = label if "/" in label else f"stratagem {label} / torch {label}"
            print(f"        {label}: {statistics.median(ratios):.3f} ({spread(ratios)})")
        for name in loops_shown:
            phases = result["phases"][name]
            shown = ", ".join(f"{p} {v * 1e3:.2f} ms" for p, v in phases.items())
            print(f"        {name:14s} {shown}")


# -------------------------------------------------------------------------------------------------
# 2. cold compile time against depth, and 3. the first step of a resumed run
# -------------------------------------------------------------------------------------------------


def child_depth(layers: int) -> dict[str, float]:
    torch.set_num_threads(1)
    engine = sg.Engine("single_device", accelerator="cpu")
    model = lm(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = engine.setup(model, optimizer, compile=INDUCTOR)
    times = []
    for x, y in data(16, 0, 6):
        start = time.perf_counter()
        F.cross_entropy(model(x), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {
        "first": times[0],
        "steady": statistics.median(times[1:]),
        "regions": len(engine.compiled_regions),
    }


def _child(argv: list[str], cache: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, str(HERE), *argv], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def part_depth(args: argparse.Namespace) -> None:
    print("2. cold compile (inductor, empty cache, new process), demo LM with 4 and 32 blocks, one process")
    compile_s: dict[int, list[float]] = {4: [], 32: []}
    ratios = []
    for repeat in range(args.repeats):
        pair = {}
        for layers in (4, 32) if repeat % 2 == 0 else (32, 4):
            cache = tempfile.mkdtemp(prefix="stratagem-bench-cold-")
            try:
                got = _child(["--child", "depth", "--layers", str(layers)], cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            pair[layers] = got["first"] - got["steady"]
            compile_s[layers].append(pair[layers])
        ratios.append(pair[32] / pair[4])
    for layers, values in compile_s.items():
        print(f"  {layers:2d} blocks: compile {statistics.median(values):6.2f} s (median of {len(values)})")
    print(
        f"  32 / 4 blocks: {statistics.median(ratios):.3f} (median of paired runs, {spread(ratios)}; goal <= 1.3)"
    )


class FirstStep:
    """Rank 0's wall time of the first batch of a fit (compile included)."""

    def __init__(self, out: str) -> None:
        self.out, self.start = out, None

    @sg.hookimpl
    def on_train_batch_start(self, trainer: Any) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any) -> None:
        if self.start is not None and trainer.is_global_zero and not os.path.exists(self.out):
            Path(self.out).write_text(json.dumps({"first": time.perf_counter() - self.start}))


def child_restart(root: str, out: str, resume: bool) -> None:
    class LM(CharLM):
        def __init__(self) -> None:
            torch.manual_seed(0)
            super().__init__(len(set(load_text())))

    trainer = sg.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=6 if resume else 3,
        checkpoint_every_n_steps=3,
        default_root_dir=root,
        enable_progress_bar=False,
        loggers=[],
        callbacks=[FirstStep(out)],
        compile=True,
    )
    loader = DataLoader(CharWindows(load_text(), block=64, stride=37), batch_size=16, shuffle=False)
    trainer.fit(LM(), loader, ckpt_path="last" if resume else None)


def part_restart(args: argparse.Namespace) -> None:
    print(
        "3. first step of a fresh run (empty inductor cache) and of a run resuming it (new processes), ddp x 2"
    )
    cold, warm, ratios = [], [], []
    for _ in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="stratagem-bench-restart-"))
        try:
            for phase in ("cold", "resumed"):
                argv = [
                    "--child",
                    "restart",
                    "--root",
                    str(work / "run"),
                    "--out",
                    str(work / f"{phase}.json"),
                ]
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "cache"))
                argv += ["--resume"] if phase == "resumed" else []
                done = subprocess.run(
                    [sys.executable, str(HERE), *argv], capture_output=True, text=True, env=env
                )
                if done.returncode:
                    raise RuntimeError(f"{phase}: exit {done.returncode}\n{done.stderr[-3000:]}")
            first = json.loads((work / "cold.json").read_text())["first"]
            again = json.loads((work / "resumed.json").read_text())["first"]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        cold.append(first)
        warm.append(again)
        ratios.append(again / first)
    print(f"  fresh run's first step:   {statistics.median(cold):6.2f} s (median of {len(cold)})")
    print(f"  resumed run's first step: {statistics.median(warm):6.2f} s")
    print(
        f"  resumed / fresh: {statistics.median(ratios):.3f} (median of pairs, {spread(ratios)}; goal <= 0.3)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="step,depth,restart")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per loop (part 1)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (parts 2 and 3)")
    parser.add_argument("--child", choices=["depth", "restart"], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "depth":
        print(json.dumps(child_depth(args.layers)))
        return
    if args.child == "restart":
        child_restart(args.root, args.out, args.resume)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    parts = {"step": part_step, "depth": part_depth, "restart": part_restart}
    for name in args.parts.split(","):
        parts[name](args)


if __name__ == "__main__":
    main()

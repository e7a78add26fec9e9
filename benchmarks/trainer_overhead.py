"""Per-step overhead of stratagem's Trainer over a hand-written PyTorch loop with the same wrapper, and the cost
of callbacks.

Two gloo processes on CPU, every loop on the same DistributedDataParallel wrapper (``strategy="ddp"``), the
same MLP, the same data and DistributedSampler. The loops alternate in rounds inside the same two processes so
that machine noise falls on all of them alike. A step's time is the time between consecutive training-step
starts (forward, backward, optimizer, data loading, and everything the loop does around them); the first steps
of every segment are dropped. Loops: ``raw``; ``stratagem``, the Trainer with its defaults (no callbacks, the
``csv`` logger); ``10 no-op cb``, the same with ten callbacks implementing every training event and doing
nothing; ``lightning`` when importable. Prints the median step of each loop and its ratio to the raw loop
(target for ``stratagem``: at most 1.03), and the ratio of ``10 no-op cb`` to ``stratagem`` (target: at most
1.005), each the median of the per-round ratios with their interquartile range.

Half a percent is below what segment medians resolve on a loaded machine, so the script also times the event
dispatch itself, twice: inside the runs above (every event the Trainer sends, timed on rank 0, per step), and
in this process (the three events of each optimizer step, batch start, before the optimizer step and batch end,
through a real Trainer's plugin manager, many times); each with ten no-op callbacks and with none, the
difference divided by the raw loop's median step.

    python benchmarks/trainer_overhead.py [--width 1024] [--depth 4] [--batch 96] [--steps 60] [--rounds 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stratagem as sg

WARMUP = 5


def make_net(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


def make_data(width: int, batch: int, steps: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = batch * world * (steps + 1)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 16, generator=g))


def step_times(stamps: list[float]) -> list[float]:
    deltas = [b - a for a, b in itertools.pairwise(stamps)]
    return deltas[WARMUP:]


def raw_loop(args: argparse.Namespace, data: TensorDataset) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_net(args.width, args.depth))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=False))
    stamps = []
    for x, y in loader:
        stamps.append(time.perf_counter())
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if len(stamps) > args.steps:
            break
    return step_times(stamps)


class Net(sg.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.net = make_net(args.width, args.depth)
        self.stamps: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("mse", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


class NoOp:
    """A callback on every training event that does nothing: what the event machinery alone costs."""

    @sg.hookimpl
    def on_fit_start(self, trainer: Any) -> None: ...

    @sg.hookimpl
    def on_train_epoch_start(self, trainer: Any, epoch: int) -> None: ...

    @sg.hookimpl
    def on_train_batch_start(self, trainer: Any, batch: Any, batch_idx: int) -> None: ...

    @sg.hookimpl
    def on_before_optimizer_step(self, trainer: Any, optimizer: Any, step: int) -> None: ...

    @sg.hookimpl
    def on_train_batch_end(
        self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int
    ) -> None: ...

    @sg.hookimpl
    def on_train_epoch_end(self, trainer: Any, epoch: int) -> None: ...

    @sg.hookimpl
    def on_save_checkpoint(self, trainer: Any, state: dict[str, Any]) -> None: ...

    @sg.hookimpl
    def on_fit_end(self, trainer: Any) -> None: ...


#: Seconds the Trainer spent dispatching events, per loop name, summed over its steps (see ``timed_events``).
DISPATCH: dict[int, list[float]] = {}


def timed_events(trainer: sg.Trainer, callbacks: int) -> None:
    """Time every event the Trainer sends during the run (all of them go through ``_events.call``)."""
    events = trainer._events
    call, spent = events.call, DISPATCH.setdefault(callbacks, [])

    def timed(event: str, **kwargs: Any) -> None:
        start = time.perf_counter()
        call(event, **kwargs)
        spent.append(time.perf_counter() - start)

    events.call = timed  # type: ignore[method-assign]


def stratagem_loop(
    args: argparse.Namespace, data: TensorDataset, root: str, callbacks: int = 0
) -> list[float]:
    module = Net(args)
    trainer = sg.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=args.steps + 1,
        default_root_dir=root,
        callbacks=[NoOp() for _ in range(callbacks)],
    )
    timed_events(trainer, callbacks)
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    return step_times(module.stamps)


def lightning_loop(args: argparse.Namespace, data: TensorDataset, root: str) -> list[float]:
    import lightning as L

    class LitNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(args.width, args.depth)
            self.stamps: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("mse", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    module = LitNet()
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=args.steps + 1,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    return step_times(module.stamps)


def worker(engine: sg.Engine, args: argparse.Namespace, root: str) -> dict[str, list[float]]:
    data = make_data(args.width, args.batch, args.steps, engine.world_size)
    loops = {
        "raw": lambda: raw_loop(args, data),
        "stratagem": lambda: stratagem_loop(args, data, root),
        "10 no-op cb": lambda: stratagem_loop(args, data, root, callbacks=10),
    }
    if importlib.util.find_spec("lightning") is not None:
        loops["lightning"] = lambda: lightning_loop(args, data, root)
    times: dict[str, list[float]] = {name: [] for name in loops}
    ratios: dict[str, list[float]] = {name: [] for name in loops}
    callback_ratios: list[float] = []
    names = list(loops)
    for round_ in range(args.rounds):
        medians = {}
        # Each loop takes each place in the order in turn, so that a drift of the machine's load (or a cache
        # warmed by the previous loop) falls on all of them alike.
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            loop = loops[name]
            engine.barrier(name)
            segment = loop()
            times[name] += segment
            medians[name] = statistics.median(segment)
        for name in loops:
            ratios[name].append(medians[name] / medians["raw"])
        callback_ratios.append(medians["10 no-op cb"] / medians["stratagem"])
    steps = args.rounds * (args.steps + 1)
    in_loop = {n: sum(spent) / steps for n, spent in DISPATCH.items()}
    return {"times": times, "ratios": ratios, "callback_ratios": callback_ratios, "in_loop": in_loop}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=6, help="rounds (each loop first in 1/3 of them)")
    args = parser.parse_args()
    import tempfile

    root = tempfile.mkdtemp(prefix="stratagem-overhead-")
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2)
    result = engine.launch(worker, args, root)
    print(f"2 processes (gloo, CPU), MLP {args.depth}x{args.width}, batch {args.batch} per rank, ")
    print(f"{args.rounds} rounds of {args.steps} steps per loop (first {WARMUP} of each dropped)")
    print(f"load average {os.getloadavg()[0]:.2f}; the loops take turns first (rotating order)")
    print(
        f"{'loop':<12} {'median step':>12} {'ratio to raw':>13} {'IQR of round ratios':>21}   per-round ratios"
    )
    for name, values in result["times"].items():
        ratio, q1, q3, rounds = _spread(result["ratios"][name])
        print(
            f"{name:<12} {statistics.median(values) * 1e3:>9.1f} ms {ratio:>13.3f} {q1:>10.3f}-{q3:.3f}   {rounds}"
        )
    ratio, q1, q3, rounds = _spread(result["callback_ratios"])
    print(
        f"10 no-op callbacks over none (stratagem), end to end: {ratio:.4f}, IQR {q1:.4f}-{q3:.4f} "
        f"(target <= 1.005); per round: {rounds}"
    )
    in_loop = result["in_loop"]
    print(
        f"event dispatch inside the runs (rank 0, all events, per step): no callbacks {in_loop[0] * 1e6:.2f} us, "
        f"10 no-op callbacks {in_loop[10] * 1e6:.2f} us; the difference over the raw step: "
        f"{1 + (in_loop[10] - in_loop[0]) / statistics.median(result['times']['raw']):.5f} (target <= 1.005)"
    )
    none, none_q1, none_q3 = dispatch_cost(0)
    ten, ten_q1, ten_q3 = dispatch_cost(10)
    raw_step = statistics.median(result["times"]["raw"])
    print(
        f"event dispatch per step: no callbacks {none * 1e6:.2f} us (IQR {none_q1 * 1e6:.2f}-{none_q3 * 1e6:.2f}), "
        f"10 no-op callbacks {ten * 1e6:.2f} us (IQR {ten_q1 * 1e6:.2f}-{ten_q3 * 1e6:.2f}); the difference over "
        f"the raw step ({raw_step * 1e3:.1f} ms): {1 + (ten - none) / raw_step:.5f} (target <= 1.005)"
    )


def dispatch_cost(callbacks: int, reps: int = 20000, repeats: int = 7) -> tuple[float, float, float]:
    """Seconds per optimizer step spent sending the per-step events to ``callbacks`` no-op callbacks: the
    median of ``repeats`` timings of ``reps`` steps, with the quartiles."""
    trainer = sg.Trainer(
        strategy="single_device",
        accelerator="cpu",
        callbacks=[NoOp() for _ in range(callbacks)],
        enable_progress_bar=False,
    )
    events = trainer._events  # the Trainer's own dispatcher: what its fit loop calls
    batch, optimizer, timings = (torch.zeros(1), torch.zeros(1)), object(), []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(reps):
            events.call("on_train_batch_start", trainer=trainer, batch=batch, batch_idx=i)
            events.call("on_before_optimizer_step", trainer=trainer, optimizer=optimizer, step=i)
            events.call(
                "on_train_batch_end", trainer=trainer, outputs=None, batch=batch, batch_idx=i, step=i + 1
            )
        timings.append((time.perf_counter() - start) / reps)
    q1, median, q3 = statistics.quantiles(timings, n=4)
    return median, q1, q3


def _spread(per_round: list[float]) -> tuple[float, float, float, str]:
    ratio = statistics.median(per_round)
    q1, _, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else (ratio, ratio, ratio)
    return ratio, q1, q3, " ".join(f"{r:.3f}" for r in per_round)


if __name__ == "__main__":
    main()

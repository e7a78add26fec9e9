"""Preemption under ddp and fsdp, 2 processes: SIGTERM at a random step, to the launcher or to one worker.

Each trial runs the core tests' workload script (a small regression model, AdamW, dropout, a shuffled loader;
fsdp saves sharded checkpoints asynchronously every 3 steps of 12, every 50 of 800) and sends SIGTERM once rank 0
has begun a random step, alternately to the launching process and to one worker (a random rank). Two kinds of
run: 12 slow steps (0.2 s sleep each: the ranks exchange at every boundary) and 800 short ones (2 ms sleep: the
ranks exchange every N boundaries, N agreed from their step times), the signal in the first third. Reported per
trial and per strategy and kind:

- signal to stop: from the signal to the boundary at which rank 0 agreed to stop (the checkpoint's preemption
  record says when; goal: within a second, or two steps when they are longer);
- signal to exit: from the signal to the launching process's exit (what a scheduler's grace period must
  cover), and the fraction of the grace period it used (goal: at most 10 %);
- the workers' own account: from the first rank's signal to the checkpoint written (printed by rank 0);
- the workers' exit: from the signal to the end of the later worker process (what remains after it is the
  launcher noticing and ending);
- steps lost: the steps any rank had begun minus the step the checkpoint holds (goal: 0);
- bit-identical: the run resumed with ``ckpt_path="last"`` ends with the parameters of an uninterrupted run
  (``torch.equal``).

Then the cost of being ready: the step time of trainer_overhead.py's MLP (4 x 64, batch 96 per rank) in the
same 2 processes, in rounds of four loops, each first in turn: raw DDP, the Trainer with the default preemption
signals, the same with an exchange at every boundary (as before the interval), and ``preemption_signals=()``;
the differences per round, with their spread (goal: at most +0.1 ms per step over ``preemption_signals=()``).

    python benchmarks/preemption.py --trials 10 [--grace 30] [--ready-rounds 10]
    python benchmarks/preemption.py --trials 0 --ready-rounds 10      # the cost of being ready alone
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import table

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "core" / "tests" / "workloads" / "sg_workloads.py"
_WORKERS = re.compile(r"preempted by (\w+) at step (\d+): saved (\S+) ([\d.]+) s after the signal")
_FORMAT = {"ddp": ["--format", "full"], "fsdp": ["--format", "sharded", "--async-ckpt", "--ckpt-every"]}


def command(strategy: str, steps: int, root: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    line = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", "2", "--steps", str(steps)]
    line += ["--optimizer", "adamw", "--shuffle", "--dropout", "0.1", "--grace", str(args.grace)]
    # fsdp saves every 3 steps of 12, every 50 of 800: a save may be in flight when the signal comes.
    line += [*_FORMAT[strategy], *([str(max(3, steps // 16))] if strategy == "fsdp" else [])]
    return [*line, "--root", str(root / "runs"), "--out", str(root / "out"), *extra]


def params(root: Path) -> dict[str, torch.Tensor]:
    (result,) = torch.load(f"{root / 'out'}.rank0", weights_only=False)
    return result["params"]


def progress(folder: Path, rank: int) -> tuple[int, int] | None:
    try:
        step, pid = (folder / f"rank{rank}").read_text().split()
    except (OSError, ValueError):
        return None
    return int(step), int(pid)


def record(path: Path) -> dict:
    """The preemption record of the checkpoint saved at the stop."""
    if path.is_dir():  # sharded
        return torch.load(path / "state.pt", weights_only=True)["preempted"]
    return torch.load(path, weights_only=True)["state"]["preempted"]


def trial(kind: tuple[float, int], strategy: str, target: str, at: int, args, want: dict, root: Path) -> dict:
    sleep, steps = kind
    marks = root / "progress"
    marks.mkdir(parents=True)
    env = dict(os.environ, SG_PROGRESS_DIR=str(marks))
    line = command(strategy, steps, root, args, "--step-sleep", str(sleep))
    launcher = subprocess.Popen(line, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Until rank 0 has begun step `at` and both ranks have said who they are.
    while (seen := [progress(marks, r) for r in range(2)])[0] is None or seen[0][0] < at or seen[1] is None:
        if launcher.poll() is not None:
            raise RuntimeError(
                f"{strategy}: the run ended before step {at}:\n{launcher.communicate()[1][-3000:]}"
            )
        time.sleep(0.005)
    rank = random.randrange(2)
    workers = [mark[1] for mark in seen if mark is not None]
    pid = launcher.pid if target == "launcher" else workers[rank]
    sent, sent_wall = time.monotonic(), time.time()
    os.kill(pid, signal.SIGTERM)
    streams: list[str] = []
    reader = threading.Thread(target=lambda: streams.extend(launcher.communicate(timeout=args.grace * 3)))
    reader.start()
    # When each worker process ended (a zombie until the launcher reaps it), polled every 2 ms.
    ended: dict[int, float] = {}
    while reader.is_alive():
        ended.update({w: time.monotonic() for w in workers if w not in ended and _ended(w)})
        time.sleep(0.002)
    reader.join()
    took = time.monotonic() - sent
    out, err = streams
    if launcher.returncode != 75:
        raise RuntimeError(f"{strategy}: exit code {launcher.returncode}:\n{err[-3000:]}")
    said = _WORKERS.search(out)
    if said is None:
        raise RuntimeError(f"{strategy}: rank 0 did not report the preemption:\n{out[-2000:]}")
    saved = int(said.group(2))
    stopped = record(Path(said.group(3))).get("stopped")  # when rank 0 agreed to stop (wall clock)
    begun = max(progress(marks, r)[0] for r in range(2)) + 1  # type: ignore[index]
    resumed = subprocess.run(
        command(strategy, steps, root, args, "--ckpt-path", "last"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if resumed.returncode != 0:
        raise RuntimeError(f"{strategy}: the resumed run failed:\n{resumed.stderr[-3000:]}")
    got = params(root)
    return {
        "who": target if target == "launcher" else f"rank {rank}",
        "at": at,
        "saved": saved,
        "lost": begun - saved,
        "took": took,
        "stop": None if stopped is None else stopped - sent_wall,
        "workers": float(said.group(4)),
        "exited": max(ended.values(), default=sent + took) - sent,
        "identical": all(torch.equal(got[k], v) for k, v in want.items()),
    }


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def spread(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) < 2:
        return f"{values[0]:.2f} s"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.2f} s (IQR {q1:.2f}-{q3:.2f}, max {max(values):.2f})"


# the cost of being ready --------------------------------------------------------------------------------


def ready_worker(engine, args: argparse.Namespace, root: str) -> dict[str, list[tuple[float, float, float]]]:
    """In each of 2 workers: rounds of four loops on trainer_overhead.py's MLP and data, in the same processes,
    each loop first in turn: raw DDP; the Trainer with the default preemption signals ("armed"); the same with
    an exchange at every step boundary, as before the exchanges had an interval ("every boundary"); and with
    ``preemption_signals=()`` ("off"). Rank 0 returns, per loop and round, the median and the mean step, the
    mean CPU time per step of the process (all its threads: what load on the machine changes least; a mean, so
    that the rare steps that start an exchange count), and the exchanges started per step."""
    import trainer_overhead as to

    shape = argparse.Namespace(width=args.width, depth=4, batch=96, steps=args.ready_steps)
    data = to.make_data(shape.width, shape.batch, shape.steps, engine.world_size)
    loops = {
        "raw": lambda: (to.raw_loop(shape, data), [math.nan], 0),
        "armed": lambda: _counted(lambda: _trainer_loop(shape, data, root)),
        "every boundary": lambda: _counted(lambda: _every_boundary(lambda: _trainer_loop(shape, data, root))),
        "off": lambda: _counted(lambda: _trainer_loop(shape, data, root, preemption_signals=())),
    }
    names, rounds = list(loops), []
    for round_ in range(args.ready_rounds):
        segments = {}
        for name in names[round_ % 4 :] + names[: round_ % 4]:
            engine.barrier(name)
            wall, cpu, exchanges = loops[name]()
            per_step = exchanges / (shape.steps + 1)
            segments[name] = (
                statistics.median(wall),
                statistics.fmean(wall),
                statistics.fmean(cpu),
                per_step,
            )
        rounds.append(segments)
    return {name: [r[name] for r in rounds] for name in names}


def _trainer_loop(shape: argparse.Namespace, data: Any, root: str, **options: Any) -> tuple[list, list]:
    """trainer_overhead.py's Trainer loop (defaults: the csv logger, the progress bar), timed by wall clock and
    by the process's CPU time."""
    import trainer_overhead as to
    from torch.utils.data import DataLoader

    import stratagem as sg

    class Net(to.Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.cpu.append(time.process_time())
            return super().training_step(batch, batch_idx)

    module = Net(shape)
    module.cpu = []
    trainer = sg.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=shape.steps + 1,
        default_root_dir=root,
        **options,
    )
    trainer.fit(module, DataLoader(data, batch_size=shape.batch))
    return to.step_times(module.stamps), to.step_times(module.cpu)


def _counted(run: Any) -> tuple[list, list, int]:
    """``run``'s step times, and how many exchanges its fit started (every one, the last at fit's end)."""
    from stratagem.trainer import _agreement

    start, started = _agreement.Agreement._start, [0]

    def counting(self: Any, values: Any) -> None:
        started[0] += 1
        start(self, values)

    _agreement.Agreement._start = counting  # type: ignore[method-assign]
    try:
        wall, cpu = run()
    finally:
        _agreement.Agreement._start = start  # type: ignore[method-assign]
    return wall, cpu, started[0]


def _every_boundary(run):
    from stratagem.trainer import _agreement

    budget = getattr(_agreement, "BUDGET_S", None)
    _agreement.BUDGET_S = 0.0  # a budget of 0 s: an interval of 1, every boundary
    try:
        return run()
    finally:
        _agreement.BUDGET_S = budget


def ready(args: argparse.Namespace) -> None:
    import stratagem as sg

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sg-preempt-ready-") as root:
        stats = sg.Engine(strategy="ddp", accelerator="cpu", devices=2).launch(ready_worker, args, root)
    print(
        f"\nthe cost of being ready: 2-process ddp, MLP 4x{args.width}, batch 96 per rank, {args.ready_rounds} "
        f"rounds of {args.ready_steps} steps per loop (the first 5 dropped), each loop first in turn; load "
        f"{load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    rows = []
    for name, rounds in stats.items():
        medians = [f"{statistics.median(r[i] for r in rounds) * 1e3:.3f} ms" for i in (0, 1, 2)]
        over = _added(rounds, stats["raw"], 0)[0] if name != "raw" else ""
        exchanges = f"{statistics.median(r[3] for r in rounds):.4f}" if name != "raw" else ""
        rows.append([name, *medians[:2], medians[2] if name != "raw" else "", exchanges, over])
    header = ["loop", "median step", "mean step", "mean CPU time per step", "exchanges per step"]
    print(table(rows, [*header, "median step over raw"]))
    for name in ("armed", "every boundary"):
        for i, what in enumerate(("median step", "mean step", "mean CPU time per step")):
            added, spread_ = _added(stats[name], stats["off"], i)
            print(f"{name} - off, {what}: {added} ({spread_})")
    # What the exchanges cost, from the loops that differ by one exchange per step, times how often the armed
    # loop exchanged: a figure the load moves far less than a difference of step times does.
    one = [(e[2] - o[2]) / e[3] for e, o in zip(stats["every boundary"], stats["off"])]
    print(
        f"one exchange (every boundary - off, mean CPU time per exchange): {statistics.median(one) * 1e3:+.3f} ms; "
        f"armed, {statistics.median(r[3] for r in stats['armed']):.4f} exchanges per step: "
        f"{statistics.median(one) * statistics.median(r[3] for r in stats['armed']) * 1e3:+.4f} ms per step"
    )
    print("goal: armed - off at most +0.1 ms per step")


def _added(these: list[tuple[float, ...]], base: list[tuple[float, ...]], i: int) -> tuple[str, str]:
    """The per-round differences of statistic ``i``: their median, and their quartiles and values, in ms."""
    added = [(a[i] - b[i]) * 1e3 for a, b in zip(these, base)]
    q1, _, q3 = statistics.quantiles(added, n=4) if len(added) > 1 else [added[0]] * 3
    values = " ".join(f"{v:+.3f}" for v in added)
    return (
        f"{statistics.median(added):+.3f} ms",
        f"median of rounds; IQR {q1:+.3f} to {q3:+.3f}; rounds {values}",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10, help="trials per strategy and kind of step (0: none)")
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-sleep", type=float, default=0.2, help="seconds each step sleeps (a slower step)")
    p.add_argument("--short-steps", type=int, default=800, help="steps of the short kind (0: none)")
    p.add_argument(
        "--short-sleep", type=float, default=0.002, help="seconds each step of the short kind sleeps"
    )
    p.add_argument("--grace", type=float, default=30.0, help="Trainer(preemption_grace_s=...)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ready-rounds", type=int, default=10, help="0: skip the step-time comparison")
    p.add_argument("--ready-steps", type=int, default=300)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    random.seed(seed)
    kinds = [(args.step_sleep, args.steps)] + (
        [(args.short_sleep, args.short_steps)] if args.short_steps else []
    )
    print(
        f"preemption: {args.trials} trials per strategy and kind of step ("
        + ", ".join(f"{steps} steps sleeping {sleep:g} s" for sleep, steps in kinds)
        + f"), grace period {args.grace:g} s, seed {seed}; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="sg-preempt-bench-") as tmp:
        scratch = Path(tmp)
        for strategy, kind in (
            [(s, k) for s in args.strategies.split(",") for k in kinds] if args.trials else []
        ):
            sleep, steps = kind
            name = f"{strategy}, {steps} x {sleep:g} s"
            reference = scratch / f"{strategy}-{steps}-reference"
            subprocess.run(command(strategy, steps, reference, args), **_QUIET)
            want = params(reference)
            results = []
            for i in range(args.trials):
                # Short steps: the signal in the first third, so that more than a second of steps remains.
                at = random.randrange(1, steps - 1 if sleep >= 0.1 else steps // 3)
                target = ("launcher", "worker")[i % 2]
                result = trial(kind, strategy, target, at, args, want, scratch / f"{strategy}-{steps}-{i}")
                results.append(result)
                stop = "" if result["stop"] is None else f"stopped {result['stop']:.2f} s after the signal, "
                print(
                    f"  {name} trial {i + 1}/{args.trials}: SIGTERM to the {result['who']} at step {at}: "
                    f"saved step {result['saved']}, {result['lost']} step(s) lost, {stop}exit {result['took']:.2f} s "
                    f"after it ({100 * result['took'] / args.grace:.1f} % of the grace period; the "
                    f"workers' checkpoint {result['workers']:.1f} s, their exit {result['exited']:.2f} s), "
                    f"{'bit-identical' if result['identical'] else 'DIFFERENT'}",
                    flush=True,
                )
            took = [r["took"] for r in results]
            rows.append(
                [
                    name,
                    f"{sum(r['identical'] for r in results)}/{len(results)}",
                    sum(r["lost"] for r in results),
                    spread([r["stop"] for r in results]),
                    spread(took),
                    f"{100 * max(took) / args.grace:.1f} %",
                    spread([r["workers"] for r in results]),
                    spread([r["exited"] for r in results]),
                ]
            )
        if rows:
            header = [
                "strategy, steps",
                "bit-identical",
                "steps lost (all trials)",
                "signal -> stop (rank 0)",
            ]
            header += ["signal -> exit", "of the grace period (max)", "signal -> checkpoint (rank 0)"]
            print(table(rows, [*header, "signal -> workers' exit"]))
    if args.ready_rounds:
        ready(args)


_QUIET = {"check": True, "capture_output": True, "timeout": 300}


if __name__ == "__main__":
    main()

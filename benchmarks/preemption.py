"""Preemption under ddp and fsdp, 2 processes: SIGTERM at a random step, to the launcher or to one worker.

Each trial runs the core tests' workload script (a small regression model, AdamW, dropout, a shuffled loader;
fsdp saves sharded checkpoints asynchronously every 3 steps) and sends SIGTERM once rank 0 has begun a random
step, alternately to the launching process and to one worker (a random rank). Reported per trial and per
strategy:

- signal to exit: from the signal to the launching process's exit (what a scheduler's grace period must
  cover), and the fraction of the grace period it used (goal: at most 10 %);
- the workers' own account: from the first rank's signal to the checkpoint written (printed by rank 0);
- the workers' exit: from the signal to the end of the later worker process (what remains after it is the
  launcher noticing and ending);
- steps lost: the steps any rank had begun minus the step the checkpoint holds (goal: 0);
- bit-identical: the run resumed with ``ckpt_path="last"`` ends with the parameters of an uninterrupted run
  (``torch.equal``).

Then the cost of being ready: step time of a 2-process ddp Trainer with the default preemption signals (one
3-element all-reduce per step for the ranks to agree, started at a step's end and read at the next one's)
against ``preemption_signals=()``, launches alternated.

    python benchmarks/preemption.py --trials 10 [--grace 30] [--overhead-rounds 4]
    python benchmarks/preemption.py --trials 0 --overhead-rounds 4     # the cost of being ready alone
"""

from __future__ import annotations

import argparse
import itertools
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

import torch
from _common import table

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "core" / "tests" / "workloads" / "sg_workloads.py"
_WORKERS = re.compile(r"preempted by (\w+) at step (\d+): saved \S+ ([\d.]+) s after the signal")
_OPTIONS = {"ddp": ["--format", "full"], "fsdp": ["--format", "sharded", "--async-ckpt", "--ckpt-every", "3"]}


def command(strategy: str, root: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    line = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", "2", "--steps", str(args.steps)]
    line += ["--optimizer", "adamw", "--shuffle", "--dropout", "0.1", "--grace", str(args.grace)]
    return [*line, *_OPTIONS[strategy], "--root", str(root / "runs"), "--out", str(root / "out"), *extra]


def params(root: Path) -> dict[str, torch.Tensor]:
    (result,) = torch.load(f"{root / 'out'}.rank0", weights_only=False)
    return result["params"]


def progress(folder: Path, rank: int) -> tuple[int, int] | None:
    try:
        step, pid = (folder / f"rank{rank}").read_text().split()
    except (OSError, ValueError):
        return None
    return int(step), int(pid)


def trial(strategy: str, target: str, at: int, args: argparse.Namespace, want: dict, root: Path) -> dict:
    marks = root / "progress"
    marks.mkdir(parents=True)
    env = dict(os.environ, SG_PROGRESS_DIR=str(marks))
    line = command(strategy, root, args, "--step-sleep", str(args.step_sleep))
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
    sent = time.monotonic()
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
    begun = max(progress(marks, r)[0] for r in range(2)) + 1  # type: ignore[index]
    resumed = subprocess.run(
        command(strategy, root, args, "--ckpt-path", "last"), capture_output=True, text=True, timeout=300
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
        "workers": float(said.group(3)),
        "exited": max(ended.values(), default=sent + took) - sent,
        "identical": all(torch.equal(got[k], v) for k, v in want.items()),
    }


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f} s"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.2f} s (IQR {q1:.2f}-{q3:.2f}, max {max(values):.2f})"


# the cost of being ready --------------------------------------------------------------------------------


def overhead_worker(args: argparse.Namespace) -> None:
    """One Trainer run (re-run in 2 workers by the Trainer); rank 0 writes its step times to ``args.times``."""
    from torch.utils.data import DataLoader

    import stratagem as sg

    sys.path.insert(0, str(SCRIPT.parent))
    import sg_workloads as wl

    stamps: list[float] = []

    class StepTimes:
        @sg.hookimpl
        def on_train_batch_end(self) -> None:
            stamps.append(time.perf_counter())

    trainer = sg.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=args.overhead_steps,
        enable_progress_bar=False,
        loggers=[],
        callbacks=[StepTimes()],
        seed=7,
        **({"preemption_signals": ()} if args.off else {}),
    )
    data = wl.dataset(n=8 * 64)
    trainer.fit(wl.Regression(width=args.width), DataLoader(data, batch_size=8, shuffle=True))
    if trainer.is_global_zero:
        times = [b - a for a, b in itertools.pairwise(stamps[10:])]  # the first steps warm up
        Path(args.times).write_text("\n".join(repr(t) for t in times))


def overhead(args: argparse.Namespace, scratch: Path) -> None:
    print(
        f"\nstep time, 2-process ddp Trainer, width {args.width}, {args.overhead_steps} steps per launch, "
        f"{args.overhead_rounds} rounds (order alternated); load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    medians: dict[str, list[float]] = {"armed": [], "off": []}
    for round_ in range(args.overhead_rounds):
        order = ["armed", "off"] if round_ % 2 == 0 else ["off", "armed"]
        for name in order:
            times = scratch / f"times-{name}-{round_}"
            line = [sys.executable, __file__, "--overhead-worker", "--times", str(times)]
            line += ["--overhead-steps", str(args.overhead_steps), "--width", str(args.width)]
            subprocess.run([*line, *(["--off"] if name == "off" else [])], check=True, capture_output=True)
            medians[name].append(statistics.median(float(t) for t in times.read_text().split()))
    ratios = [a / o for a, o in zip(medians["armed"], medians["off"])]
    rows = [
        [name, f"{statistics.median(values) * 1e3:.3f} ms", " ".join(f"{v * 1e3:.3f}" for v in values)]
        for name, values in medians.items()
    ]
    print(table(rows, ["preemption", "median step", "per-round medians (ms)"]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(
        f"ratio armed/off: {statistics.median(ratios):.3f} (median of rounds, IQR {q[0]:.3f}-{q[2]:.3f}; "
        "per round " + " ".join(f"{r:.3f}" for r in ratios) + ")"
    )


# the agreement alone, paired ----------------------------------------------------------------------------


def paired_worker(engine, args: argparse.Namespace) -> dict[str, list[float]]:
    """In each of 2 ddp workers: blocks of training steps of one model, without an agreement ("off"), with the
    Trainer's agreement (an all-reduce started at each step's end and read at the next one's), and with the
    blocking all-reduce on the training group that it replaced; the blocks rotate, and rank 0 returns each
    block's median step time."""
    import torch.nn.functional as F

    from stratagem.trainer._agreement import NOTHING, Agreement

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1)
    )
    model, opt = engine.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    agreement = Agreement(engine)
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def step(mode: str) -> float:
        start = time.perf_counter()
        loss = F.mse_loss(model(x), y)
        engine.backward(loss, model)
        opt.step()
        opt.zero_grad()
        if mode == "agreement":
            agreement.exchange(NOTHING)
        elif mode == "blocking":
            engine.all_reduce(torch.tensor(NOTHING, dtype=torch.float64), "max")
        return time.perf_counter() - start

    modes = ["off", "agreement", "blocking"]
    for mode in modes:  # warm-up
        for _ in range(20):
            step(mode)
    medians: dict[str, list[float]] = {mode: [] for mode in modes}
    for block in range(args.paired_blocks):
        for mode in modes[block % 3 :] + modes[: block % 3]:
            times = [step(mode) for _ in range(args.paired_block_steps)]
            medians[mode].append(statistics.median(times))
            agreement.settle()  # the next block starts with nothing in flight
    agreement.close()
    return medians


def paired(args: argparse.Namespace) -> None:
    import stratagem as sg

    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2)
    medians = engine.launch(paired_worker, args)
    print(
        f"\nthe agreement alone: 2-process ddp Engine steps (width {args.width}, AdamW, batch 8), "
        f"{args.paired_blocks} blocks of {args.paired_block_steps} steps per mode, rotating; load "
        f"{os.getloadavg()[0]:.2f}"
    )
    rows = []
    for mode in ("agreement", "blocking"):
        ratios = [a / o for a, o in zip(medians[mode], medians["off"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        extra = statistics.median(a - o for a, o in zip(medians[mode], medians["off"]))
        rows.append(
            [mode, f"{statistics.median(medians[mode]) * 1e3:.3f} ms", f"{extra * 1e3:+.3f} ms",
             f"{statistics.median(ratios):.3f} (IQR {q1:.3f}-{q3:.3f})"]
        )  # fmt: skip
    rows.append(["off", f"{statistics.median(medians['off']) * 1e3:.3f} ms", "", ""])
    print(table(rows, ["per step", "median step", "added (median of blocks)", "ratio to off (blocks)"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10, help="trials per strategy (0: none)")
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-sleep", type=float, default=0.2, help="seconds each step sleeps (a slower step)")
    p.add_argument("--grace", type=float, default=30.0, help="Trainer(preemption_grace_s=...)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--overhead-rounds", type=int, default=4, help="0: skip the step-time comparison")
    p.add_argument("--overhead-steps", type=int, default=400)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--paired-blocks", type=int, default=30, help="0: skip the paired measurement")
    p.add_argument("--paired-block-steps", type=int, default=20)
    p.add_argument("--overhead-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--off", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--times", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.overhead_worker:
        overhead_worker(args)
        return
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    random.seed(seed)
    print(
        f"preemption: {args.trials} trials per strategy, {args.steps} steps ({args.step_sleep} s sleep each), "
        f"grace period {args.grace:g} s, seed {seed}; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="sg-preempt-bench-") as tmp:
        scratch = Path(tmp)
        for strategy in args.strategies.split(",") if args.trials else []:
            reference = scratch / f"{strategy}-reference"
            subprocess.run(command(strategy, reference, args), check=True, capture_output=True, timeout=300)
            want = params(reference)
            results = []
            for i in range(args.trials):
                target, at = ("launcher", "worker")[i % 2], random.randrange(1, args.steps - 1)
                result = trial(strategy, target, at, args, want, scratch / f"{strategy}-{i}")
                results.append(result)
                print(
                    f"  {strategy} trial {i + 1}/{args.trials}: SIGTERM to the {result['who']} at step {at}: "
                    f"saved step {result['saved']}, {result['lost']} step(s) lost, exit {result['took']:.2f} s "
                    f"after the signal ({100 * result['took'] / args.grace:.1f} % of the grace period; the "
                    f"workers' checkpoint {result['workers']:.1f} s, their exit {result['exited']:.2f} s), "
                    f"{'bit-identical' if result['identical'] else 'DIFFERENT'}",
                    flush=True,
                )
            took = [r["took"] for r in results]
            rows.append(
                [
                    strategy,
                    f"{sum(r['identical'] for r in results)}/{len(results)}",
                    sum(r["lost"] for r in results),
                    spread(took),
                    f"{100 * max(took) / args.grace:.1f} %",
                    spread([r["workers"] for r in results]),
                    spread([r["exited"] for r in results]),
                ]
            )
        if rows:
            print(
                table(
                    rows,
                    [
                        "strategy",
                        "bit-identical",
                        "steps lost (all trials)",
                        "signal -> exit",
                        "of the grace period (max)",
                        "signal -> checkpoint (rank 0)",
                        "signal -> workers' exit",
                    ],
                )
            )
        if args.overhead_rounds:
            overhead(args, scratch)
    if args.paired_blocks:
        paired(args)


if __name__ == "__main__":
    main()

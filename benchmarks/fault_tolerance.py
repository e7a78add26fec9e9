"""Fault tolerance under ddp and fsdp, 2 processes: SIGKILL at a random (rank, step), one per trial.

For each trial: a run with ``max_restarts=1`` whose worker ``rank`` kills itself at ``step``. Reported per
strategy: how many trials finished with parameters bit-identical to the uninterrupted run's (``torch.equal``),
the restart latency (from the kill to rank 0 running a training step again: the agent noticing, stopping the
group, a new rendezvous, new workers starting, the checkpoint loading), and the steps lost per failure
against the checkpoint cadence. The trials use the core tests' workload script (a small regression model, so
that the figures are about restarting, not training).

    python benchmarks/fault_tolerance.py --trials 20 [--plot fault_tolerance.png]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import table

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "core" / "tests" / "workloads" / "sg_workloads.py"
_LOST = re.compile(r"restart 1 of 1: .*?; resumed from step (\d+); (\d+) step\(s\) lost")


def run(strategy: str, root: Path, steps: int, every: int, extra: list[str], marks: Path | None) -> str:
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", "2", "--steps", str(steps)]
    command += ["--optimizer", "adamw", "--shuffle", "--ckpt-every", str(every), "--root", str(root)]
    command += ["--out", str(root / "out"), *extra]
    env = dict(os.environ, SG_TIME_MARKS=str(marks)) if marks else None
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{strategy} run failed:\n{done.stderr[-3000:]}")
    return done.stdout


def params(root: Path) -> dict[str, torch.Tensor]:
    (result,) = torch.load(f"{root / 'out'}.rank0", weights_only=False)
    return result["params"]


def trial(strategy: str, rank: int, step: int, args: argparse.Namespace, want: dict, scratch: Path) -> dict:
    root, marks = scratch / f"{strategy}-{rank}-{step}-{time.monotonic_ns()}", scratch / "marks"
    marks.mkdir(exist_ok=True)
    for old in marks.iterdir():
        old.unlink()
    out = run(
        strategy,
        root,
        args.steps,
        args.every,
        ["--max-restarts", "1", "--faults", f"0:{rank}:{step}:kill"],
        marks,
    )
    got = params(root)
    latency = float((marks / "resumed-1").read_text()) - float((marks / "failed-0").read_text())
    match = _LOST.search(out)
    return {
        "identical": all(torch.equal(got[k], v) for k, v in want.items()),
        "latency": latency,
        "lost": int(match.group(2)) if match else None,
        "expected_lost": step % args.every,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--plot", default=None, help="write a plot of the restart latencies here (needs matplotlib)"
    )
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    print(
        f"fault tolerance: {args.trials} trials per strategy, {args.steps} steps, a checkpoint every "
        f"{args.every} steps, seed {seed}; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows, latencies = [], {}
    with tempfile.TemporaryDirectory(prefix="sg-ft-bench-") as tmp:
        scratch = Path(tmp)
        for strategy in args.strategies.split(","):
            run(strategy, scratch / f"{strategy}-reference", args.steps, args.every, [], None)
            want = params(scratch / f"{strategy}-reference")
            results = []
            for i in range(args.trials):
                rank, step = rng.randrange(2), rng.randrange(1, args.steps)
                result = trial(strategy, rank, step, args, want, scratch)
                results.append(result)
                print(
                    f"  {strategy} trial {i + 1}/{args.trials}: kill rank {rank} at step {step}: "
                    f"{'identical' if result['identical'] else 'DIFFERENT'}, back in {result['latency']:.2f} s, "
                    f"{result['lost']} step(s) lost",
                    flush=True,
                )
            lat = sorted(r["latency"] for r in results)
            latencies[strategy] = lat
            q1, q3 = (
                (statistics.quantiles(lat, n=4)[0], statistics.quantiles(lat, n=4)[2])
                if len(lat) > 1
                else (lat[0], lat[0])
            )
            lost = [r["lost"] for r in results if r["lost"] is not None]
            rows.append(
                [
                    strategy,
                    f"{sum(r['identical'] for r in results)}/{len(results)}",
                    f"{statistics.median(lat):.2f} s (IQR {q1:.2f}-{q3:.2f})",
                    f"{statistics.mean(lost):.2f}" if lost else "n/a",
                    f"{statistics.mean(r['expected_lost'] for r in results):.2f}",
                    sum(r["lost"] == r["expected_lost"] for r in results),
                ]
            )
    print(
        table(
            rows,
            [
                "strategy",
                "bit-identical",
                "kill -> training again",
                "steps lost (mean)",
                f"expected (step mod {args.every})",
                "lost as expected",
            ],
        )
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.boxplot(list(latencies.values()))
        ax.set_xticks(range(1, len(latencies) + 1), list(latencies))
        ax.set_ylabel("seconds from SIGKILL to training again")
        ax.set_title(f"Restart latency, 2 processes, {args.trials} kills each")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

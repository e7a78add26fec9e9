"""``stratagem compare --strategies ddp,fsdp`` against raw PyTorch (DistributedDataParallel and fully_shard)
training the same model on the same batches, measured in the same run with the same functions.

Prints, per strategy, stratagem's figures beside raw PyTorch's and their ratio (per-rank state bytes, peak RSS,
peak RSS above the pre-model baseline, iterations per second), then FSDP / DDP within each. The raw workers
get the allocator setting stratagem gives its CPU workers (``stratagem.launchers._worker_start.CPU_ALLOCATOR_ENV``), so that
the comparison is of the training path, not of malloc.

    python benchmarks/compare.py [--model medium] [--steps 20] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from _common import table
from _raw_train import launch

from stratagem.cli.compare import default_warmup
from stratagem.launchers._worker_start import CPU_ALLOCATOR_ENV

MB = 2**20
KINDS = ("ddp", "fsdp")


def figures(ranks: list[dict], warmup: int) -> dict[str, float]:
    timed = ranks[0]["step_times_s"][warmup:] or ranks[0]["step_times_s"]
    return {
        "state": max(r["state_bytes"] for r in ranks) / MB,
        "peak": max(r["peak_rss_bytes"] for r in ranks) / MB,
        "above": max(r["peak_rss_above_baseline_bytes"] for r in ranks) / MB,
        "its": len(timed) / sum(timed),
    }


def run_stratagem(model: str, steps: int, batch_size: int) -> dict[str, dict[str, float]]:
    command = [
        sys.executable,
        "-m",
        "stratagem",
        "compare",
        "--strategies",
        ",".join(KINDS),
        "--devices",
        "2",
        "--accelerator",
        "cpu",
        f"--model={model}",
        f"--steps={steps}",
        f"--batch-size={batch_size}",
        "--json",
        "--no-progress-bar",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"stratagem compare failed:\n{done.stderr[-3000:]}")
    print(f"stratagem compare: {time.perf_counter() - start:.0f} s wall", flush=True)
    data = json.loads(done.stdout)
    return {c["label"]: figures(c["ranks"], c["warmup_steps"]) for c in data["columns"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="medium", choices=["small", "medium"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="run both sides this many times (medians)")
    args = parser.parse_args()
    warmup = default_warmup(args.steps)
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for kind, values in run_stratagem(args.model, args.steps, args.batch_size).items():
            runs.setdefault(("stratagem", kind), []).append(values)
        for kind in KINDS:
            start = time.perf_counter()
            ranks = launch(
                kind,
                allocator_env=dict(CPU_ALLOCATOR_ENV),
                model=args.model,
                steps=args.steps,
                warmup=warmup,
                batch_size=args.batch_size,
            )
            print(f"raw {kind}: {time.perf_counter() - start:.0f} s wall", flush=True)
            runs.setdefault(("raw", kind), []).append(figures(ranks, warmup))

    def med(side: str, kind: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[(side, kind)])

    rows = []
    names = {
        "state": "params+grads+optimizer MB",
        "peak": "peak RSS MB",
        "above": "peak RSS above baseline MB",
        "its": "iterations/s",
    }
    for kind in KINDS:
        for key, name in names.items():
            ours, raw = med("stratagem", kind, key), med("raw", kind, key)
            rows.append(
                [
                    kind,
                    name,
                    f"{ours:.2f}" if key == "its" else f"{ours:.0f}",
                    f"{raw:.2f}" if key == "its" else f"{raw:.0f}",
                    f"{ours / raw:.3f}",
                ]
            )
    print()
    allocator = ", ".join(f"{k}={v}" for k, v in CPU_ALLOCATOR_ENV.items())
    print(
        f"model {args.model}, 2 processes, CPU (gloo), batch {args.batch_size}/rank, {args.steps} steps "
        f"({warmup} warm-up), {args.repeats} repeat(s); memory: largest rank; allocator: {allocator}"
    )
    print(table(rows, ["strategy", "figure", "stratagem", "raw torch", "stratagem / raw"]))
    print()
    fsdp_rows = []
    for key, name in names.items():
        fsdp_rows.append(
            [
                name,
                f"{med('stratagem', 'fsdp', key) / med('stratagem', 'ddp', key):.2f}",
                f"{med('raw', 'fsdp', key) / med('raw', 'ddp', key):.2f}",
            ]
        )
    print(table(fsdp_rows, ["fsdp / ddp", "stratagem", "raw torch"]))


if __name__ == "__main__":
    main()

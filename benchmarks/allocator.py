"""Which glibc malloc setting stratagem's CPU workers should get: peak RSS and step time of raw DDP and raw
FSDP2 (fully_shard) under each candidate, in the same run.

stratagem's launcher gives the CPU workers it starts ``stratagem.launchers._worker_start.CPU_ALLOCATOR_ENV`` unless the user
set the variable; this script is the measurement behind that choice. Each (strategy, setting) pair is a fresh
2-process launch (malloc reads its settings at process start) of benchmarks/_raw_train.py on the same model
and batches; settings are interleaved and repeated so that load from other jobs spreads over all of them.

    python benchmarks/allocator.py [--model medium] [--steps 10] [--repeats 2] [--kinds ddp,fsdp]
"""

from __future__ import annotations

import argparse
import statistics

from _common import table
from _raw_train import launch

MB = 2**20
SETTINGS: dict[str, dict[str, str]] = {
    "glibc default": {},
    "MMAP_THRESHOLD=65536": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "MMAP_THRESHOLD=131072": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "MMAP_THRESHOLD=1048576": {"MALLOC_MMAP_THRESHOLD_": "1048576"},
    "MMAP_THRESHOLD=4194304": {"MALLOC_MMAP_THRESHOLD_": "4194304"},
    "TRIM_THRESHOLD=0": {"MALLOC_TRIM_THRESHOLD_": "0"},
    # Transparent huge pages for malloc's own mappings (glibc >= 2.35): a fresh 32 MB buffer costs 16 page
    # faults instead of 8192 when the kernel's THP mode is "madvise" or "always".
    "MMAP_THRESHOLD=65536+hugetlb": {
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kinds", default="ddp,fsdp")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help="names from the table, comma-separated"
    )
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    names = args.settings.split(",")
    peaks: dict[tuple[str, str], list[float]] = {}
    above: dict[tuple[str, str], list[float]] = {}
    steps: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    sys_time: dict[tuple[str, str], list[float]] = {}
    faults: dict[tuple[str, str], list[float]] = {}
    state: dict[str, float] = {}
    for repeat in range(args.repeats):
        order = names if repeat % 2 == 0 else list(reversed(names))
        for kind in kinds:
            for name in order:
                ranks = launch(
                    kind,
                    allocator_env=SETTINGS[name],
                    model=args.model,
                    steps=args.steps,
                    warmup=args.warmup,
                    batch_size=args.batch_size,
                )
                key = (kind, name)
                peaks.setdefault(key, []).append(max(r["peak_rss_bytes"] for r in ranks) / MB)
                above.setdefault(key, []).append(max(r["peak_rss_above_baseline_bytes"] for r in ranks) / MB)
                steps.setdefault(key, []).extend(ranks[0]["timed_steps_s"])
                cpu.setdefault(key, []).append(statistics.mean(r["cpu_s_per_step"] for r in ranks))
                sys_time.setdefault(key, []).append(statistics.mean(r["sys_s_per_step"] for r in ranks))
                faults.setdefault(key, []).append(statistics.mean(r["minor_faults_per_step"] for r in ranks))
                state[kind] = max(r["state_bytes"] for r in ranks) / MB
                print(
                    f"[{repeat + 1}/{args.repeats}] {kind:4} {name:24} peak RSS {peaks[key][-1]:7.0f} MB  "
                    f"above baseline {above[key][-1]:7.0f} MB  median step "
                    f"{statistics.median(ranks[0]['timed_steps_s']) * 1000:6.0f} ms  CPU "
                    f"{cpu[key][-1] * 1000:6.0f} ms/step (sys {sys_time[key][-1] * 1000:5.0f})  "
                    f"{faults[key][-1]:8.0f} page faults/step",
                    flush=True,
                )
    rows = []
    for kind in kinds:
        base_peak = statistics.median(peaks[(kind, names[0])])
        base_step = statistics.median(steps[(kind, names[0])])
        base_cpu = statistics.median(cpu[(kind, names[0])])
        for name in names:
            key = (kind, name)
            peak, step = statistics.median(peaks[key]), statistics.median(steps[key])
            rows.append(
                [
                    kind,
                    name,
                    f"{state[kind]:.0f}",
                    f"{peak:.0f}",
                    f"{statistics.median(above[key]):.0f}",
                    f"{peak / base_peak:.2f}",
                    f"{step * 1000:.0f}",
                    f"{step / base_step:.2f}",
                    f"{statistics.median(cpu[key]) * 1000:.0f}",
                    f"{statistics.median(sys_time[key]) * 1000:.0f}",
                    f"{statistics.median(cpu[key]) / base_cpu:.2f}",
                    f"{statistics.median(faults[key]):.0f}",
                ]
            )
    print()
    print(
        f"model {args.model}, 2 processes, CPU (gloo), batch {args.batch_size}/rank, {args.steps} steps "
        f"({args.warmup} warm-up), medians over {args.repeats} launch(es); memory: largest rank; "
        "wall step: rank 0; CPU time (user + sys) and minor page faults: per rank and timed step, mean of ranks"
    )
    print(
        table(
            rows,
            [
                "strategy",
                "setting",
                "state MB",
                "peak RSS MB",
                "above baseline MB",
                "peak vs default",
                "median step ms",
                "step vs default",
                "CPU ms/step",
                "of which sys",
                "CPU vs default",
                "page faults/step",
            ],
        )
    )


if __name__ == "__main__":
    main()

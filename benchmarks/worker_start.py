"""Worker start: wall time of ``Engine.launch(fn)`` with 2 workers, the fork server (the default) against
spawned workers (``STRATAGEM_START_METHOD=spawn``), in the same run.

Each trial is a fresh ``python`` process that launches the same small function (a gloo process group and one
all-reduce) ``--launches`` times in a row and reports the wall time of each launch. The first launch of a
process pays for the fork server's imports; the later ones are what a notebook's second ``fit``, a sweep or a
restart pays. Trials alternate between the two methods; medians are printed with their interquartile range,
and the ratio fork server / spawn per pair of trials.

    python benchmarks/worker_start.py [--trials 5] [--launches 4]
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
import textwrap

TRIAL = textwrap.dedent(
    """
    import json, time
    import stratagem as sg

    def work(engine):
        import torch
        return float(engine.all_reduce(torch.ones(1), op="sum"))

    if __name__ == "__main__":
        engine = sg.Engine(strategy="ddp", devices=2)
        times = []
        for _ in range({launches}):
            start = time.perf_counter()
            assert engine.launch(work) == 2.0
            times.append(time.perf_counter() - start)
        print(json.dumps(times))
    """
)


def trial(method: str, launches: int, folder: str) -> list[float]:
    env = {**os.environ, "STRATAGEM_START_METHOD": method}
    script = os.path.join(folder, "trial.py")  # a file: the workers import the function from it
    with open(script, "w") as f:
        f.write(TRIAL.format(launches=launches))
    done = subprocess.run(
        [sys.executable, script],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{method} trial failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.2f} (IQR {q1:.2f} to {q3:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--launches", type=int, default=4)
    options = parser.parse_args()
    results: dict[str, list[list[float]]] = {"forkserver": [], "spawn": []}
    folder = tempfile.mkdtemp(prefix="worker-start-")
    for i in range(options.trials):
        order = ("forkserver", "spawn") if i % 2 == 0 else ("spawn", "forkserver")
        for method in order:
            results[method].append(trial(method, options.launches, folder))
            print(f"trial {i + 1} {method}: " + " ".join(f"{t:.2f}" for t in results[method][-1]), flush=True)
    shutil.rmtree(folder)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; wall seconds per launch of 2 workers")
    for label, pick in (("first launch", lambda ts: ts[:1]), ("later launches", lambda ts: ts[1:])):
        row = {m: [t for ts in results[m] for t in pick(ts)] for m in results}
        ratios = [
            statistics.median(pick(f)) / statistics.median(pick(s))
            for f, s in zip(results["forkserver"], results["spawn"], strict=True)
        ]
        print(
            f"{label:15s} forkserver {spread(row['forkserver'])} | spawn {spread(row['spawn'])} | "
            f"ratio {spread(ratios)}"
        )


if __name__ == "__main__":
    main()

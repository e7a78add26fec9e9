"""Start-up: wall time from ``python script.py`` to the first training step with devices=2, stratagem's
Trainer against Lightning's on the same script (same model, data, DDP over gloo on CPU), and stratagem under
its launchers: ``elastic`` (the default), ``ray`` starting a local cluster, and ``ray`` on a cluster that is
already running (``ray start --head``, found through ``RAY_ADDRESS``).

Each run writes the wall-clock time of every ``training_step`` of rank 0 to a file; the start-up figure is the
first one minus the moment the benchmark started ``python``. Runs alternate between the variants; medians are
printed with their ratio. Lightning's launcher keeps rank 0 in the process the user started and starts one
more; stratagem's parent only supervises and starts both workers (torch's elastic agent, or Ray actors).

``--launchers`` adds the steady step: the same script with a heavier model for ``--steps`` steps under
``elastic`` and under ``ray`` (existing cluster), runs alternating; the per-step time of a run is the median of
its step-to-step intervals after ten warm-up steps, and the ratio ray / elastic is printed per pair of runs
(median and spread): the launcher should not be on the step path.

    python benchmarks/startup.py [--repeats 3] [--launchers] [--steps 80]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset

FRAMEWORK, OUT, LAUNCHER, STEPS, WIDTH = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])


def net():
    return torch.nn.Sequential(
        torch.nn.Linear(32, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 1),
    )


def first_step(rank):
    if rank == 0:
        with open(OUT, "a") as f:
            f.write(repr(time.time()) + "\\n")


data = DataLoader(TensorDataset(torch.randn(64 * STEPS, 32), torch.randn(64 * STEPS, 1)), batch_size=64)
if FRAMEWORK == "stratagem":
    import stratagem as sg

    class M(sg.Module):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, i):
            first_step(self.trainer.engine.rank)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = sg.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=STEPS, enable_progress_bar=False,
                         default_root_dir=OUT + ".d", launcher=LAUNCHER)
    trainer.fit(M(), data)
else:
    import lightning as L

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()
            self.seen = False

        def training_step(self, batch, i):
            if not self.seen:
                self.seen = True
                first_step(self.global_rank)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=OUT + ".d")
    trainer.fit(M(), data)
"""


#: The variants of the start-up table: (label, framework, launcher, uses the running Ray cluster).
VARIANTS = {
    "stratagem": ("stratagem", "elastic", False),
    "lightning": ("lightning", "-", False),
    "ray (local cluster)": ("stratagem", "ray", False),
    "ray (running cluster)": ("stratagem", "ray", True),
}
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def step_times(
    script: Path, variant: str, workdir: Path, steps: int, width: int, ray_address: str | None
) -> tuple[float, list[float]]:
    """Seconds from ``python`` to rank 0's first step, and the wall-clock times of all its steps."""
    framework, launcher, running = VARIANTS[variant]
    out = workdir / f"{framework}-{launcher}-{time.monotonic_ns()}.txt"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENV)
    if running:
        assert ray_address is not None
        env["RAY_ADDRESS"] = ray_address
    start = time.time()
    done = subprocess.run(
        [sys.executable, str(script), framework, str(out), launcher, str(steps), str(width)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"{variant} run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    stamps = [float(t) for t in out.read_text().split()]
    return stamps[0] - start, stamps


def time_to_first_step(script: Path, variant: str, workdir: Path, ray_address: str | None = None) -> float:
    return step_times(script, variant, workdir, 2, 64, ray_address)[0]


@contextlib.contextmanager
def running_ray_cluster(workdir: Path):
    """A Ray head started as a user would (``ray start --head``), stopped afterwards."""
    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    port = 20000 + os.getpid() % 20000
    env = {**os.environ, **RAY_ENV}
    subprocess.run(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={workdir / 'ray'}",
        ],
        check=True,
        capture_output=True,
        timeout=120,
        env=env,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120, env=env)


def steady_step(stamps: list[float], warmup: int = 10) -> float:
    intervals = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]
    return statistics.median(intervals)


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--launchers", action="store_true", help="add the Ray launcher's start-up and steady step"
    )
    parser.add_argument(
        "--steps", type=int, default=80, help="steps of each steady-step run (with --launchers)"
    )
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the steady-step model")
    parser.add_argument("--steady-only", action="store_true", help="with --launchers: only the steady step")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="stratagem-startup-"))
    script = workdir / "script.py"
    script.write_text(SCRIPT)
    variants = ["stratagem"] + (["lightning"] if importlib.util.find_spec("lightning") else [])
    with contextlib.ExitStack() as stack:
        address = None
        if args.launchers:
            address = stack.enter_context(running_ray_cluster(workdir))
            variants += ["ray (local cluster)", "ray (running cluster)"]
        if args.launchers and args.steady_only:
            steady(script, workdir, args, address)
            return
        times: dict[str, list[float]] = {name: [] for name in variants}
        for name in variants:  # warm-up: file caches
            time_to_first_step(script, name, workdir, address)
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else variants[::-1]
            for name in order:
                times[name].append(time_to_first_step(script, name, workdir, address))
        print(
            f"time from `python script.py` (devices=2, ddp, CPU) to rank 0's first training step, "
            f"{args.repeats} runs each"
        )
        base = statistics.median(times["stratagem"])
        for name, values in times.items():
            median = statistics.median(values)
            runs = " ".join(f"{v:.2f}" for v in values)
            print(
                f"{name:<22} median {median:6.2f} s   runs {runs}   this / stratagem (elastic): {median / base:.2f}"
            )
        if args.launchers:
            steady(script, workdir, args, address)


def steady(script: Path, workdir: Path, args: argparse.Namespace, address: str | None) -> None:
    per_step: dict[str, list[float]] = {"stratagem": [], "ray (running cluster)": []}
    ratios = []
    for repeat in range(args.repeats):
        order = list(per_step) if repeat % 2 == 0 else list(per_step)[::-1]
        for name in order:
            _, stamps = step_times(script, name, workdir, args.steps, args.width, address)
            per_step[name].append(steady_step(stamps))
        ratios.append(per_step["ray (running cluster)"][-1] / per_step["stratagem"][-1])
    print(
        f"\nsteady step (ddp, devices=2, MLP width {args.width}, batch 64, {args.steps} steps, median of the "
        f"intervals after 10 warm-up steps), {args.repeats} runs each, alternating"
    )
    for name, values in per_step.items():
        print(
            f"{name:<22} median {1000 * statistics.median(values):7.2f} ms   runs "
            + " ".join(f"{1000 * v:.2f}" for v in values)
        )
    low, high = quartiles(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
    print(
        f"ray / elastic per-step ratio: median {statistics.median(ratios):.3f} (IQR {low:.3f}-{high:.3f}), "
        f"runs " + " ".join(f"{r:.3f}" for r in ratios)
    )


if __name__ == "__main__":
    main()

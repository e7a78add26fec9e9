"""Start-up: wall time from ``python script.py`` to the first training step with devices=2, stratagem's
Trainer against Lightning's on the same script (same model, data, DDP over gloo on CPU).

Each run writes the wall-clock time of rank 0's first ``training_step`` to a file; the figure is that time
minus the moment the benchmark started ``python``. Runs alternate between the two; medians are printed with
their ratio. Lightning's launcher keeps rank 0 in the process the user started and starts one more; stratagem's
parent only supervises and starts both workers with torch's elastic agent.

    python benchmarks/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
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

FRAMEWORK, OUT = sys.argv[1], sys.argv[2]


def net():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def first_step(rank):
    if rank == 0:
        with open(OUT, "a") as f:
            f.write(repr(time.time()) + "\\n")


data = DataLoader(TensorDataset(torch.randn(64, 32), torch.randn(64, 1)), batch_size=8)
if FRAMEWORK == "stratagem":
    import stratagem as sg

    class M(sg.Module):
        def __init__(self):
            super().__init__()
            self.net = net()
            self.seen = False

        def training_step(self, batch, i):
            if not self.seen:
                self.seen = True
                first_step(self.trainer.engine.rank)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = sg.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=2, enable_progress_bar=False,
                         default_root_dir=OUT + ".d")
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

    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=OUT + ".d")
    trainer.fit(M(), data)
"""


def time_to_first_step(script: Path, framework: str, workdir: Path) -> float:
    out = workdir / f"{framework}-{time.monotonic_ns()}.txt"
    start = time.time()
    done = subprocess.run(
        [sys.executable, str(script), framework, str(out)], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"{framework} run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return float(out.read_text().split()[0]) - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="stratagem-startup-"))
    script = workdir / "script.py"
    script.write_text(SCRIPT)
    frameworks = ["stratagem"] + (["lightning"] if importlib.util.find_spec("lightning") else [])
    times: dict[str, list[float]] = {name: [] for name in frameworks}
    for name in frameworks:  # warm-up: file caches
        time_to_first_step(script, name, workdir)
    for _ in range(args.repeats):
        for name in frameworks:
            times[name].append(time_to_first_step(script, name, workdir))
    print(
        f"time from `python script.py` (devices=2, ddp, CPU) to rank 0's first training step, {args.repeats} runs"
    )
    base = statistics.median(times["stratagem"])
    for name, values in times.items():
        median = statistics.median(values)
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:<10} median {median:6.2f} s   runs {runs}   stratagem / this: {base / median:.2f}")


if __name__ == "__main__":
    main()

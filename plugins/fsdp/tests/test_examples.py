"""The seed examples, translated to stratagem, train with fsdp on 2 processes (the Trainer re-runs each
script in its workers, as a user's ``python script.py`` would)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def run_example(script: str, root: Path) -> tuple[list[float], str]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--devices", "2", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(root / "metrics.csv") as file:
        losses = [float(row["train_loss"]) for row in csv.DictReader(file) if row.get("train_loss")]
    return losses, done.stdout


def test_lightning_manual_wrap_example_trains(tmp_path: Path) -> None:
    losses, _ = run_example("manual_wrap.py", tmp_path)
    assert len(losses) == 30
    assert sum(losses[-3:]) < 0.6 * sum(losses[:3]), losses


def test_pytorch_mnist_example_trains_with_size_based_policy(tmp_path: Path) -> None:
    losses, stdout = run_example("mnist.py", tmp_path)
    assert len(losses) == 8  # 512 images / (64 per process x 2 processes) x 2 epochs
    assert sum(losses[-2:]) < 0.6 * sum(losses[:2]), losses
    # As in the tutorial's printout with the size-based policy: fc1 is a unit of its own.
    assert "(fc1): FSDPLinear" in stdout and "(fc2): Linear" in stdout

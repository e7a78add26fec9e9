"""``stratagem demo``: trains, checkpoints half-way, resumes in a fresh Trainer, and reports loss and memory."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.cli.demo.lm import CharWindows, load_text


def _demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # The installed command, as a newcomer runs it (the workers re-run this very command line).
    command = [str(Path(sys.executable).parent / "stratagem"), "demo"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout)


def test_the_corpus_ships_with_the_package() -> None:
    text = load_text()
    assert len(text) > 30_000
    data = CharWindows(text, block=64, stride=37)
    x, y = data[3]
    assert x.shape == y.shape == (64,) and (x[1:] == y[:-1]).all()


def _check_report(done: subprocess.CompletedProcess, root: Path, steps: int, ranks: int) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    half = steps // 2
    assert f"Resumed from {root / 'checkpoints' / f'step-{half:06d}.ckpt'} at step {half}" in out
    loss_line = next(line for line in out.splitlines() if line.startswith("loss: first"))
    first, last = float(loss_line.split()[2]), float(loss_line.split()[5])
    assert first > last  # it learns
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(ranks))
    assert all(float(r[1]) > 0 and r[2] == "MB" and float(r[3]) > 0 for r in rows)
    assert sorted(p.name for p in (root / "checkpoints").glob("step-*")) == [
        f"step-{half:06d}.ckpt",
        f"step-{steps:06d}.ckpt",
    ]
    logged = list(csv.DictReader((root / "metrics.csv").open()))
    assert int(logged[-1]["step"]) == steps


@pytest.mark.timeout(120)
def test_demo_single_process(tmp_path: Path) -> None:
    done = _demo("--steps", "40", "--root-dir", str(tmp_path), timeout=110)
    _check_report(done, tmp_path, steps=40, ranks=1)
    assert "strategy single_device, 1 process(es) on cpu" in done.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.skipif(importlib.util.find_spec("stratagem_ddp") is None, reason="needs stratagem-ddp installed")
def test_demo_two_processes_ddp(tmp_path: Path) -> None:
    done = _demo(
        "--devices", "2", "--strategy", "ddp", "--steps", "40", "--root-dir", str(tmp_path), timeout=140
    )
    _check_report(done, tmp_path, steps=40, ranks=2)
    assert done.stdout.count("Resumed from") == 1  # rank 0 alone prints

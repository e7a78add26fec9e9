"""The training script the SLURM tests run (core's workload script, small), and how they read its results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "core" / "tests" / "workloads" / "sg_workloads.py"
#: Small on purpose (CI time): 6 steps of a tiny regression model, ddp on 2 processes.
ARGS = ("--devices", "2", "--steps", "6", "--batch", "4", "--shuffle", "--optimizer", "adamw")
ARGS += ("--strategy", "ddp", "--timeout", "60")


def run_script(
    root: Path,
    *extra: str,
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """The workload script (``ARGS`` plus ``extra``) as ``python script.py``, or after ``prefix`` (``srun -n 2``,
    ``python -m stratagem run ...``), from ``root``; its results go to ``root/out.rank<R>``."""
    root.mkdir(parents=True, exist_ok=True)
    command = [*prefix, str(SCRIPT), *ARGS, "--root", str(root / "runs"), "--out", str(root / "out"), *extra]
    if not prefix:
        command.insert(0, sys.executable)
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=root, env={**os.environ, **(env or {})}
    )


def results(root: Path, ranks: int = 2) -> list[dict]:
    import torch

    return [torch.load(root / f"out.rank{rank}", weights_only=False)[0] for rank in range(ranks)]


def relative_difference(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5

"""Runs ``stratagem demo`` under several strategies inside one launch (importable by spawned workers)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any


def demo_under_each(names: list[str], root: str, steps: int, devices: int) -> dict[str, Any]:
    """``stratagem.cli.demo.lm.run`` for each strategy in turn, in the processes of one launch: each run makes its
    own Trainers (and process group) as the command would. A failure is recorded and the next one runs."""
    from stratagem.cli.demo.lm import run

    results: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        try:
            report = run(
                strategy=name,
                devices=devices,
                steps=steps,
                root_dir=str(Path(root) / name),
                progress_bar=False,
            )
        except Exception:
            report = {"error": traceback.format_exc()}
        report["seconds"] = time.perf_counter() - start
        results[name] = report
    return results

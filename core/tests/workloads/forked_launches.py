"""Three launches from one process, printed as one JSON line: the first starts the fork server; the second
runs after this process changed its environment; the third is spawned (STRATAGEM_START_METHOD=spawn)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from stratagem.launchers import _worker_start


def report(marker: str) -> dict:
    import atexit

    import torch

    rank = os.environ["RANK"]
    atexit.register(Path(f"{marker}.{rank}").write_text, "exit handlers ran")
    return {
        "gone": os.environ.get("STRATAGEM_TEST_GONE"),
        "added": os.environ.get("STRATAGEM_TEST_ADDED"),
        "threads": torch.get_num_threads(),
        "parent": os.getppid(),
    }


def launch(marker: str) -> list[dict]:
    results = _worker_start.launch_function(report, (marker,), nproc_per_node=2)
    return [results[rank] for rank in sorted(results)]


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    os.environ["STRATAGEM_TEST_GONE"] = "1"
    first = launch(str(folder / "first"))
    del os.environ["STRATAGEM_TEST_GONE"]
    os.environ["STRATAGEM_TEST_ADDED"] = "yes"
    os.environ["OMP_NUM_THREADS"] = "3"
    second = launch(str(folder / "second"))
    os.environ["STRATAGEM_START_METHOD"] = "spawn"
    spawned = launch(str(folder / "spawned"))
    print(json.dumps({"launcher": os.getpid(), "first": first, "second": second, "spawned": spawned}))

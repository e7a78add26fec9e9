"""What runs inside the workers the launcher section of the contract suite starts.

Module-level functions (every launcher can ship them by reference: torch's elastic agent pickles them, Ray
cloudpickles them) and a ``-m`` entry point for script jobs. They use nothing of stratagem but the rank
environment the ``launch_workers`` hook promises, so what they report is what the launcher provided.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

#: The variables every launcher must set in every worker (see the ``launch_workers`` hook spec).
RANK_ENVIRONMENT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "STRATAGEM_WORKER",
)
#: Set in ``job.env`` by the suite: a launcher must pass it through.
MARKER = "STRATAGEM_CONTRACT_MARKER"
#: A worker blocked on a peer that failed gives up after this (the launcher should have stopped it first).
COLLECTIVE_TIMEOUT_S = 60.0


def _environment() -> dict[str, Any]:
    return {
        "env": {name: os.environ.get(name) for name in (*RANK_ENVIRONMENT, MARKER)},
        "pid": os.getpid(),
    }


def _process_group() -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist


def report(token: str) -> dict[str, Any]:
    """Join a gloo group through the environment, sum the ranks, gather every worker's environment."""
    import torch

    dist = _process_group()
    try:
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, _environment())
        return {"token": token, "rank": dist.get_rank(), "sum": total.item(), "workers": everyone}
    finally:
        dist.destroy_process_group()


def fail_on_rank_one(token: str) -> str:
    """Rank 1 raises; every other rank waits for it in a barrier that never completes."""
    dist = _process_group()
    try:
        if dist.get_rank() == 1:
            raise ValueError(f"rank 1 fails on purpose ({token})")
        dist.barrier()
        return "the barrier completed without rank 1"
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """Script job: write this worker's environment to ``<directory>/rank-<RANK>.json``."""
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank-{os.environ.get('RANK', 'unset')}.json").write_text(json.dumps(_environment()))


if __name__ == "__main__":
    main(sys.argv[1:])

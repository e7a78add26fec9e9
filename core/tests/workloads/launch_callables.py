"""``Engine.launch`` with callables that do not pickle (a lambda, a ``functools.partial`` of a local closure),
twice in one script, run as ``python launch_callables.py OUT``. Writes what the launching process got."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import sg_workloads as wl

import stratagem as sg


def main(out: Path) -> None:
    engine = sg.Engine(strategy=wl.GradAverage(), accelerator="cpu", devices=2, timeout=60)
    accumulations, steps, batch = [1, 2], 5, 4
    first = engine.launch(lambda e: wl.collectives_and_loop(e, accumulations, steps, batch))
    offset = 10.0

    def ranks_plus(e: sg.Engine, k: float) -> dict[str, float]:
        # A closure over `offset`, behind a partial: pickles neither way.
        return {"rank": e.rank, "sum": e.all_reduce(torch.tensor(e.rank + k + offset), "sum").item()}

    second = engine.launch(functools.partial(ranks_plus, k=1.0))
    runs = {str(a): {k: v.tolist() for k, v in r.items()} for a, r in first["runs"].items()}
    result = {**{k: v for k, v in first.items() if k != "runs"}, "runs": runs, "second": second}
    # Only the launching process gets here: the workers end after each launched function.
    result["writer_is_launcher"] = os.environ.get("STRATAGEM_WORKER") is None
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

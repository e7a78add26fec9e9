"""Several Trainer runs one after another in the same processes, as a JSON plan says (one launch of the workers
for all of them): ``python resume_plan.py PLAN.json``.

The plan: ``{"devices": N, "runs": [{...}, ...]}``; each run gives ``strategy``, ``batch`` (per process),
``accumulate``, ``steps``, ``root`` (a local folder or an s3:// URL) and ``out`` (rank 0 writes the result
there), and optionally ``ckpt_every``, ``format``, ``ckpt_path``, ``keep_global_batch`` and ``indexed``. The
data are taken in order, so runs at different world sizes see the same samples in the same order (the sampler
deals them out in turn). An ``indexed`` run shuffles 64 samples that carry their index instead, and its result
holds the indices each rank trained on (``seen``, one list per rank).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from sg_workloads import Indexed, Regression, dataset, indexed_dataset, snapshot
from torch.utils.data import DataLoader

import stratagem as sg


def run(devices: int, spec: dict[str, Any]) -> None:
    options: dict[str, Any] = {}
    if "keep_global_batch" in spec:  # passed only when a run asks: the plan also runs where it is unknown
        options["keep_global_batch"] = spec["keep_global_batch"]
    trainer = sg.Trainer(
        strategy=spec["strategy"],
        accelerator="cpu",
        devices=devices,
        max_steps=spec["steps"],
        accumulate_grad_batches=spec["accumulate"],
        default_root_dir=spec["root"],
        checkpoint_every_n_steps=spec.get("ckpt_every"),
        checkpoint_format=spec.get("format"),
        seed=7,
        log_every_n_steps=5,
        enable_progress_bar=False,
        loggers=[],
        timeout=60,
        **options,
    )
    indexed = spec.get("indexed", False)
    module = Indexed() if indexed else Regression()
    loader = DataLoader(
        indexed_dataset() if indexed else dataset(), batch_size=spec["batch"], shuffle=indexed
    )
    trainer.fit(module, loader, ckpt_path=spec.get("ckpt_path"))
    result = snapshot(trainer, module)
    result["accumulate"] = trainer.options.accumulate_grad_batches
    if indexed:
        seen = trainer.engine.all_gather(torch.tensor(module.seen, dtype=torch.long))
        result["seen"] = [share.tolist() for share in seen]
    if trainer.engine.rank == 0:
        torch.save(result, spec["out"])


def main(plan_file: str) -> None:
    torch.use_deterministic_algorithms(True)
    plan = json.loads(Path(plan_file).read_text())
    for spec in plan["runs"]:
        run(plan["devices"], spec)


if __name__ == "__main__":
    main(sys.argv[1])

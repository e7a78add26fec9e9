"""Several training runs in one launch, for tests/test_many_hosts_checkpoints.py: each ``--target``
``STRATEGY:FORMAT:ROOT`` trains the core's tiny regression model (core/tests/workloads/sg_workloads.py) with its
own Trainer, saving ``FORMAT`` checkpoints every ``--ckpt-every`` steps under ``ROOT`` (a folder every host
sees, or an ``s3://`` URL). With ``--resume ROOT`` the run of each target starts from the checkpoint of step
``--resume-step`` under that target's ``ROOT`` in the written launch. Each rank writes what it ended with
(``sg_workloads.snapshot``, with its host) to ``OUT.<target index>.rank<R>``.

One launch for several runs: a launch across hosts costs far more than the runs in it (torch imported in every
process)."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "tests" / "workloads"))
from sg_workloads import Regression, dataset, snapshot


def checkpoint(root: str, step: int, fmt: str) -> str:
    """Where the Trainer saved step ``step`` of a run rooted at ``root``."""
    return f"{root}/checkpoints/step-{step:06d}" + (".ckpt" if fmt == "full" else "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", action="append", required=True, help="STRATEGY:FORMAT:ROOT")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--resume", action="append", default=[], help="the written ROOT of each target, in order")
    p.add_argument("--resume-step", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    for index, target in enumerate(args.target):
        strategy, fmt, root = target.split(":", 2)
        trainer = sg.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=args.devices,
            num_nodes=args.num_nodes,
            max_steps=args.steps,
            seed=7,
            default_root_dir=root,
            checkpoint_every_n_steps=args.ckpt_every,
            checkpoint_format=fmt,
            timeout=60,
            enable_progress_bar=False,
            log_every_n_steps=1000,
        )
        module = Regression(optimizer="adamw")
        loader = DataLoader(dataset(), batch_size=4, shuffle=True)
        resume = checkpoint(args.resume[index], args.resume_step, fmt) if args.resume else None
        trainer.fit(module, loader, ckpt_path=resume)
        result = snapshot(trainer, module)
        result["host"] = socket.gethostname()
        rank = trainer.engine.rank
        # A sharded optimizer state (FSDP's DTensors) is compared by each rank's own shard.
        for values in result["optimizer"]["state"].values():
            for key, value in values.items():
                values[key] = value.to_local() if hasattr(value, "to_local") else value
        torch.save(result, f"{args.out}.{index}.rank{rank}")


if __name__ == "__main__":
    main()

"""The demo's model (``stratagem demo``'s character-level transformer) trained for a few steps with the Trainer,
for tests/test_many_hosts.py: run by every worker of a launch on one host or several. Rank 0 writes the
parameters it started from and those it ended with, the world size and the steps done to ``--out``.

``--step-sleep`` slows each step, so that a test can act between steps; ``--mark`` names a file rank 0 writes
the step number to after each step; ``--starts`` a file each process notes its start in (time, host)."""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--starts" in sys.argv:  # before torch is imported: when this process began, and where
    with open(sys.argv[sys.argv.index("--starts") + 1], "a") as note:
        note.write(f"{time.time()} {os.uname().nodename}\n")

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem.cli.demo.model import CharLM, CharWindows, load_text


class _Progress:
    """Notes the parameters as the first step of ``fit`` begins (those it resumed from, after a restart), and has
    rank 0 write each step done to a file (where a test sees how far the run is)."""

    def __init__(self, module: torch.nn.Module, path: str | None) -> None:
        self.module, self.path = module, path
        self.start: dict[str, torch.Tensor] | None = None

    @sg.hookimpl
    def on_train_batch_start(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        if self.start is None:
            self.start = _params(self.module)

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        if self.path and trainer.engine.is_global_zero:
            Path(self.path).write_text(str(trainer.global_step))


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # A sharded parameter (a DTensor) is gathered whole: every rank calls this.
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--format", default=None)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--mark", default=None)
    p.add_argument("--starts", default=None)
    p.add_argument("--ckpt-path", default=None)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    data = CharWindows(load_text(), block=32, stride=37)
    model = CharLM(len(data.vocab))
    model.__dict__["total_steps"] = args.steps  # the learning-rate schedule's length, as the demo sets it
    progress = _Progress(model, args.mark)
    trainer = sg.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.steps,
        seed=0,
        default_root_dir=args.root,
        checkpoint_every_n_steps=args.ckpt_every,
        checkpoint_format=args.format,
        max_restarts=args.max_restarts,
        timeout=args.timeout,
        enable_progress_bar=False,
        log_every_n_steps=1000,
        callbacks=[progress],
    )
    if args.step_sleep:
        step = model.training_step

        def slowed(batch: Any, batch_idx: int) -> Any:
            time.sleep(args.step_sleep)
            return step(batch, batch_idx)

        model.training_step = slowed  # type: ignore[method-assign]
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    params = _params(model)
    if trainer.engine.is_global_zero:
        result = {
            "start": progress.start,
            "params": params,
            "world_size": trainer.engine.world_size,
            "step": trainer.global_step,
            "host": os.uname().nodename,
        }
        torch.save(result, args.out)


if __name__ == "__main__":
    main()

"""A script the restart test runs (``python pp_restart.py ROOT``): launch A's checkpointed 1f1b run, with
``max_restarts=1`` and rank 1 dying in the middle of step 7's schedule on the first attempt. Rank 0 writes the
final parameters to ``ROOT/params.pt``."""

from __future__ import annotations

import os
import sys

import pp_runs as runs
import pp_workers as w
import torch

from stratagem_pp import PPStrategy


def main(root: str) -> None:
    first_attempt = os.environ.get("STRATAGEM_RESTART_COUNT", "0") == "0"
    callbacks = (runs.DieMidSchedule(step=7),) if first_attempt else ()
    trainer = runs.trainer(
        PPStrategy(schedule="1f1b"),
        2,
        f"{root}/run",
        callbacks=list(callbacks),
        checkpoint_every_n_steps=runs.CKPT_EVERY,
        max_restarts=1,
    )
    trainer.fit(w.make_module(), w.loader(), ckpt_path="last")
    params = w.gathered_params(trainer.model)
    if trainer.engine.rank == 0:
        torch.save(params, f"{root}/params.pt")


if __name__ == "__main__":
    main(sys.argv[1])

"""A tiny regression trained with the Trainer under a fault-tolerant strategy (or ``ddp``, the reference), for
the tests of stratagem-ft. Run by every worker of every replica group.

Rank 0 of each group appends one JSON line per step to ``OUT/group-<replica>.jsonl``: the attempt (restarts of
the group), the Trainer's step, torchft's step and participants, whether the step committed, the loss, the wall
clock, and a digest of the parameters; with ``--params-every-step`` the parameters themselves go to
``OUT/group-<replica>-attempt-<a>-step-<s>.pt`` (every rank's, gathered). At the end each group writes its
final parameters to ``OUT/final-<replica>.pt``.

``--kill-group G --kill-at N``: in its first attempt, group G's rank 0 kills itself (SIGKILL) at the end of
step N, after its optimizer step and before the next step's quorum. ``--step-sleep`` slows every step, and
``--sleep-while-alone`` the steps taken while a group is away, so that the killed group's restart meets the
others still training. ``--forward-at-end G``: group G runs one more forward after its last step, which opens a
quorum that no step takes, and every group tears down before its process exits; every group writes when its
process ended (after the interpreter joined its threads) to ``OUT/ended-<replica>``.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

FEATURES = 8


def dataset(samples: int = 256) -> TensorDataset:
    """Fixed data, the same in every process: y = x @ w + noise."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(samples, 1, generator=g))


class Regression(sg.Module):
    def __init__(self, lr: float = 0.02, optimizer: str = "sgd") -> None:
        super().__init__()
        self.body = sg.wrap(torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh()))
        self.head = torch.nn.Linear(16, 1)
        self.lr, self.optimizer_name = lr, optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a sharded one gathered: every rank calls this)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


class Record:
    """Notes each step of this replica group (see the module's docstring)."""

    def __init__(self, module: torch.nn.Module, args: argparse.Namespace) -> None:
        self.module, self.args = module, args
        self.attempt = int(os.environ.get("STRATAGEM_RESTART_COUNT", "0"))
        self.replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        strategy = trainer.engine.strategy
        manager = getattr(strategy, "manager", None)
        params = full_params(self.module)  # on every rank: gathering a sharded parameter is a collective
        if trainer.engine.is_global_zero:
            digest = hashlib.sha256()
            for value in params.values():
                digest.update(value.numpy().tobytes())
            row = {
                "attempt": self.attempt,
                "step": step,
                "ft_step": manager.current_step() if manager is not None else None,
                "participants": manager.num_participants() if manager is not None else None,
                "committed": getattr(strategy, "committed_steps", None),
                "refused": getattr(strategy, "refused_steps", None),
                "loss": float((outputs["loss"] if isinstance(outputs, dict) else outputs).detach()),
                "time": time.time(),
                "digest": digest.hexdigest(),
            }
            out = Path(self.args.out)
            with open(out / f"group-{self.replica}.jsonl", "a") as file:
                file.write(json.dumps(row) + "\n")
            if self.args.params_every_step:
                torch.save(params, out / f"group-{self.replica}-attempt-{self.attempt}-step-{step}.pt")
        # While a group is away, the others slow down (by the test's choice, not the strategy's), so that a
        # restart slowed by a loaded machine still finds them training.
        groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
        if manager is not None and self.args.sleep_while_alone and manager.num_participants() < groups:
            time.sleep(self.args.sleep_while_alone)
        # The job's step is torchft's (its first, empty step aside): a group that healed joined the job at the
        # survivors' step, while its own Trainer counts from its restart. It ends with the job.
        if manager is not None and manager.current_step() > self.args.steps:
            trainer.should_stop = True
        if self.args.forward_at_end == self.replica and step == self.args.steps:
            x, _ = batch
            with trainer.engine.forward_context():
                self.module(x)
        kill = self.args.kill_group == self.replica and self.args.kill_at == step and self.attempt == 0
        if kill and trainer.engine.is_global_zero:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    # `kill -USR1` on a worker writes where every thread of it is to a file: what a hang in a test needs.
    stacks = Path(os.environ.get("FT_STACKS_DIR", "/tmp")) / f"ft-train-stacks-{os.getpid()}.txt"
    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)  # noqa: SIM115
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="auto")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--launcher", default="auto")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="per process")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--out", required=True)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--kill-group", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sleep-while-alone", type=float, default=0.0)
    p.add_argument("--params-every-step", action="store_true")
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--forward-at-end", type=int, default=None)
    args = p.parse_args()
    ended = Path(args.out) / f"ended-{os.environ.get('REPLICA_GROUP_ID', '0')}"
    # Python runs this after joining the process's threads (torchft's quorum thread among them).
    atexit.register(lambda: ended.write_text(str(time.time())))
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)  # the same initial weights in every process, whatever the strategy
    model = Regression(lr=args.lr, optimizer=args.optimizer)
    trainer = sg.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        launcher=args.launcher,
        max_steps=args.steps,
        seed=0,
        default_root_dir=str(Path(args.out) / f"run-{os.environ.get('REPLICA_GROUP_ID', '0')}"),
        max_restarts=args.max_restarts,
        restart_from_scratch=args.max_restarts > 0 and args.ckpt_every is None,
        checkpoint_every_n_steps=args.ckpt_every,
        enable_progress_bar=False,
        log_every_n_steps=1,
        callbacks=[Record(model, args)],
    )
    if args.step_sleep:
        step = model.training_step

        def slowed(batch: Any, batch_idx: int) -> Any:
            time.sleep(args.step_sleep)
            return step(batch, batch_idx)

        model.training_step = slowed  # type: ignore[method-assign]
    loader = DataLoader(dataset(), batch_size=args.batch, shuffle=True)
    trainer.fit(model, loader)
    params = full_params(model)
    if trainer.engine.is_global_zero:
        torch.save(params, Path(args.out) / f"final-{os.environ.get('REPLICA_GROUP_ID', '0')}.pt")
    if args.forward_at_end is not None:
        # Torn down before the process exits, as a worker of Engine.launch is (else at exit, after the join).
        trainer.engine.teardown()


if __name__ == "__main__":
    main()

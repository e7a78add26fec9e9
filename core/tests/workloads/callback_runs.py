"""Callbacks and loggers on two processes, run as a user script (``Trainer(devices=2)`` launches the workers
once; every ``fit`` below runs in them in turn). Each worker writes what it saw to ``--out.rank<R>``.

``--part checks``: a recording callback (and its resume), EarlyStopping, ModelCheckpoint with a resume, and
the TensorBoard, MLflow, W&B and CSV loggers together. ``--part raise``: a callback that raises on rank 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import sg_workloads as wl  # beside this script: on sys.path when it runs
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem import hookimpl
from stratagem.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, Throughput
from stratagem.loggers import CSVLogger, MLflowLogger, TensorBoardLogger, WandbLogger


class Recorder:
    """Records every event as ``(event, rank, step, detail)``; its state is its rank and event count."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, Any]] = []
        self.loaded: dict[str, Any] | None = None

    def _add(self, trainer: Any, event: str, detail: Any = None) -> None:
        self.events.append((event, trainer.engine.rank, trainer.global_step, detail))

    @hookimpl
    def on_fit_start(self, trainer: Any) -> None:
        self._add(trainer, "on_fit_start")

    @hookimpl
    def on_train_epoch_start(self, trainer: Any, epoch: int) -> None:
        self._add(trainer, "on_train_epoch_start", epoch)

    @hookimpl
    def on_train_batch_start(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        self._add(trainer, "on_train_batch_start", batch_idx)

    @hookimpl
    def on_before_optimizer_step(self, trainer: Any, optimizer: Any, step: int) -> None:
        # Gradients are visible here.
        grads = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in trainer.module.parameters()]
        self._add(trainer, "on_before_optimizer_step", (step, all(grads)))

    @hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        self._add(trainer, "on_train_batch_end", (batch_idx, step, isinstance(outputs, torch.Tensor)))

    @hookimpl
    def on_validation_start(self, trainer: Any) -> None:
        self._add(trainer, "on_validation_start")

    @hookimpl
    def on_validation_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        self._add(trainer, "on_validation_end", sorted(metrics))

    @hookimpl
    def on_save_checkpoint(self, trainer: Any, path: str, state: dict[str, Any]) -> None:
        self._add(trainer, "on_save_checkpoint", Path(path).name)
        state.update(rank=trainer.engine.rank, events=len(self.events))

    @hookimpl
    def on_load_checkpoint(self, trainer: Any, path: str, state: dict[str, Any]) -> None:
        self._add(trainer, "on_load_checkpoint", Path(path).name)
        self.loaded = dict(state)

    @hookimpl
    def on_train_epoch_end(self, trainer: Any, epoch: int) -> None:
        self._add(trainer, "on_train_epoch_end", epoch)

    @hookimpl
    def on_fit_end(self, trainer: Any) -> None:
        self._add(trainer, "on_fit_end")

    @hookimpl
    def on_exception(self, trainer: Any, exception: BaseException) -> None:
        self._add(trainer, "on_exception", repr(exception))

    @hookimpl
    def log_hyperparams(self, trainer: Any, params: dict[str, Any]) -> None:
        self._add(trainer, "log_hyperparams", params.get("trainer/accumulate_grad_batches"))

    @hookimpl
    def log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        self._add(trainer, "log_metrics", (step, sorted(metrics)))


#: The validation metric each rank logs at each step (the ranks disagree; their mean decides).
SCORES = {
    # EarlyStopping(min_delta=0.2, patience=2) on the mean 5, 4, 3.5, 3.45, 3.4 stops at step 15; rank 1 alone
    # (5, 6, 7) would stop at step 9 and rank 0 alone (5, 2, 0, -1.1, -2.2) never.
    "early": {0: {3: 5.0, 6: 2.0, 9: 0.0, 12: -1.1, 15: -2.2}, 1: {3: 5.0, 6: 6.0, 9: 7.0, 12: 8.0, 15: 9.0}},
    # ModelCheckpoint: the mean is 5, 1, 4, 2, 6, 3 at steps 3..18.
    "best": {
        0: {3: 4.0, 6: 0.0, 9: 5.0, 12: 1.0, 15: 7.0, 18: 2.0},
        1: {3: 6.0, 6: 2.0, 9: 3.0, 12: 3.0, 15: 5.0, 18: 4.0},
    },
}


class Scored(wl.Regression):
    """The regression model, whose validation logs a scripted per-rank score."""

    def __init__(self, table: str, hparams: dict[str, Any] | None = None, dropout: float = 0.0) -> None:
        super().__init__(dropout=dropout)
        self.table = table
        self.hparams = hparams or {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        trainer = self.trainer
        self.log("val_score", SCORES[self.table][trainer.engine.rank][trainer.global_step])


class Raising:
    @hookimpl
    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if step == 2 and trainer.engine.rank == 1:
            raise RuntimeError("callback gives up on rank 1")


def small_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, wl.FEATURES, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def trainer(root: Path, **options: Any) -> sg.Trainer:
    options.setdefault("loggers", [])
    return sg.Trainer(
        strategy=wl.GradAverage(),
        accelerator="cpu",
        devices=2,
        seed=7,
        enable_progress_bar=False,
        default_root_dir=root,
        timeout=60,
        **options,
    )


def run_checks(root: Path, tracking_uri: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. Every event, in order: 16 samples, 2 per rank and batch -> 4 batches per epoch, 2 per step.
    recorder = Recorder()
    events_root = root / "events"
    t = trainer(
        events_root,
        max_epochs=2,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        checkpoint_every_n_steps=3,
        callbacks=[recorder],
    )
    t.fit(wl.Regression(), DataLoader(small_data(16), batch_size=2), DataLoader(small_data(8), batch_size=4))
    out["events"] = recorder.events
    resumed = Recorder()
    t = trainer(
        events_root, max_epochs=3, accumulate_grad_batches=2, log_every_n_steps=2, callbacks=[resumed]
    )
    t.fit(
        wl.Regression(),
        DataLoader(small_data(16), batch_size=2),
        DataLoader(small_data(8), batch_size=4),
        ckpt_path="last",
    )
    out["resumed_events"] = resumed.events
    out["resumed_state"] = resumed.loaded

    # 2. EarlyStopping on the reduced metric.
    stopper = EarlyStopping("val_score", mode="min", patience=2, min_delta=0.2)
    t = trainer(
        root / "early",
        max_steps=30,
        val_check_interval=3,
        limit_val_batches=1,
        callbacks=[stopper],
        loggers=["csv"],
    )
    t.fit(Scored("early"), DataLoader(wl.dataset(), batch_size=2), DataLoader(wl.dataset(), batch_size=8))
    out["early"] = {"step": t.global_step, "stopped_step": stopper.stopped_step, "best": stopper.best}

    # 3. ModelCheckpoint(save_top_k=2): 9 steps, then a resume to 18 with a fresh callback; and the same 18
    # steps without a break, for the resume's exactness (shuffled data and dropout: every RNG matters).
    best_root = root / "best"
    for steps, ckpt_path, directory in (
        (9, None, best_root),
        (18, "last", best_root),
        (18, None, root / "ref"),
    ):
        keeper = ModelCheckpoint(monitor="val_score", mode="min", save_top_k=2)
        t = trainer(directory, max_steps=steps, val_check_interval=3, limit_val_batches=1, callbacks=[keeper])
        module = Scored("best", dropout=0.2)
        t.fit(
            module,
            DataLoader(wl.dataset(), batch_size=2, shuffle=True),
            DataLoader(wl.dataset(), batch_size=8),
            ckpt_path=ckpt_path,
        )
        key = f"best_{steps}" if directory == best_root else "best_reference"
        out[key] = {"best": keeper.best, "last": keeper.last, "step": t.global_step}
        out[key]["params"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out[key]["batches"] = len(module.losses)  # trained in this fit

    # 4. Every logger at once, with the monitors feeding them.
    loggers_root = root / "loggers"
    t = trainer(
        loggers_root,
        max_steps=8,
        log_every_n_steps=2,
        val_check_interval=3,
        callbacks=[
            LearningRateMonitor(),
            Throughput(sequence_length=16, flops_per_sample=1e6, peak_flops=1e12),
            # No monitor, on a step cadence: the newest two of steps 2, 4, 6, 8.
            ModelCheckpoint(save_top_k=2, every_n_steps=2, dirpath=loggers_root / "every"),
        ],
        loggers=[
            CSVLogger(),
            TensorBoardLogger(),
            MLflowLogger(tracking_uri=tracking_uri, experiment_name="callbacks-test", run_name="two-ranks"),
            WandbLogger(project="callbacks-test", name="two-ranks"),
        ],
    )
    t.fit(
        Scored("best", hparams={"width": 32, "note": "two ranks"}),
        DataLoader(wl.dataset(), batch_size=4),
        DataLoader(wl.dataset(), batch_size=8),
    )
    out["loggers_logged"] = dict(t.logged_metrics)
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["checks", "raise"], required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tracking-uri", default="")
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    root = Path(args.root)
    if args.part == "raise":
        recorder = Recorder()
        t = trainer(root, max_steps=10, callbacks=[Raising(), recorder])
        try:
            t.fit(wl.Regression(), DataLoader(wl.dataset(), batch_size=4))
        finally:
            torch.save(recorder.events, f"{args.out}.rank{os.environ.get('RANK', '0')}")
        return
    result = run_checks(root, args.tracking_uri)
    torch.save(result, f"{args.out}.rank{os.environ.get('RANK', '0')}")


if __name__ == "__main__":
    main(sys.argv[1:])

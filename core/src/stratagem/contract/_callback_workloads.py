"""What runs in the workers of the callback section: three ``Trainer.fit`` runs with the callback or logger under
test, created by its registered name as ``Trainer(callbacks=["name"])`` creates it.

- *straight*: 6 optimizer steps, validation and a checkpoint every 3, metrics logged at every step;
- *resumed*: a new Trainer, with a new instance of the callback, resumed from the straight run's checkpoint at
  step 3 and trained to step 6;
- *failing*: a fit whose training step raises at step 2 on every rank.

Each rank returns what a checkpoint would hold of the plugin's state at the end of each fit (what its
``on_save_checkpoint`` fills) and the error a fit raised. The ranks share one process group, joined once, so
that the fits do not re-bind the master port. The strategy is ``TorchDistributedStrategy`` itself: collectives
and checkpoints over gloo, each rank training its own replica (the section checks the plugin, not training).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

from stratagem.contract import _suite_model as m

STEPS = 6
EVERY = 3
FAIL_AT_STEP = 2
FAILURE_MESSAGE = "the contract's training step fails on purpose"


class ContractStepFailure(RuntimeError):
    """What the failing fit's training step raises: the error ``fit`` must pass on unchanged."""


class SectionModule(m.StepModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        trainer = self.trainer
        if self.fail_at is not None and trainer is not None and trainer.global_step == self.fail_at:
            raise ContractStepFailure(f"{FAILURE_MESSAGE} (step {self.fail_at})")
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        self.log("val_loss", m.loss_fn(self.head(self.norm(x)), targets))


def _trainer(spec: dict[str, Any], root: Path) -> Any:
    from stratagem.strategies.torch_distributed import TorchDistributedStrategy
    from stratagem.trainer import Trainer

    plugin = [spec["name"]]
    return Trainer(
        strategy=TorchDistributedStrategy(),
        accelerator="cpu",
        devices=spec["world_size"],
        max_steps=STEPS,
        val_check_interval=EVERY,
        limit_val_batches=2,
        checkpoint_every_n_steps=EVERY,
        log_every_n_steps=1,
        default_root_dir=str(root),
        enable_progress_bar=False,
        seed=0,
        timeout=spec["timeout"],
        callbacks=plugin if spec["kind"] == "callback" else [],
        loggers=plugin if spec["kind"] == "logger" else [],
    )


def _loaders(world_size: int) -> tuple[Any, Any]:
    data = m.dataset(world_size)
    train = torch.utils.data.DataLoader(data, batch_size=m.PER_RANK_BATCH)
    return train, torch.utils.data.DataLoader(data, batch_size=m.PER_RANK_BATCH)


def _state(trainer: Any, root: Path) -> dict[str, Any]:
    """What a checkpoint written now would store of the plugin: the Trainer's own collection of it."""
    return m.plain_state(trainer._events.collect_states(trainer, str(root / "probe")))


def fit(spec: dict[str, Any], root: Path, ckpt_path: str | None = None) -> dict[str, Any]:
    from stratagem.trainer._run_dir import checkpoint_name

    trainer = _trainer(spec, root)
    train, val = _loaders(spec["world_size"])
    trainer.fit(SectionModule(), train, val, ckpt_path=ckpt_path)
    middle = Path(trainer.checkpoint_dir) / checkpoint_name(EVERY, trainer.checkpoint_format)
    return {"step": trainer.global_step, "state": _state(trainer, root), "middle": str(middle)}


def failing(spec: dict[str, Any], root: Path) -> dict[str, Any]:
    trainer = _trainer(spec, root)
    train, val = _loaders(spec["world_size"])
    try:
        trainer.fit(SectionModule(fail_at=FAIL_AT_STEP), train, val)
    except BaseException as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None, "message": f"fit returned at step {trainer.global_step}"}


def run_section(spec: dict[str, Any]) -> dict[str, Any]:
    """The three fits in this worker; this rank's results."""
    from stratagem.engine import Engine
    from stratagem.strategies.torch_distributed import TorchDistributedStrategy

    torch.set_num_threads(1)
    engine = Engine(
        strategy=TorchDistributedStrategy(),
        accelerator="cpu",
        devices=spec["world_size"],
        timeout=spec["timeout"],
    )
    engine.setup_environment()
    result: dict[str, Any] = {"rank": engine.rank, "errors": {}}
    root = Path(spec["workdir"])

    def section(name: str, function: Any) -> None:
        try:
            result[name] = function()
        except Exception:
            result["errors"][name] = traceback.format_exc()

    section("straight", lambda: fit(spec, root / "straight"))
    if "straight" in result:
        section("resumed", lambda: fit(spec, root / "resumed", result["straight"]["middle"]))
    section("failing", lambda: failing(spec, root / "failing"))
    engine.teardown()
    return result

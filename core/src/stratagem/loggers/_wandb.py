"""``wandb``: a Weights & Biases run (``pip install "stratagem[wandb]"``). With ``WANDB_MODE=offline`` the run
stays in its directory (``wandb sync`` uploads it later)."""

from __future__ import annotations

from typing import Any

from stratagem.hookspecs import hookimpl
from stratagem.loggers._logger_base import RankZeroLogger


class WandbLogger(RankZeroLogger):
    """Log to W&B: the hyperparameters as the run's config, the metrics at their steps.

    :param project: the W&B project.
    :param name: the run's display name.
    :param save_dir: where ``wandb/`` goes (default: the Trainer's ``default_root_dir``).
    :param init_options: more keyword arguments for ``wandb.init`` (``entity``, ``mode``, ``tags``, ...).

    The run id goes into checkpoints: a resumed ``fit`` continues the same run.
    """

    def __init__(
        self, project: str = "stratagem", name: str | None = None, save_dir: Any = None, **init_options: Any
    ) -> None:
        super().__init__(save_dir)
        self.project = project
        self.name = name
        self.init_options = init_options
        self.run_id: str | None = None
        self.run: Any = None

    def start(self, trainer: Any, params: dict[str, Any]) -> None:
        import wandb

        directory = self.directory(trainer)
        directory.mkdir(parents=True, exist_ok=True)
        resume = {"id": self.run_id, "resume": "allow"} if self.run_id and trainer.ckpt_path else {}
        self.run = wandb.init(
            project=self.project,
            name=self.name,
            dir=str(directory),
            config=params,
            reinit="create_new",
            **resume,
            **self.init_options,
        )
        self.run_id = self.run.id

    def write(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, failed: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None

    @hookimpl
    def on_save_checkpoint(self, state: dict[str, Any]) -> None:
        if self.run_id is not None:
            state["run_id"] = self.run_id

    @hookimpl
    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id", self.run_id)

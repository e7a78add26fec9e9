"""The loggers that ship with the core, registered like any plugin's (imports nothing heavy)."""

from __future__ import annotations

from collections.abc import Callable

from stratagem.hookspecs import hookimpl


@hookimpl
def register_loggers(register: Callable[..., None]) -> None:
    register("csv", "stratagem.loggers._csv:CSVLogger", description="metrics.csv under default_root_dir")
    register(
        "tensorboard",
        "stratagem.loggers._tensorboard:TensorBoardLogger",
        description="TensorBoard event files under default_root_dir/tensorboard",
        requires=("tensorboard",),
        install="stratagem[tensorboard]",
    )
    register(
        "mlflow",
        "stratagem.loggers._mlflow:MLflowLogger",
        description="an MLflow run (tracking URI from MLFLOW_TRACKING_URI or MLflow's default)",
        requires=("mlflow",),
        install="stratagem[mlflow]",
    )
    register(
        "wandb",
        "stratagem.loggers._wandb:WandbLogger",
        description="a Weights & Biases run (WANDB_MODE=offline keeps it on disk)",
        requires=("wandb",),
        install="stratagem[wandb]",
    )

"""The callbacks that ship with the core, registered by name like any plugin's (imports nothing heavy).

Only those that work without arguments have names; ``EarlyStopping`` needs a ``monitor``: pass an instance.
"""

from __future__ import annotations

from collections.abc import Callable

from stratagem.hookspecs import hookimpl


@hookimpl
def register_callbacks(register: Callable[..., None]) -> None:
    register(
        "model_checkpoint",
        "stratagem.callbacks._model_checkpoint:ModelCheckpoint",
        description="a checkpoint after each validation, the newest kept, plus last",
    )
    register(
        "learning_rate_monitor",
        "stratagem.callbacks._run_metrics:LearningRateMonitor",
        description="log each optimizer's learning rate per parameter group",
    )
    register(
        "throughput",
        "stratagem.callbacks._run_metrics:Throughput",
        description="log samples per second across ranks",
    )
    register(
        "hf_export",
        "stratagem.callbacks._hf_export_callback:HFExport",
        description="write the model as a Hugging Face folder at the end of fit (default_root_dir/hf/final)",
    )

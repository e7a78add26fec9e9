"""The model ``stratagem compare`` trains: a bench size or ``path:Class``; its loss and optimizer."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratagem.errors import ConfigurationError


def load_model_factory(spec: str) -> Callable[[], Any]:
    """``small``/``medium``, ``path/to/file.py:Class`` or ``package.module:Class`` -> a no-argument factory."""
    from stratagem.cli.compare import _bench_models

    if spec in _bench_models.MODELS:
        return _bench_models.MODELS[spec]
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigurationError(
            f"--model {spec!r}: give {' or '.join(sorted(_bench_models.MODELS))}, or PATH:Class "
            "(a .py file or an importable module, and a model class in it taking no arguments)."
        )
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise ConfigurationError(f"--model {spec!r}: {where} is not a file.")
        name = f"_stratagem_compare_model_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(name, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ConfigurationError(f"--model {spec!r}: cannot import {where!r} ({error}).") from error
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigurationError(f"--model {spec!r}: {where} has no attribute {attr!r}.")
    if isinstance(factory, type) and not hasattr(factory, "example_batch"):
        raise ConfigurationError(
            f"--model {spec!r}: {attr} has no example_batch(batch_size, generator) method. A compared model "
            "makes its own batches from the generator it is given, so that every strategy sees the same data."
        )
    return factory


def _training_loss(wrapped: Any, module: Any, batch: Any, batch_idx: int) -> Any:
    """The loss through the wrapper's forward (where DDP and FSDP do their work)."""
    from stratagem.trainer._model_calls import redirected_forward
    from stratagem.trainer.module import Module

    has_step = isinstance(module, Module) and type(module).overrides("training_step")
    if not has_step:
        items = batch if isinstance(batch, (tuple, list)) else (batch,)
        return wrapped(*items)
    # Through the wrapper's call also when it wrapped in place (FSDP2): its hooks gather the root's parameters.
    with redirected_forward(module, "training_step"):
        return wrapped(batch, batch_idx)


def _make_optimizer(module: Any) -> Any:
    import torch

    from stratagem.trainer.module import Module

    configured = module.configure_optimizers() if isinstance(module, Module) else None
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)):
        configured = configured[0] if configured else None
    return configured if configured is not None else torch.optim.AdamW(module.parameters(), lr=1e-4)

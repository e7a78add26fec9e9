"""What the DeepSpeed strategy hands back to the loop: the module wrapper that forwards through DeepSpeed's engine,
the optimizer as DeepSpeed steps it, and the look-ups from either to the engine. A layer below the strategy and
the checkpoint code, which both use it."""

from __future__ import annotations

from typing import Any

import torch

from stratagem.errors import ConfigurationError
from stratagem_deepspeed import _runtime


class DeepSpeedModule(torch.nn.Module):
    """The user's module (``.module``) and, once optimizers are set up, the DeepSpeed engine (``.engine``).

    Its parameters and state dict are the user's module's under the prefix ``module.``, which stratagem strips
    where names must match other strategies. The engine is not a submodule (it holds the same module).
    """

    def __init__(self, module: torch.nn.Module, evaluation_engine: Any = None) -> None:
        super().__init__()
        self.module = module
        self.__dict__["engine"] = None
        #: Makes an engine without optimizer for a ZeRO-3 model that only evaluates (validate, test,
        #: predict); ``setup_optimizers`` replaces it with the training engine.
        self.__dict__["evaluation_engine"] = evaluation_engine
        self.__dict__["evaluation_only"] = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.__dict__["engine"]
        if engine is not None:
            return engine(*args, **kwargs)
        if any(hasattr(p, "ds_id") for p in self.module.parameters()):
            make = self.__dict__["evaluation_engine"]
            if make is None:
                raise ConfigurationError(
                    "A ZeRO stage-3 model runs forward through the DeepSpeed engine, which setup_optimizers() "
                    "creates: set the model up together with its optimizer (engine.setup(model, optimizer))."
                )
            return make(self)(*args, **kwargs)
        return self.module(*args, **kwargs)


class DeepSpeedOptimizer:
    """What ``setup_optimizers`` returns: the user's optimizer as DeepSpeed steps it.

    ``param_groups`` shows the user's parameters (DeepSpeed replaced them by flat partitions in the
    optimizer itself), with every other key read from and written to the optimizer's own groups, so that
    learning-rate changes reach the step. ``step`` goes through the strategy (``engine.step``).
    """

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer, groups: list[list[Any]]) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self._groups = groups

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [_GroupView(base, params) for base, params in zip(self.optimizer.param_groups, self._groups)]

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def state(self) -> dict[Any, Any]:
        """The optimizer's state as DeepSpeed keeps it (per flat partition, not per parameter)."""
        return self.optimizer.state

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            closure()
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _runtime.zero_stage(self.engine):
            self.engine.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(
            [state_dict] if _runtime.zero_stage(self.engine) else state_dict
        )

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({type(self.optimizer).__name__}, zero_stage={_runtime.zero_stage(self.engine)})"


class _GroupView(dict):
    """A parameter group: ``params`` are the user's parameters, every other key is the optimizer's group's."""

    def __init__(self, base: dict[str, Any], params: list[Any]) -> None:
        super().__init__({**base, "params": params})
        self._base = base

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key != "params":
            self._base[key] = value


def _wrapper(model: Any) -> DeepSpeedModule:
    if not isinstance(model, DeepSpeedModule):
        raise ConfigurationError(
            f"Expected the model returned by setup() under a DeepSpeed strategy, got a {type(model).__name__}. "
            "Pass the wrapped model (model = engine.setup(model, optimizer)[0])."
        )
    return model


def _engine(model: Any) -> Any:
    engine = _wrapper(model).__dict__["engine"]
    if engine is None:
        raise ConfigurationError(
            "DeepSpeed trains through its engine, which setup_optimizers() creates: set the model up with its "
            "optimizer (model, optimizer = engine.setup(model, optimizer)) before backward or step."
        )
    return engine


def _optimizer_engine(optimizer: Any) -> Any:
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(candidate, DeepSpeedOptimizer):
            return candidate.engine
    raise ConfigurationError(
        f"Expected the optimizer returned by setup() under a DeepSpeed strategy, got {type(optimizer).__name__}."
    )

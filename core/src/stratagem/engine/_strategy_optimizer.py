"""What the Engine hands back for an optimizer (:class:`StrategyOptimizer`, stepped through the strategy), and
parameter names that hold across wrappers, to point an optimizer built before wrapping at the wrapped model."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from stratagem.registry._manager import StrategyHooks


class StrategyOptimizer:
    """The user's optimizer, stepped through the strategy (loss scaling, ZeRO, ...). Everything else
    (``param_groups``, ``zero_grad``, ``state``) reaches the wrapped optimizer."""

    def __init__(self, optimizer: Any, hooks: StrategyHooks, model: torch.nn.Module) -> None:
        self.__dict__.update(optimizer=optimizer, _hooks=hooks, _model=model)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            closure()
        self._hooks.optimizer_step(self.optimizer, self._model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.optimizer, name, value)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.optimizer!r})"


def _unwrap(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, StrategyOptimizer) else optimizer


def _strategy_objects(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as the strategy knows it: the optimizers its ``setup_optimizers`` returned, not the Engine's
    wrappers around them. Hooks never see an Engine class."""
    return {key: _unwrap(value) for key, value in state.items()}


_WRAPPER_NAMES = frozenset({"_orig_mod", "module", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _clean_name(name: str) -> str:
    # Wrappers add path components to parameter names; drop them to match a parameter before and after
    # wrapping. Whole components only: "_checkpoint_wrapped_module." or "submodule." must not lose "module.".
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _rebind_optimizer(optimizer: Any, names: dict[int, str], model: torch.nn.Module) -> None:
    """Point an optimizer built before wrapping at the wrapped model's parameters (FSDP replaces them).

    A parameter of the model that the wrapped model no longer has lives on another rank (a pipeline keeps
    this rank's stages only): it leaves the optimizer here, and a group may end up empty (every rank keeps the
    same groups, so that their state dicts line up)."""
    current = {_clean_name(n): p for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise ConfigurationError(
                    "An optimizer passed to Engine.setup() holds a parameter that is not in the model. Build the "
                    "optimizer over model.parameters(), or call setup_module() first and build it afterwards."
                )
            if name in current:
                rebound.append(current[name])
        group["params"] = rebound

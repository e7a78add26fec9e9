"""Where an Engine's models are set up: the model wrapped by the strategy's ``wrap_model`` with compile placed
where that hook says (``compile=`` checked, a model compiled already taken apart; see
:mod:`stratagem.strategies.compiling`), Hugging Face weights read into it (``init_weights``, in
:mod:`stratagem.engine._init_weights`), optimizers pointed at the wrapped model's parameters and stepped through
the strategy, and the models set up (a step operation that names no model means the one set up)."""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

from stratagem.engine._defaults import COMPILE_ENV
from stratagem.engine._init_weights import wrap_and_load
from stratagem.engine._strategy_optimizer import StrategyOptimizer, _clean_name, _rebind_optimizer
from stratagem.errors import ConfigurationError
from stratagem.strategies.compiling import (
    CompileOptions,
    Compiler,
    compile_options,
    note_recompiled,
    unwrap_compiled,
)

if TYPE_CHECKING:
    import torch

    from stratagem.engine._strategy_runtime import StrategyRuntime


class ModelSetup:
    """An Engine's ``setup``, ``setup_module`` and ``setup_optimizers`` (documented there), over its strategy."""

    def __init__(self, runtime: StrategyRuntime) -> None:
        self._runtime = runtime
        # The models set up so far and still in use, in order: held weakly, so that a model its caller dropped
        # is freed (a process that sets up model after model kept every one's memory).
        self._models: list[weakref.ref[torch.nn.Module]] = []
        #: The regions the last set-up compiled ("" for a whole module); empty without compile.
        self.compiled_regions: list[str] = []

    def setup(
        self, model: torch.nn.Module, optimizers: tuple[Any, ...], compile: Any, init_weights: Any
    ) -> Any:
        names = {id(p): _clean_name(n) for n, p in model.named_parameters()}
        wrapped = self.setup_module(model, compile, init_weights)
        if not optimizers:
            return wrapped
        for optimizer in optimizers:
            if getattr(optimizer, "state", None) and any(optimizer.state.values()):
                raise ConfigurationError(
                    "Engine.setup() got an optimizer that has taken steps already; set up before training."
                )
            if any(
                id(p) not in {id(q) for q in wrapped.parameters()}
                for group in optimizer.param_groups
                for p in group["params"]
            ):
                _rebind_optimizer(optimizer, names, wrapped)
        return (wrapped, *self.setup_optimizers(wrapped, optimizers))

    def model_for(self, model: torch.nn.Module | None) -> torch.nn.Module:
        """``model``, or when a call names none, the one model set up."""
        if model is not None:
            return model
        models = self.models
        if not models:
            raise ConfigurationError(
                "No model set up is in use (none was set up, or every one set up was dropped): set it up with "
                "engine.setup(model) and keep what it returns, or pass the model this call is for (model=...)."
            )
        if len(models) != 1:
            raise ConfigurationError("Several models are set up: pass the one this call is for (model=...).")
        return models[0]

    @property
    def models(self) -> list[torch.nn.Module]:
        """The models set up so far that are still in use, in order."""
        self._models = [ref for ref in self._models if ref() is not None]
        return [model for model in (ref() for ref in self._models) if model is not None]

    def setup_optimizers(
        self, model: torch.nn.Module, optimizers: tuple[Any, ...]
    ) -> list[StrategyOptimizer]:
        if not optimizers and not getattr(self._runtime.strategy, "provides_optimizer", False):
            raise ConfigurationError(
                "setup_optimizers() needs at least one optimizer (none only where the strategy's own "
                "configuration defines it)."
            )
        hooks = self._runtime.hooks
        prepared = hooks.setup_optimizers(model, list(optimizers))
        return [StrategyOptimizer(opt, hooks, model) for opt in prepared]

    def resolve_compile(self, compile: Any) -> CompileOptions | None:
        """``compile=`` checked (``None``: ``STRATAGEM_COMPILE`` if set, else no compile), and allowed by the
        strategy's declared capabilities."""
        options = compile_options(os.environ.get(COMPILE_ENV) if compile is None else compile)
        if options is not None:
            self._check_compilable()
        return options

    def _check_compilable(self) -> None:
        caps = self._runtime.capabilities
        if caps is None or caps.compile:
            return
        from stratagem.registry._manager import get_registry

        able = sorted(info.name for info in get_registry() if info.capabilities.compile)
        raise ConfigurationError(
            f"compile: strategy {self._runtime.name!r} declares it cannot be compiled (its capabilities say "
            f"compile=False). Train it without compile=, or choose a strategy that compiles: {', '.join(able)}."
        )

    def setup_module(self, model: torch.nn.Module, compile: Any, init_weights: Any) -> torch.nn.Module:
        """The model wrapped (with Hugging Face weights read into it, given ``init_weights``), and kept."""
        self._runtime.setup_environment()
        wrapped = wrap_and_load(self._runtime, model, init_weights, lambda: self._wrap(model, compile))
        self._models.append(weakref.ref(wrapped))
        return wrapped

    def _wrap(self, model: torch.nn.Module, compile: Any) -> torch.nn.Module:
        """``wrap_model`` with compile in the strategy's place: before the hook when its implementation does not
        take ``compiler``, inside it (the strategy calls it) when it does."""
        options = self.resolve_compile(compile)
        model, where, found = unwrap_compiled(model)
        if where:
            if options is None and compile is not False:
                options = found or CompileOptions()
                self._check_compilable()
            if self._runtime.rank == 0 and options is not None:
                note_recompiled(where, options)
        compiler = Compiler(options)
        hooks = self._runtime.hooks
        if hooks.strategy_takes("wrap_model", "compiler"):
            wrapped = hooks.wrap_model(model, compiler)
            if compiler.enabled and not compiler.called:
                raise ConfigurationError(
                    f"compile: strategy {self._runtime.name!r} takes wrap_model's `compiler` but did not call it, "
                    "so nothing was compiled. A strategy that takes it calls compiler(module) after its tensor "
                    "parallelism and activation checkpointing, before data-parallel wrapping (docs/hooks.md)."
                )
        else:
            compiler(model)
            wrapped = hooks.wrap_model(model, compiler)
        self.compiled_regions = list(compiler.regions)
        return wrapped

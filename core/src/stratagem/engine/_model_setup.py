"""The Engine's part of ``compile=``: the request checked, a model compiled already taken apart, and compile
placed where the strategy's ``wrap_model`` says (see :mod:`stratagem.strategies.compiling`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from stratagem.engine._defaults import COMPILE_ENV
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

    from stratagem.registry._manager import StrategyHooks


class Compiling:
    """The Engine's compile methods; the Engine holds the strategy and its hooks."""

    _hooks: StrategyHooks
    strategy_name: str
    capabilities: Any
    _environment_ready: bool

    @property
    def rank(self) -> int:  # the Engine's
        raise NotImplementedError

    #: The regions the last ``setup``/``setup_module`` compiled ("" for a whole module); empty without compile.
    compiled_regions: list[str] = []

    def resolve_compile(self, compile: Any) -> CompileOptions | None:
        """``compile=`` checked (``None``: ``STRATAGEM_COMPILE`` if set, else no compile), and allowed by the
        strategy's declared capabilities."""
        options = compile_options(os.environ.get(COMPILE_ENV) if compile is None else compile)
        if options is not None:
            self._check_compilable()
        return options

    def _check_compilable(self) -> None:
        caps = self.capabilities
        if caps is None or caps.compile:
            return
        from stratagem.registry._manager import get_registry

        able = sorted(info.name for info in get_registry() if info.capabilities.compile)
        raise ConfigurationError(
            f"compile: strategy {self.strategy_name!r} declares it cannot be compiled (its capabilities say "
            f"compile=False). Train it without compile=, or choose a strategy that compiles: {', '.join(able)}."
        )

    def _wrap(self, model: torch.nn.Module, compile: Any) -> torch.nn.Module:
        """``wrap_model`` with compile in the strategy's place: before the hook when its implementation does not
        take ``compiler``, inside it (the strategy calls it) when it does."""
        options = self.resolve_compile(compile)
        model, where, found = unwrap_compiled(model)
        if where:
            if options is None and compile is not False:
                options = found or CompileOptions()
                self._check_compilable()
            if self.rank == 0 and options is not None:
                note_recompiled(where, options)
        compiler = Compiler(options)
        if self._hooks.strategy_takes("wrap_model", "compiler"):
            wrapped = self._hooks.wrap_model(model, compiler)
            if compiler.enabled and not compiler.called:
                raise ConfigurationError(
                    f"compile: strategy {self.strategy_name!r} takes wrap_model's `compiler` but did not call it, "
                    "so nothing was compiled. A strategy that takes it calls compiler(module) after its tensor "
                    "parallelism and activation checkpointing, before data-parallel wrapping (docs/hooks.md)."
                )
        else:
            compiler(model)
            wrapped = self._hooks.wrap_model(model, compiler)
        self.compiled_regions = list(compiler.regions)
        return wrapped

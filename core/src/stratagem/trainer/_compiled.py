"""A model that reaches a Trainer entry point compiled already: ``trainer.fit(torch.compile(model))``, as
Lightning documents it, or ``model.compile()``. Every entry point takes torch.compile's wrapper off here first,
so the checks, the callbacks and ``trainer.module`` see the user's :class:`~stratagem.Module`; the run then
compiles it in the framework's place (:mod:`stratagem.strategies.compiling`) with the options the user gave
``torch.compile``, unless the Trainer's own ``compile=`` says otherwise."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from stratagem.strategies.compiling import CompileOptions, recompiled_note, unwrap_compiled

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.trainer.module import Module


def _outermost_plain(model: Any) -> Any:
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


class CompiledModels:
    """The Trainer's part of a model compiled before it arrived."""

    engine: Engine
    module: Module | None
    #: The run's compile options (``False``: none), as ``Trainer(compile=...)`` resolved them.
    _compile: CompileOptions | bool
    #: ``Trainer(compile=False)``: a compiled model is unwrapped and not compiled again.
    _compile_off: bool

    def _plain_module(self, model: Any) -> Any:
        """``model`` without torch.compile. The first time, the run takes the options ``torch.compile`` was
        given where ``Trainer(compile=...)`` gave none, and rank 0 prints one line saying so."""
        if "torch._dynamo" not in sys.modules:
            return model  # nothing in this process was compiled (and importing Dynamo takes seconds)
        if self.module is not None and _outermost_plain(model) is self.module:
            # The model this Trainer set up (compiled in place then): only the user's outer wrapper comes off.
            return self.module
        plain, where, found = unwrap_compiled(model)
        if not where:
            return model
        if self._compile is False and not self._compile_off:
            # Checked here, before anything launches: a strategy that declares it cannot compile is refused.
            self._compile = self.engine.resolve_compile(found or CompileOptions()) or False
        self.print(recompiled_note(where, self._compile or None))
        return plain

    if TYPE_CHECKING:  # the Trainer's

        def print(self, *args: Any) -> None: ...

"""What a Trainer's run trains, set up the same way at every entry point (``fit``, ``validate``, ``test``,
``predict``): the workers launched from the process the user started, the user's :class:`~stratagem.Module`
attached to the Trainer and configured once, wrapped by the Engine with its optimizers and schedulers, and the
loaders given this process's share of the data.

A model that arrives compiled already (``trainer.fit(torch.compile(model))``, as Lightning documents it, or
``model.compile()``) has torch.compile's wrapper taken off first, so that the checks, the callbacks and
``trainer.module`` see the user's Module; the run then compiles it in the framework's place
(:mod:`stratagem.strategies.compiling`) with the options the user gave ``torch.compile``, unless the Trainer's
own ``compile=`` says otherwise."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from stratagem.errors import ConfigurationError
from stratagem.strategies.compiling import CompileOptions, recompiled_note, unwrap_compiled
from stratagem.trainer import _fit_checks
from stratagem.trainer._teardown import _register_teardown

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.trainer._preemption_stop import Preemption
    from stratagem.trainer._progress import Console
    from stratagem.trainer._run_state import RunState
    from stratagem.trainer.module import Module


class RunSetup:
    """Sets up ``run``'s model through the Engine. ``attach_to`` is what ``Module.trainer`` returns while the
    module trains (the Trainer, which this part only hands on)."""

    def __init__(
        self,
        engine: Engine,
        run: RunState,
        *,
        compile: CompileOptions | bool,
        compile_off: bool,
        init_weights: Any,
        preemption: Preemption,
        console: Console,
        attach_to: object,
    ) -> None:
        self._engine, self._run, self._preemption, self._console = engine, run, preemption, console
        self._attach_to = attach_to
        #: The run's compile options (``False``: none), as ``Trainer(compile=...)`` resolved them.
        self.compile = compile
        self._compile_off = compile_off  # Trainer(compile=False): a compiled model is unwrapped, not compiled
        #: ``Trainer(init_weights=...)`` as ``HFWeights`` (``None``: none), read where no checkpoint is.
        self.init_weights = init_weights

    def launch(self) -> None:
        """Start the workers, which re-run the script; this process then exits with their status."""
        _fit_checks.check_relaunchable(self._engine.devices)
        self._engine.supervise(**self._preemption.job_fields())

    def plain_module(self, model: Any) -> Any:
        """``model`` without torch.compile. The first time, the run takes the options ``torch.compile`` was
        given where ``Trainer(compile=...)`` gave none, and rank 0 prints one line saying so."""
        if "torch._dynamo" not in sys.modules:
            return model  # nothing in this process was compiled (and importing Dynamo takes seconds)
        if self._run.module is not None and _outermost_plain(model) is self._run.module:
            # The model this Trainer set up (compiled in place then): only the user's outer wrapper comes off.
            return self._run.module
        plain, where, found = unwrap_compiled(model)
        if not where:
            return model
        if self.compile is False and not self._compile_off:
            # Checked here, before anything launches: a strategy that declares it cannot compile is refused.
            self.compile = self._engine.resolve_compile(found or CompileOptions()) or False
        self._console.print(recompiled_note(where, self.compile or None))
        return plain

    def setup(self, model: Module, *, with_optimizers: bool, init_weights: Any = None) -> None:
        """The first time: the process group joined, the module attached and configured (on the meta device
        given ``init_weights``, which fill it), wrapped (with its optimizers for ``fit``). Later: the optimizers a
        ``fit`` after ``validate`` needs."""
        engine, run, seed = self._engine, self._run, self._run.options.seed
        if run.module is not None and model is not run.module:
            raise ConfigurationError("This Trainer already trains another model; make one Trainer per model.")
        first = run.model is None
        if first:
            engine.setup_environment()
            _register_teardown(engine)
            if seed is not None:
                engine.seed_everything(seed)
            model.__dict__["_stratagem_trainer"] = self._attach_to
            run.module = model
            if not model.__dict__.get("_stratagem_configured", False):
                with engine.init_module(empty_init=init_weights is not None):
                    model.configure_model()
                model.__dict__["_stratagem_configured"] = True
        elif seed is not None and with_optimizers:
            engine.seed_everything(seed)
        wrap = {"compile": self.compile, "init_weights": init_weights}
        if with_optimizers and not run.optimizers:
            optimizers, run.lr_schedulers = _fit_checks.configured_optimizers(model, engine.strategy)
            if first and optimizers:
                run.model, *run.optimizers = engine.setup(model, *optimizers, **wrap)
            else:
                if first:  # no optimizer of the module's: the strategy's configuration defines it
                    run.model = engine.setup_module(model, **wrap)
                # Set up by validate() before: optimizers over the wrapped model's parameters.
                run.optimizers = engine.setup_optimizers(run.model, *optimizers)
        elif first:
            run.model = engine.setup_module(model, **wrap)

    def prepare_loader(self, loader: Any) -> Any:
        options = self._run.options
        return self._engine.setup_dataloaders(
            loader, use_distributed_sampler=options.use_distributed_sampler, seed=options.seed or 0
        )


def checked_init_weights(init_weights: Any) -> Any:
    """``Trainer(init_weights=...)`` as ``HFWeights``; a local path that does not exist fails here, before
    anything launches."""
    from stratagem.checkpoint._hf_match import checked_request

    return None if init_weights is None else checked_request(init_weights)


def _outermost_plain(model: Any) -> Any:
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model

"""``deepspeed*``: the DeepSpeed engine and its ZeRO optimizers behind stratagem's hooks.

``deepspeed.initialize`` needs the model and its optimizer together, but stratagem wraps the model first and
sets up optimizers afterwards. So :meth:`~DeepSpeedStrategy.wrap_model` returns a light
:class:`DeepSpeedModule` around the user's module, and :meth:`~DeepSpeedStrategy.setup_optimizers` creates the
engine and attaches it; from then on the wrapper's forward is the engine's.

DeepSpeed owns the step: gradient reduction and partitioning, loss scaling, clipping and the optimizer
update all happen in ``engine.backward`` and ``engine.step``. stratagem's options reach it as follows:

- accumulation: DeepSpeed is configured for one micro-batch per step, and :meth:`no_sync` marks the
  micro-batches before the last as "not a boundary" (``engine.set_gradient_accumulation_boundary``), as the
  Trainer and the contract loop use it. The loss is divided by the loop, not by DeepSpeed.
- clipping: :meth:`clip_gradients` sets the clip value of the ZeRO optimizer for the coming step (DeepSpeed
  clips inside ``step`` with the norm of the partitioned gradients) and returns that norm, computed from the
  same reduced gradients before the step.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, ContextManager

import torch

from stratagem import hookimpl
from stratagem.errors import ConfigurationError
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem.strategies.base import Strategy
from stratagem.strategies.precision import default_dtype, param_dtype
from stratagem.strategies.torch_distributed import TorchDistributedStrategy
from stratagem_deepspeed import _optimizers, _rules, _runtime, _sections, _state
from stratagem_deepspeed._config import CONFIG_ENV, DeepSpeedConfig
from stratagem_deepspeed._wrappers import (
    DeepSpeedModule,
    DeepSpeedOptimizer,
    _engine,
    _optimizer_engine,
    _wrapper,
)

#: Config sections that only a training engine uses (an evaluation engine would build an optimizer from them).
_TRAINING_ONLY = ("optimizer", "scheduler")


class DeepSpeedStrategy(TorchDistributedStrategy):
    """DeepSpeed's engine with ZeRO stage 1, 2 or 3, optionally offloading to CPU memory.

    Options keep the seeds' names; :class:`~stratagem_deepspeed.DeepSpeedConfig` lists and documents them all
    (ZeRO, CPU and NVMe offload, activation checkpointing, fp16 loss scaling)::

        DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
        DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, offload_params_device="nvme",
                          offload_optimizer_device="nvme", nvme_path="/local_nvme")
        DeepSpeedStrategy(config="ds_config.json")   # a whole DeepSpeed config; the options are not applied

    Without ``config``, the environment variable ``STRATAGEM_DEEPSPEED_CONFIG`` may name a JSON config.
    """

    #: ``Engine.save`` writes DeepSpeed's own sharded directory unless told ``format="full"``.
    checkpoint_format = "sharded"

    def __init__(
        self,
        *,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: dict[str, Any] | str | os.PathLike[str] | None = None,
        logging_level: int | str = "WARNING",
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float | None = None,
        **options: Any,
    ) -> None:
        if config is None and os.environ.get(CONFIG_ENV):
            config = os.environ[CONFIG_ENV]
        self.config = DeepSpeedConfig.from_options(
            dict(
                stage=stage,
                offload_optimizer=offload_optimizer,
                offload_parameters=offload_parameters,
                config=config,
                logging_level=logging_level,
                **options,
            )
        )
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._deepspeed: Any = None
        self._engines: list[Any] = []
        #: Engines whose clip value clip_gradients changed for the coming step, with the value to restore.
        self._clip_restore: dict[int, float] = {}

    def __repr__(self) -> str:
        return f"DeepSpeedStrategy({self.config!r})"

    def deepspeed_config(self, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """The config ``deepspeed.initialize`` receives for this run's precision and accelerator (and model)."""
        numel = None
        if model is not None:
            numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
        return self.config.deepspeed_config(self.precision, self.cluster.accelerator, numel)

    @property
    def zero_stage(self) -> int:
        return self.config.zero_stage

    # environment ----------------------------------------------------------------------------------
    @hookimpl
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        TorchDistributedStrategy.setup_environment(self, cluster, precision)
        # Checked where the strategy was built, and here again: a worker may run on another machine.
        _rules.check_nvme_paths(self.config)
        self._deepspeed = _runtime.import_deepspeed(cluster.accelerator, self.config.logging_level)
        # Reuses the process group made above instead of creating DeepSpeed's own.
        self._deepspeed.init_distributed(
            dist_backend=torch.distributed.get_backend(), dist_init_required=False
        )
        if _rules.nvme_paths(self.config):
            _runtime.check_async_io()
        # What deepspeed.checkpointing.checkpoint does in the user's model is DeepSpeed's module-wide setting.
        settings = _sections.activation_settings(self.deepspeed_config())
        _runtime.configure_activation_checkpointing(self._deepspeed, settings)

    # model -----------------------------------------------------------------------------------------
    @hookimpl
    def model_init_context(self, empty_init: bool) -> ContextManager[None]:
        if self.zero_stage != 3:
            return Strategy.model_init_context(self, empty_init)
        # zero.Init (the sharded context) partitions each layer as it is built, so there is nothing to gain
        # from the meta device, which it cannot partition.
        stack = contextlib.ExitStack()
        stack.enter_context(self.device)
        stack.enter_context(default_dtype(param_dtype(self.precision)))
        return stack

    @hookimpl
    def model_sharded_context(self) -> ContextManager[None]:
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        # No dtype argument: the config's precision section decides it (DeepSpeed 0.19 reads an explicit
        # dtype as bf16 on CPUs without fp16 support).
        # With offloaded parameters the config's offload device wins inside zero.Init; remote_device matters
        # without (the rules refuse the two disagreeing).
        return self._deepspeed.zero.Init(
            config_dict_or_path=self.deepspeed_config(), remote_device=self.config.remote_device
        )

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, DeepSpeedModule):
            raise ConfigurationError(
                "wrap_model: the model is wrapped already; pass the plain module to setup()."
            )
        if not any(hasattr(p, "ds_id") for p in model.parameters()):
            model = Strategy.wrap_model(self, model)
        return DeepSpeedModule(model, evaluation_engine=self._evaluation_engine)

    def _evaluation_engine(self, wrapper: DeepSpeedModule) -> Any:
        """An engine without optimizer, for a ZeRO-3 model set up only to evaluate: DeepSpeed gathers each
        layer's partitions around its forward, as in training."""
        config = {k: v for k, v in self.deepspeed_config(wrapper.module).items() if k not in _TRAINING_ONLY}
        engine, *_ = self._deepspeed.initialize(model=wrapper.module, config=config, dist_init_required=False)
        wrapper.__dict__["engine"] = engine
        wrapper.__dict__["evaluation_only"] = True
        self._engines.append(engine)
        return engine

    def _release(self, engine: Any) -> None:
        """Destroy an engine (its hooks on the module go with it)."""
        with contextlib.suppress(Exception):
            engine.destroy()
        self._engines = [e for e in self._engines if e is not engine]

    @hookimpl
    def forward_context(self) -> ContextManager[None]:
        # DeepSpeed's bf16/fp16 modes cast the parameters themselves; autocast only for nothing else.
        return contextlib.nullcontext()

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def setup_optimizers(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
        wrapper = _wrapper(model)
        if wrapper.__dict__["evaluation_only"]:
            # Evaluated before training (Trainer.validate/test/predict, then fit): the training engine replaces
            # the engine without optimizer.
            self._release(wrapper.__dict__["engine"])
            wrapper.__dict__["engine"], wrapper.__dict__["evaluation_only"] = None, False
        if wrapper.__dict__["engine"] is not None:
            raise ConfigurationError(
                "This model has its DeepSpeed engine already; set up its optimizer once."
            )
        if any(isinstance(optimizer, DeepSpeedOptimizer) for optimizer in optimizers):
            raise ConfigurationError(
                "setup_optimizers: pass the torch optimizer, not the one setup returned."
            )
        from_config = _optimizers.check_choice(self.config, optimizers)
        if from_config:
            # DeepSpeed builds the config's optimizer (and scheduler) over these parameters.
            params = _optimizers.trainable(wrapper.module)
            groups, client = [params], None
        else:
            client = optimizers[0]
            params, groups = None, [list(group["params"]) for group in client.param_groups]
        engine, *_ = self._deepspeed.initialize(
            model=wrapper.module,
            optimizer=client,
            model_parameters=params,
            config=self.deepspeed_config(wrapper.module),
            dist_init_required=False,
        )
        wrapper.__dict__["engine"] = engine
        self._engines.append(engine)
        return [DeepSpeedOptimizer(engine, client if client is not None else engine.basic_optimizer, groups)]

    @property
    def provides_optimizer(self) -> bool:
        """True when the DeepSpeed config has an ``optimizer`` section: the Trainer then trains a module without
        ``configure_optimizers`` (and ``Engine.setup_optimizers(model)`` takes none) with DeepSpeed's."""
        return self.config.config_optimizer is not None

    @hookimpl
    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        _engine(model).backward(loss)

    @hookimpl
    def optimizer_step(self, optimizer: Any, model: torch.nn.Module) -> None:
        engine = _engine(model)
        try:
            engine.step()
        finally:
            restore = self._clip_restore.pop(id(engine), None)
            if restore is not None:
                engine.optimizer.clip_grad = restore

    @hookimpl
    def clip_gradients(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        engine = _engine(model)
        if not _runtime.zero_stage(engine):
            params = [p for p in engine.module.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        zero = engine.optimizer
        self._clip_restore.setdefault(id(engine), zero.clip_grad)
        zero.clip_grad = float(max_norm)
        return torch.tensor(_runtime.global_grad_norm(engine))

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        engine = _wrapper(model).__dict__["engine"]
        return contextlib.nullcontext() if engine is None else _not_a_boundary(engine)

    # memory ----------------------------------------------------------------------------------------
    def memory_held(self, model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
        """Bytes this rank holds, counted from DeepSpeed's own buffers (``stratagem_deepspeed._memory``): its
        flat parameter buffers or partitions, its gradient partitions, the fp32 master weights with the
        optimizer's state. Before ``setup_optimizers``, the module's tensors as any strategy counts them."""
        from stratagem.strategies.memory import buffer_bytes
        from stratagem_deepspeed import _memory

        wrapper = _wrapper(model)
        engine = wrapper.__dict__["engine"]
        if engine is None or not _runtime.zero_stage(engine):
            return Strategy.memory_held(self, model, optimizer)
        zero = engine.optimizer
        return {
            "parameters": _memory.parameter_bytes(wrapper.module, zero),
            "buffers": buffer_bytes(wrapper.module),
            "gradients": _memory.gradient_bytes(wrapper.module, zero),
            "optimizer": _memory.optimizer_bytes(zero),
        }

    @hookimpl
    def estimate_memory(self, model: torch.nn.Module, world: Any) -> Any:
        # DeepSpeed's engine needs a real process group and devices (LOCAL_RANK, its accelerator): the plan
        # cannot simulate it, so it estimates from the shapes by ZeRO's rules.
        from stratagem_deepspeed import _memory

        numel = sum(p.numel() for p in model.parameters())
        return _memory.estimate(self.config.deepspeed_config(world.precision, "cpu", numel), model, world)

    # checkpoint ------------------------------------------------------------------------------------
    @hookimpl
    def save_checkpoint(self, path: str, state: dict[str, Any], format: str) -> None:
        from stratagem_deepspeed import _checkpoint

        if format == "sharded":
            _checkpoint.save_sharded(self, path, state)
        else:
            Strategy.save_checkpoint(self, path, state, format)

    @hookimpl
    def load_checkpoint(self, path: str, state: dict[str, Any], strict: bool) -> dict[str, Any]:
        from stratagem_deepspeed import _checkpoint

        if _checkpoint.is_deepspeed_checkpoint(path):
            return _checkpoint.load_sharded(self, path, state, strict)
        return Strategy.load_checkpoint(self, path, state, strict)

    @hookimpl
    def weight_shards(self, model: torch.nn.Module, purpose: str) -> list[Any]:
        from stratagem_deepspeed import _hf

        return _hf.weight_shards(model, purpose)

    # Whole state on every rank for either format: DeepSpeed's partitions are not DTensors, so a sharded
    # stratagem checkpoint of another strategy loads here through whole tensors (DCP reads each rank's copy).
    def module_state_dict(self, module: torch.nn.Module, *, full: bool) -> dict[str, Any]:
        wrapper = _wrapper(module)
        return _state.full_module_state(wrapper.module, wrapper.__dict__["engine"])

    def optimizer_state_dict(self, module: torch.nn.Module, optimizer: Any, *, full: bool) -> dict[str, Any]:
        wrapper = _wrapper(module)
        engine = _optimizer_engine(optimizer)
        return _state.full_optimizer_state(engine, _named_groups(wrapper, optimizer))

    def load_module_state_dict(
        self, module: torch.nn.Module, state_dict: dict[str, Any], *, full: bool, strict: bool
    ) -> Any:
        wrapper = _wrapper(module)
        _state.load_full_module_state(wrapper.module, state_dict, wrapper.__dict__["engine"], strict)

    def load_optimizer_state_dict(
        self, module: torch.nn.Module, optimizer: Any, state_dict: dict[str, Any], *, full: bool
    ) -> None:
        wrapper = _wrapper(module)
        _state.load_full_optimizer_state(
            _optimizer_engine(optimizer), _named_groups(wrapper, optimizer), state_dict
        )

    @staticmethod
    def consolidate(source: str | os.PathLike[str], output: str | os.PathLike[str]) -> Any:
        """Write a DeepSpeed-format checkpoint directory as one full stratagem checkpoint (offline).

        ``stratagem checkpoint consolidate`` calls this for directories whose ``stratagem.json`` names the
        ``deepspeed`` layout. See :func:`stratagem_deepspeed.consolidate`.
        """
        from stratagem_deepspeed._offline import consolidate

        return consolidate(source, output)

    @staticmethod
    def module_weights(source: str | os.PathLike[str], key: str = "model") -> dict[str, torch.Tensor]:
        """The whole weights of module ``key`` of a DeepSpeed-format checkpoint directory, read offline
        (``Module.load_from_checkpoint`` calls this for directories that name the ``deepspeed`` layout)."""
        from stratagem_deepspeed._offline import module_weights

        return module_weights(source, key)

    # teardown --------------------------------------------------------------------------------------
    @hookimpl
    def teardown(self) -> None:
        import gc

        # DeepSpeed's engines hold communication state and, with its CPU Adam, a native thread pool that
        # aborts the process if it is still alive at interpreter exit: release them before the group.
        for engine in self._engines:
            with contextlib.suppress(Exception):
                engine.destroy()
        self._engines.clear()
        gc.collect()
        TorchDistributedStrategy.teardown(self)
        if not torch.distributed.is_initialized():
            _forget_groups()


# -------------------------------------------------------------------------------------------------
# helpers
# -------------------------------------------------------------------------------------------------


def _forget_groups() -> None:
    """Drop the process groups DeepSpeed keeps in module globals once the group they came from is destroyed:
    the next Engine in this process (a loop that sets up again, the contract suite's shared launches) would
    otherwise hand DeepSpeed groups of a destroyed world ("Group ... is not registered")."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if not (name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS"))):
            continue
        if isinstance(value, dict):
            value.clear()
        elif isinstance(value, torch.distributed.ProcessGroup):
            setattr(groups, name, None)


def _named_groups(wrapper: DeepSpeedModule, optimizer: Any) -> list[list[tuple[str, Any]]]:
    names = {id(p): n for n, p in wrapper.module.named_parameters(remove_duplicate=False)}
    return [[(names[id(p)], p) for p in group["params"]] for group in optimizer.param_groups]


@contextlib.contextmanager
def _not_a_boundary(engine: Any):
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(True)

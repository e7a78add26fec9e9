"""``ddp``: every process holds a full replica; ``DistributedDataParallel`` all-reduces the gradients."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stratagem import hookimpl
from stratagem.errors import ConfigurationError
from stratagem.strategies.base import Strategy
from stratagem.strategies.compiling import Compiler
from stratagem.strategies.torch_distributed import TorchDistributedStrategy
from stratagem_ddp._config import DDPConfig
from stratagem_ddp._post_local_sgd import (
    AVERAGER_STEP_KEY,
    default_subgroup_on_cpu,
    unwrap,
    with_model_averaging,
)


class DDPStrategy(TorchDistributedStrategy):
    """Data parallelism with ``torch.nn.parallel.DistributedDataParallel``.

    Options keep the names Lightning users know (see :class:`~stratagem_ddp.DDPConfig` for each); any other
    keyword is passed to ``DistributedDataParallel`` after a check against its signature::

        DDPStrategy(static_graph=True, ddp_comm_hook="default.fp16_compress_hook", bucket_cap_mb=50)
    """

    def __init__(
        self,
        *,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        ddp_comm_hook: Callable[..., Any] | str | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Callable[..., Any] | str | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        self.config = DDPConfig(
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            ddp_kwargs=ddp_kwargs,
        )
        super().__init__(process_group_backend=self.config.process_group_backend, timeout=self.config.timeout)

    def __repr__(self) -> str:
        return f"DDPStrategy({self.config!r})"

    # model -----------------------------------------------------------------------------------------
    @hookimpl
    def wrap_model(self, model: torch.nn.Module, compiler: Compiler) -> torch.nn.Module:
        if isinstance(model, DistributedDataParallel):
            raise ConfigurationError(
                "wrap_model: the model is a DistributedDataParallel already; pass the plain module to setup()."
            )
        # Move and cast first: DDP builds its buckets from the parameters as they are when it wraps them.
        model = Strategy.wrap_model(self, model)
        if compiler.enabled:
            split_graphs_at_buckets()
        compiler(model)
        if self.config.post_local_sgd:
            default_subgroup_on_cpu(self.config.ddp_comm_state, self.device, self.cluster.local_world_size)
        wrapped = replicate(model, self.device, self.config)
        register_comm_hook(wrapped, self.config)
        return wrapped

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def setup_optimizers(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
        if not self.config.post_local_sgd:
            return optimizers
        return [
            with_model_averaging(opt, self.config.model_averaging_period, self.config.ddp_comm_state)
            for opt in optimizers
        ]

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    # checkpoint conversions ------------------------------------------------------------------------
    # Parameter names come from get_model_state_dict, which drops DDP's "module." prefix: a checkpoint
    # written here loads under single_device and the other way round.
    def optimizer_state_dict(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, full: bool
    ) -> dict[str, Any]:
        inner, averager = unwrap(optimizer)
        state = Strategy.optimizer_state_dict(self, module, inner, full=full)
        if averager is not None:
            state[AVERAGER_STEP_KEY] = averager.step
        return state

    def load_optimizer_state_dict(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        *,
        full: bool,
    ) -> None:
        inner, averager = unwrap(optimizer)
        state_dict = dict(state_dict)
        step = state_dict.pop(AVERAGER_STEP_KEY, None)
        # Every rank holds a full replica, so the full state dict is also this rank's own: load it as such,
        # with no redistribution between ranks.
        Strategy.load_optimizer_state_dict(self, module, inner, state_dict, full=False)
        if averager is not None and step is not None:
            averager.step = int(step)


# -------------------------------------------------------------------------------------------------
# the steps of wrap_model
# -------------------------------------------------------------------------------------------------


def replicate(model: torch.nn.Module, device: torch.device, config: DDPConfig) -> DistributedDataParallel:
    """Wrap ``model`` (already on ``device``) in ``DistributedDataParallel`` over the default process group."""
    if not dist.is_initialized():
        raise ConfigurationError(
            "ddp needs a process group: set the model up through an Engine or Trainer (which joins it), "
            "or call torch.distributed.init_process_group first."
        )
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=device_ids, **config.ddp_arguments())


def split_graphs_at_buckets() -> None:
    """Have Dynamo cut each graph compiled inside DDP's forward at the gradient buckets' boundaries, so that a
    bucket's all-reduce starts while the backward of the graphs before it runs (torch's DDPOptimizer)."""
    import torch._dynamo

    torch._dynamo.config.optimize_ddp = "ddp_optimizer"


def register_comm_hook(model: DistributedDataParallel, config: DDPConfig) -> None:
    """Install the configured communication hook, wrapped by ``ddp_comm_wrapper`` if given."""
    if config.ddp_comm_hook is None:
        return
    hook = config.ddp_comm_hook
    if config.ddp_comm_wrapper is not None:
        hook = config.ddp_comm_wrapper(hook)
    model.register_comm_hook(state=config.ddp_comm_state, hook=hook)

"""The base of every strategy: a pluggy plugin whose methods implement the hooks of :mod:`stratagem.hookspecs`.

Every hook has a working single-process implementation here, so a subclass overrides only what differs.
An override must carry ``@hookimpl``: pluggy finds implementations by their marker and would otherwise keep
calling the base method without a word. :meth:`Strategy.__init_subclass__` refuses such a class when it is
defined, and checks the override's arguments against the spec.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from stratagem.hookspecs import hookimpl
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem.registry._hook_object import HookObject
from stratagem.strategies.precision import autocast, default_dtype, param_dtype


class Strategy(HookObject):
    """One process on one device. Subclasses override hooks, each with ``@hookimpl``.

    Besides the hooks, four plain methods convert state for checkpoints; a strategy whose modules or
    optimizers keep state their own way (a ZeRO optimizer) overrides them:
    :meth:`module_state_dict`, :meth:`optimizer_state_dict`, :meth:`load_module_state_dict`,
    :meth:`load_optimizer_state_dict`. Such a strategy also overrides :meth:`memory_held`, which counts what a
    rank holds (the plan and the contract suite read it).
    """

    plugin_kind = "strategy"

    #: The name the registry created this strategy under (empty for an instance built by hand).
    registered_name: str = ""
    #: The format ``Engine.save`` writes when none is given (``"full"`` or ``"sharded"``).
    checkpoint_format: str = "full"
    #: True when the strategy's own configuration defines the optimizer: ``setup_optimizers`` then takes an
    #: empty list and returns it, and ``Trainer.fit`` accepts a module whose ``configure_optimizers`` gives none.
    provides_optimizer: bool = False
    #: True when the strategy runs forward and backward itself (``run_training_batch`` returns a result, as a
    #: pipeline's does): the Trainer then needs the module's loss (``compute_loss`` or ``loss_fn``) rather than a
    #: ``training_step``, and checks for it before anything launches.
    owns_step: bool = False

    def __init__(self) -> None:
        self.cluster = ClusterEnvironment()
        self.precision = "32-true"
        self.scaler: Any = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.cluster.device)

    @property
    def rank(self) -> int:
        return self.cluster.rank

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.cluster.rank == 0

    # environment ----------------------------------------------------------------------------------
    @hookimpl
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        self.cluster = cluster
        self.precision = precision
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if precision == "16-mixed":
            self.scaler = torch.amp.GradScaler(self.device.type)

    # model -----------------------------------------------------------------------------------------
    @hookimpl
    def model_init_context(self, empty_init: bool) -> ContextManager[None]:
        stack = contextlib.ExitStack()
        # Meta tensors cost nothing; wrap_model materialises them on the device and re-initialises them.
        stack.enter_context(torch.device("meta") if empty_init else self.device)
        stack.enter_context(default_dtype(param_dtype(self.precision)))
        return stack

    @hookimpl
    def model_sharded_context(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from stratagem.strategies.wrapping import materialize_meta

        materialize_meta(model, self.device)
        model = model.to(self.device)
        dtype = param_dtype(self.precision)
        return model.to(dtype) if dtype is not None else model

    @hookimpl
    def forward_context(self) -> ContextManager[None]:
        return autocast(self.precision, self.device.type)

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def setup_optimizers(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
        return optimizers

    @hookimpl
    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    @hookimpl
    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    @hookimpl
    def clip_gradients(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # Sharded parameters (DTensor) give a sharded norm; callers want the plain number.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        return contextlib.nullcontext()

    # step ------------------------------------------------------------------------------------------
    # The loops run forward and backward themselves: nothing to check, nothing run here.
    @hookimpl
    def check_batch_size(self, batch_size: int) -> None:
        return None

    @hookimpl
    def run_training_batch(self, model: torch.nn.Module, batch: Any, batch_idx: int) -> Any:
        return None

    @hookimpl
    def run_evaluation_batch(self, model: torch.nn.Module, batch: Any, batch_idx: int, stage: str) -> Any:
        return None

    # data ------------------------------------------------------------------------------------------
    @hookimpl
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.rank}

    # checkpoint ------------------------------------------------------------------------------------
    @hookimpl
    def save_checkpoint(self, path: str, state: dict[str, Any], format: str) -> None:
        from stratagem.checkpoint import _save

        _save.save(self, path, state, format)

    @hookimpl
    def load_checkpoint(self, path: str, state: dict[str, Any], strict: bool) -> dict[str, Any]:
        from stratagem.checkpoint import _load

        return _load.load(self, path, state, strict)

    @hookimpl
    def weight_shards(self, model: torch.nn.Module, purpose: str) -> list[Any]:
        from stratagem.checkpoint._hf_shards import check_live, from_state_dict

        shards = from_state_dict(self.module_state_dict(model, full=False))
        if purpose == "load":
            check_live(shards, model, type(self).__name__)
        return shards

    def module_state_dict(self, module: torch.nn.Module, *, full: bool) -> dict[str, Any]:
        """The module's state: gathered plain tensors on rank 0 (``full``; other ranks may return ``{}``),
        or this rank's shards as DTensors (sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=full))

    def optimizer_state_dict(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, full: bool
    ) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, so it loads under any strategy."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            module, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
        )

    def load_module_state_dict(
        self, module: torch.nn.Module, state_dict: dict[str, Any], *, full: bool, strict: bool
    ) -> Any:
        """Fill ``module`` from a state dict as :meth:`module_state_dict` returns it (``full``: on every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(
            module, state_dict, options=StateDictOptions(full_state_dict=full, strict=strict)
        )

    def load_optimizer_state_dict(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        *,
        full: bool,
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if full and not any(
            isinstance(v, torch.Tensor) and v.dim() > 0
            for per_param in (state_dict.get("state") or {}).values()
            for v in (per_param.values() if isinstance(per_param, dict) else ())
        ):
            # torch redistributes a full state dict by the device of the optimizer's tensors and fails when
            # there are none (SGD without momentum); without tensors there is nothing to redistribute.
            full = False
        set_optimizer_state_dict(
            module, optimizer, state_dict, options=StateDictOptions(full_state_dict=full)
        )

    def memory_held(self, model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
        """Bytes this rank holds now: ``{"parameters", "buffers", "gradients", "optimizer"}``, counted from its
        tensors (a sharded tensor's local part). ``model`` is what :meth:`wrap_model` returned, ``optimizer``
        what :meth:`setup_optimizers` returned."""
        from stratagem.strategies.memory import counts

        return counts(model, optimizer)

    # collectives -----------------------------------------------------------------------------------
    @hookimpl
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        _check_op(op)
        return tensor.clone()

    @hookimpl
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone()]

    @hookimpl
    def broadcast(self, obj: Any, src: int) -> Any:
        return obj

    @hookimpl
    def barrier(self, name: str | None) -> None:
        return None

    # teardown --------------------------------------------------------------------------------------
    @hookimpl
    def teardown(self) -> None:
        return None

    # planning --------------------------------------------------------------------------------------
    # None: the plan simulates the strategy through its own hooks (see stratagem.planning).
    @hookimpl
    def estimate_memory(self, model: torch.nn.Module, world: Any) -> Any:
        return None


REDUCE_OPS = ("sum", "mean", "max", "min")


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce(op={op!r}): use one of {', '.join(REDUCE_OPS)}.")

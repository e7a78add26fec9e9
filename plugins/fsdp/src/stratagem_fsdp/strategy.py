"""``fsdp``, ``fsdp_cpu_offload`` and ``hsdp``: FSDP2 (``fully_shard`` over a ``DeviceMesh``) as a strategy."""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from stratagem import hookimpl
from stratagem.errors import ConfigurationError
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem.strategies.base import Strategy
from stratagem.strategies.compiling import Compiler
from stratagem.strategies.precision import param_dtype
from stratagem.strategies.torch_distributed import TorchDistributedStrategy
from stratagem.strategies.wrapping import has_meta_tensors, wrapping_with
from stratagem_fsdp import _init, _mesh, _wrap
from stratagem_fsdp._config import NO_LONGER_APPLY, FSDPConfig

warn_once = _wrap.warn_once


class FSDPStrategy(TorchDistributedStrategy):
    """Fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    Options keep the names of the seeds (see :class:`~stratagem_fsdp.FSDPConfig` for each)::

        FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
                     sharding_strategy="SHARD_GRAD_OP", state_dict_type="sharded")

    FSDP1 options are accepted too: ``forward_prefetch`` and ``backward_prefetch`` map to FSDP2's explicit
    prefetching; ``limit_all_gathers`` and ``use_orig_params`` no longer apply and say so once.
    """

    def __init__(
        self,
        *,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        cpu_offload: Any = False,
        mixed_precision: Any = None,
        state_dict_type: str = "full",
        reshard_after_forward: bool | int | None = None,
        replicate_size: int | None = None,
        shard_size: int | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float | None = None,
        **fsdp_options: Any,
    ) -> None:
        self.config = FSDPConfig.from_options(
            dict(
                auto_wrap_policy=auto_wrap_policy,
                activation_checkpointing_policy=activation_checkpointing_policy,
                sharding_strategy=sharding_strategy,
                cpu_offload=cpu_offload,
                mixed_precision=mixed_precision,
                state_dict_type=state_dict_type,
                reshard_after_forward=reshard_after_forward,
                replicate_size=replicate_size,
                shard_size=shard_size,
                process_group_backend=process_group_backend,
                timeout=timeout,
                **fsdp_options,
            )
        )
        super().__init__(process_group_backend=self.config.process_group_backend, timeout=self.config.timeout)
        self.plan: _mesh.ShardPlan | None = None
        self._device_mesh: Any = None
        self._init_random_state: dict[str, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"FSDPStrategy({self.config!r})"

    @property
    def checkpoint_format(self) -> str:  # type: ignore[override]
        return self.config.state_dict_type

    # environment ----------------------------------------------------------------------------------
    @hookimpl
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        TorchDistributedStrategy.setup_environment(self, cluster, precision)
        self.plan = _mesh.plan(self.config, cluster)
        if precision == "16-mixed":
            # Each rank sees only its shard of the gradients: the inf/nan check must agree across ranks.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type)
        self._explain_choices()

    def _explain_choices(self) -> None:
        """The one-time messages about options that mean something else (or nothing) here."""
        notes = [self.plan.note] if self.plan is not None and self.plan.note else []
        if self.config.cpu_offload is not False and self.device.type != "cuda":
            notes.append(
                "cpu_offload: with accelerator='cpu' the parameters, gradients and optimizer state live in host "
                "memory already, so this trains as fsdp without an offload policy (FSDP2's CPUOffloadPolicy "
                "needs an accelerator to move them to and from)."
            )
        for name, value in self.config.legacy_options.items():
            notes.append(f"{name}={value!r} no longer applies: {NO_LONGER_APPLY[name]}.")
        if self.config.backward_prefetch == "BACKWARD_POST":
            notes.append(
                "backward_prefetch='BACKWARD_POST' has no FSDP2 equivalent: FSDP2 starts the previous unit's "
                "all-gather before computing the current unit's gradients, which is BACKWARD_PRE; using that."
            )
        for note in notes:
            warn_once(note, self.is_global_zero)

    # model -----------------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The mesh every unit is sharded over (built on first use, after the process group exists)."""
        if self._device_mesh is None:
            if self.plan is None or not dist.is_initialized():
                raise ConfigurationError(
                    "FSDP needs a process group: set the model up through an Engine or Trainer (which joins it)."
                )
            self._device_mesh = _mesh.build_mesh(self.plan, self.device.type)
        return self._device_mesh

    def shard_kwargs(self) -> dict[str, Any]:
        """The ``fully_shard`` arguments every unit shares (mesh, precision, offload)."""
        return {
            "mesh": self.device_mesh,
            "mp_policy": self.mixed_precision(),
            "offload_policy": self.offload(),
        }

    def mixed_precision(self) -> MixedPrecisionPolicy:
        return _wrap.mixed_precision(self.precision, self.config.mixed_precision)

    def offload(self) -> OffloadPolicy:
        if self.config.cpu_offload is False or self.device.type != "cuda":
            return OffloadPolicy()
        if isinstance(self.config.cpu_offload, CPUOffloadPolicy):
            return self.config.cpu_offload
        return CPUOffloadPolicy(pin_memory=True)

    @hookimpl
    def model_init_context(self, empty_init: bool) -> ContextManager[None]:
        if empty_init:
            # The random state of the moment the model is "built": materialising draws from it, so the values
            # equal an eager build from the same seed. Rank 0's, so that every rank slices the same tensors.
            self._init_random_state = self.broadcast(_init.random_state(self.device), 0)
        return Strategy.model_init_context(self, empty_init)

    @hookimpl
    def model_sharded_context(self) -> ContextManager[None]:
        # torch's own `torch.distributed.fsdp.wrap.wrap` (the seeds' import) shards just as stratagem.wrap does.
        return wrapping_with(self._wrap_submodule, torch_wrap_options="FSDPStrategy")

    def _wrap_submodule(self, module: Any) -> Any:
        if not isinstance(module, torch.nn.Module):
            raise ConfigurationError(f"stratagem.wrap({module!r}): give a torch.nn.Module.")
        if _wrap.is_sharded(module):
            return module
        assert self.plan is not None
        fully_shard(module, **self.shard_kwargs(), reshard_after_forward=self.plan.unit_reshard)
        return module

    @hookimpl
    def wrap_model(self, model: torch.nn.Module, compiler: Compiler) -> torch.nn.Module:
        assert self.plan is not None, "setup_environment runs before wrap_model"
        if not _wrap.is_sharded(model):
            model = self._shard(model, compiler)
        else:
            compiler(model)  # sharded by hand already (stratagem.wrap of the root): hooks stay outside
        if has_meta_tensors(model):
            state = self._init_random_state or self.broadcast(_init.random_state(self.device), 0)
            _init.materialize_sharded(model, self.device, state)
        return model

    def _shard(self, model: torch.nn.Module, compiler: Compiler | None = None) -> torch.nn.Module:
        """The fixed order of FSDP2 wrapping; each step is a function of ``_wrap``."""
        assert self.plan is not None
        dtype = param_dtype(self.precision)
        if dtype is not None:
            model = model.to(dtype)  # bf16-true: the shards (and the optimizer) hold the low precision
        kwargs = self.shard_kwargs()
        auto_wrap = self.config.auto_wrap_policy
        if auto_wrap is not None and _wrap.has_sharded_submodule(model):
            warn_once(
                "auto_wrap_policy is ignored: the model has submodules sharded with stratagem.wrap() already.",
                self.is_global_zero,
            )
            auto_wrap = None
        # 1. Activation checkpointing before sharding, so that a checkpointed block and its shard unit coincide.
        _wrap.checkpoint_activations(model, self.config.activation_checkpointing_policy)
        # 2. Compile (each repeated block, with its checkpointing inside), before the units: FSDP's hooks then
        # gather and free parameters around the compiled code, never inside it.
        if compiler is not None:
            compiler(model)
        # 3. One unit per selected module, innermost first: a unit's all-gather covers only its own block.
        _wrap.shard_units(_wrap.select_units(model, auto_wrap), kwargs, self.plan.unit_reshard)
        # 4. The root last: it claims every parameter left outside the units.
        model = _wrap.shard_root(model, kwargs, self.plan.root_reshard)
        # 5. Explicit prefetch between units (FSDP1's forward_prefetch / backward_prefetch).
        _wrap.set_prefetch(model, self.config.forward_prefetch, self.config.backward_prefetch)
        return model

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        if not _wrap.is_sharded(model):
            return contextlib.nullcontext()
        return _wrap.without_gradient_sync(model)

    # Hugging Face weights -------------------------------------------------------------------------------
    @hookimpl
    def weight_shards(self, model: torch.nn.Module, purpose: str) -> list[Any]:
        # Sharded in place: the model's own state dict holds the live shards under its names, without the
        # base's get_model_state_dict pass (a sixth of a load's time outside the reads).
        from stratagem.checkpoint.hf import in_place_shards

        return in_place_shards(model, purpose, type(self).__name__)

    # teardown --------------------------------------------------------------------------------------
    @hookimpl
    def teardown(self) -> None:
        self._device_mesh = None
        TorchDistributedStrategy.teardown(self)

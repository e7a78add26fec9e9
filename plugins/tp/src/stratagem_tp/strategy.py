"""``tp`` and ``fsdp_tp``: tensor parallelism over a ``DeviceMesh``, alone or under FSDP2 on a 2-D mesh.

``wrap_model`` applies, in this order (torchtitan's): the tensor-parallel plan on the ``tp`` dimension
(``parallelize_module``), activation checkpointing, compile (when the run asks for it), then for ``fsdp_tp``
``fully_shard`` over the ``dp`` dimension (units innermost first, the root last), and finally materialisation
of a model built on the meta device. Each step lives in its own function.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from stratagem import hookimpl
from stratagem.errors import ConfigurationError
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem.strategies.base import Strategy
from stratagem.strategies.compiling import Compiler
from stratagem.strategies.precision import param_dtype
from stratagem.strategies.torch_distributed import TorchDistributedStrategy
from stratagem.strategies.wrapping import has_meta_tensors, wrapping_with
from stratagem_fsdp import _init, _wrap
from stratagem_tp import _config, _plan


class TPStrategy(TorchDistributedStrategy):
    """Tensor parallelism over every process (a 1-D mesh named ``tp``); every rank sees the same batch.

    ::

        TPStrategy(plan={"blocks.*.attn.qkv": "colwise", "blocks.*.attn.out": "rowwise"})
        TPStrategy(plan=my_parallelize)          # my_parallelize(model, tp_mesh) applies TP itself

    Without ``plan=`` the model's ``tp_plan`` attribute is used (Hugging Face models carry one); without either
    the model is replicated on every rank (a warning says so). Modules no entry matches stay replicated.
    """

    #: ``fsdp_tp`` adds a data-parallel dimension.
    two_dimensional = False
    _options_name = "TPStrategy"

    def __init__(
        self,
        *,
        plan: Any = None,
        parallelize: Any = None,
        tensor_parallel_size: int | None = None,
        tp_size: int | None = None,
        state_dict_type: str = "sharded",
        activation_checkpointing_policy: Any = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float | None = None,
        **fsdp_options: Any,
    ) -> None:
        if plan is not None and parallelize is not None:
            raise ConfigurationError(
                f"{self._options_name}: give plan= or parallelize=, not both (parallelize is a callable plan)."
            )
        if tp_size is not None:
            # The mesh dimension's name, as other frameworks spell it: fsdp_tp[tp_size=2].
            if tensor_parallel_size not in (None, tp_size):
                raise ConfigurationError(
                    f"{self._options_name}: tp_size={tp_size!r} and tensor_parallel_size={tensor_parallel_size!r} "
                    "disagree; tp_size is another name for tensor_parallel_size: give one of them."
                )
            tensor_parallel_size = tp_size
        if not self.two_dimensional and fsdp_options:
            given = sorted(fsdp_options)
            known = [o for o in given if o in _config.FSDP_ONLY]
            raise ConfigurationError(
                f"TPStrategy got {given}: "
                + (
                    f"{known} apply to the FSDP dimension of 'fsdp_tp' only. "
                    if known
                    else "unknown options. "
                )
                + "Accepted: plan, parallelize, tensor_parallel_size (or tp_size), state_dict_type, "
                "activation_checkpointing_policy, process_group_backend, timeout."
            )
        unknown = sorted(set(fsdp_options) - set(_config.FSDP_ONLY))
        if unknown:
            raise ConfigurationError(
                f"FSDPTPStrategy got unknown options {unknown}. Accepted: plan, parallelize, tensor_parallel_size "
                f"(or tp_size), state_dict_type, activation_checkpointing_policy, {', '.join(_config.FSDP_ONLY)}, "
                "process_group_backend, timeout."
            )
        self.config = _config.TPConfig(
            plan=plan if plan is not None else parallelize,
            tensor_parallel_size=tensor_parallel_size,
            state_dict_type=state_dict_type,
            activation_checkpointing_policy=activation_checkpointing_policy,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **fsdp_options,
        )
        super().__init__(process_group_backend=process_group_backend, timeout=self.config.timeout)
        self.sizes: tuple[int, int] | None = None
        self._device_mesh: Any = None
        self._init_random_state: dict[str, torch.Tensor] | None = None
        self._marked_units: list[torch.nn.Module] = []
        #: What wrap_model applied last (for users and tests): the plan's source and module -> style name.
        self.applied_plan: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    @property
    def checkpoint_format(self) -> str:  # type: ignore[override]
        return self.config.state_dict_type

    # environment ----------------------------------------------------------------------------------
    @hookimpl
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        # Checked before joining the group: a size that cannot work fails every rank the same way, at once.
        self.sizes = _config.mesh_shape(
            self.config, cluster.world_size, cluster.num_nodes, self.two_dimensional
        )
        TorchDistributedStrategy.setup_environment(self, cluster, precision)

    @property
    def data_parallel_size(self) -> int:
        return self._sizes()[0]

    @property
    def tensor_parallel_size(self) -> int:
        return self._sizes()[1]

    def _sizes(self) -> tuple[int, int]:
        if self.sizes is None:
            raise ConfigurationError(
                f"{self._options_name}: the mesh exists once the process group does; set the model up through "
                "an Engine or Trainer (which joins it) first."
            )
        return self.sizes

    @property
    def device_mesh(self) -> Any:
        """The strategy's mesh: 1-D ``("tp",)`` for ``tp``, 2-D ``("dp", "tp")`` for ``fsdp_tp``; built on
        first use (after the process group exists). ``engine.device_mesh`` is this object."""
        if self._device_mesh is None:
            dp, tp = self._sizes()
            if not dist.is_initialized():
                raise ConfigurationError(f"{self._options_name}: no process group; use an Engine or Trainer.")
            from torch.distributed.device_mesh import init_device_mesh

            if self.two_dimensional:
                self._device_mesh = init_device_mesh(self.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
            else:
                self._device_mesh = init_device_mesh(self.device.type, (tp,), mesh_dim_names=("tp",))
        return self._device_mesh

    @property
    def tp_mesh(self) -> Any:
        """The 1-D tensor-parallel mesh (what plans and ``parallelize`` callables receive)."""
        return self.device_mesh["tp"] if self.two_dimensional else self.device_mesh

    # model -----------------------------------------------------------------------------------------
    @hookimpl
    def model_init_context(self, empty_init: bool) -> ContextManager[None]:
        if empty_init:
            # Rank 0's random state at build time: materialising draws from it, as one eager process would.
            self._init_random_state = self.broadcast(_init.random_state(self.device), 0)
        return Strategy.model_init_context(self, empty_init)

    @hookimpl
    def model_sharded_context(self) -> ContextManager[None]:
        # stratagem.wrap(module) marks an FSDP unit; sharding waits for wrap_model, after the TP plan.
        if not self.two_dimensional:
            return contextlib.nullcontext()
        # torch's own `torch.distributed.fsdp.wrap.wrap` (the seeds' import) marks a unit too.
        return wrapping_with(self._mark_unit, torch_wrap_options="FSDPTPStrategy")

    def _mark_unit(self, module: Any) -> Any:
        if not isinstance(module, torch.nn.Module):
            raise ConfigurationError(f"stratagem.wrap({module!r}): give a torch.nn.Module.")
        if all(module is not m for m in self._marked_units):
            self._marked_units.append(module)
        return module

    @hookimpl
    def wrap_model(self, model: torch.nn.Module, compiler: Compiler) -> torch.nn.Module:
        if _wrap.is_sharded(model):
            compiler(model)
            return model
        deferred = has_meta_tensors(model)
        dtype = param_dtype(self.precision)
        if not deferred:
            model = model.to(self.device)
        if dtype is not None:
            model = model.to(dtype)  # bf16-true: shards and optimizer state in the low precision
        # 1. Tensor parallelism on the tp dimension, before anything wraps the modules.
        self.apply_tensor_parallel(model, deferred)
        # 2. Activation checkpointing, so that a checkpointed block and its FSDP unit coincide.
        _wrap.checkpoint_activations(model, self.config.activation_checkpointing_policy)
        # 3. Compile: each block traced with its tensor-parallel layers and its recomputation inside, and FSDP's
        # hooks outside.
        compiler(model)
        # 4. FSDP over the dp dimension (fsdp_tp only).
        model = self.shard_data_parallel(model)
        # 5. Allocate and initialise what was built on the meta device, as one eager process would.
        if deferred:
            state = self._init_random_state or self.broadcast(_init.random_state(self.device), 0)
            _init.materialize_sharded(model, self.device, state)
        return model

    def apply_tensor_parallel(self, model: torch.nn.Module, deferred: bool = False) -> _plan.ResolvedPlan:
        """Find the plan, check it (globs, styles, heads), and apply it with ``parallelize_module``."""
        from torch.distributed.tensor.parallel import parallelize_module

        if any(isinstance(p, DTensor) for p in model.parameters()):
            # Split by hand already (in configure_model, with engine.device_mesh): leave it as it is.
            self.applied_plan = {"source": "model (parallelized before setup)", "styles": {}}
            return _plan.ResolvedPlan(source="model")
        source, raw = _plan.find(self.config.plan, model)
        plan = _plan.resolve(source, raw, model)
        if plan.callable is not None:
            result = plan.callable(model, self.tp_mesh)
            if result is not None and result is not model:
                raise ConfigurationError(
                    "parallelize(model, mesh) returned a different object; it must change the model in place "
                    "(parallelize_module does) and return it or None."
                )
        elif plan.source == "none":
            warn_once(
                "the model has no tensor-parallel plan (no plan= option, no tp_plan attribute): every parameter "
                "is replicated over the tp dimension. Give plan={'glob': 'colwise' | 'rowwise' | ...}.",
                self.is_global_zero,
            )
        else:
            _plan.check_heads(model, plan, self.tensor_parallel_size)
            styles = {name: style for name, style in plan.styles.items() if style is not None}
            if styles:
                # src_data_rank=0: every rank keeps rank 0's values (one-process semantics); meta tensors have
                # no values, and are initialised after materialising.
                parallelize_module(model, self.tp_mesh, styles, src_data_rank=None if deferred else 0)
        self.applied_plan = {
            "source": plan.source,
            "styles": {n: type(s).__name__ if s is not None else "replicate" for n, s in plan.styles.items()},
        }
        return plan

    def shard_data_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    # data ------------------------------------------------------------------------------------------
    @hookimpl
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Ranks of one tp group must see the same samples: the sampler spans the dp dimension only.
        dp, tp = self._sizes()
        return {"num_replicas": dp, "rank": self.rank // tp}

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def clip_gradients(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """The 2-norm over every gradient, whatever mesh (or none) each lives on, then scale them all."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = global_norm(grads)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if float(coefficient) < 1.0:
            with torch.no_grad():
                for grad in grads:
                    grad.mul_(float(coefficient))
        return total

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
        self._marked_units = []
        TorchDistributedStrategy.teardown(self)


class FSDPTPStrategy(TPStrategy):
    """FSDP2 over the data-parallel dimension x tensor parallelism over the other: a 2-D mesh ``("dp", "tp")``.

    ::

        FSDPTPStrategy(plan={...}, tensor_parallel_size=2, auto_wrap_policy={Block},
                       activation_checkpointing_policy={Block}, reshard_after_forward=True)

    Rank ``r`` sits at ``(r // tp, r % tp)``: a tp group is ``tp`` consecutive ranks (one node by default).
    """

    two_dimensional = True
    _options_name = "FSDPTPStrategy"
    #: The contract suite certifies at 4 processes: the default on one node (1 x 4) and, with
    #: tensor_parallel_size=2, a mesh whose both dimensions are real (2 x 2). At 2 both would be 1 x 2.
    contract_world_size = 4

    def shard_data_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """``fully_shard`` on the dp mesh: marked (``stratagem.wrap``) and policy-selected units, then the root."""
        kwargs = {"mesh": self.device_mesh["dp"], "mp_policy": self.mixed_precision()}
        units = _wrap.select_units(model, self.config.auto_wrap_policy)
        wrapper_of = {id(getattr(m, "_checkpoint_wrapped_module", m)): m for m in model.modules()}
        for module in reversed(self._marked_units):
            module = wrapper_of.get(id(module), module)
            if module is not model and all(module is not u for u in units) and _wrap.contains(model, module):
                units.append(module)
        self._marked_units = []
        reshard = True if self.config.reshard_after_forward is None else self.config.reshard_after_forward
        _wrap.shard_units(units, kwargs, reshard)
        return _wrap.shard_root(model, kwargs, self.config.reshard_after_forward)

    def mixed_precision(self) -> Any:
        return _wrap.mixed_precision(self.precision, self.config.mixed_precision)

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        if not _wrap.is_sharded(model):
            return contextlib.nullcontext()
        return _wrap.without_gradient_sync(model)


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` as a plain tensor: grouped by mesh and placements (DTensors of different
    meshes cannot meet in one op), each group's norm made whole, then combined."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        key = (
            (id(grad.device_mesh), tuple(grad.placements))
            if isinstance(grad, DTensor)
            else ("plain", grad.device)
        )
        groups.setdefault(key, []).append(grad)
    if not groups:
        return torch.zeros(())
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def warn_once(message: str, show: bool) -> None:
    """Warn once per process, and only where ``show`` (rank 0)."""
    _wrap.warn_once(message, show, source="stratagem-tp")

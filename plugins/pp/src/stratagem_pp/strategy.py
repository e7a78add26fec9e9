"""``pp``, ``pp_fsdp`` and ``pp_fsdp_tp``: pipeline parallelism on ``torch.distributed.pipelining``, alone or
with FSDP2 and tensor parallelism on a mesh whose outermost dimension is the pipeline.

``wrap_model`` is a short orchestrator: split the model into stages (``_split``), build this rank's stage
views and prune the model to its own modules (``_stage``), then on each view apply tensor parallelism,
activation checkpointing, compile (``compile=``) and ``fully_shard`` (``_parallelize``), materialise a meta model as one process
would (``_materialize``), and set up the schedule (``_runtime``). It returns the pruned model: this rank's
parameters under their names in the whole model.

The strategy owns the step (``owns_step``): the core's step hooks (``run_training_batch``,
``run_evaluation_batch``) run a batch through :meth:`PPStrategy.train_step` (forward and backward of every
micro-batch inside the schedule) or :meth:`PPStrategy.eval_step` (forward only), with the module's
``split_batch`` and ``compute_loss``. The Trainer and ``Engine.train_batch`` reach them that way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from stratagem import hookimpl
from stratagem.errors import ConfigurationError
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem.strategies.base import Strategy
from stratagem.strategies.compiling import Compiler
from stratagem.strategies.step import StepOutput, as_inputs
from stratagem.strategies.torch_distributed import TorchDistributedStrategy
from stratagem.strategies.wrapping import has_meta_tensors
from stratagem_fsdp import _init, _wrap
from stratagem_pp import _config, _materialize, _parallelize, _schedules, _split, _stage, _state
from stratagem_pp._runtime import Pipeline, StepResult
from stratagem_tp.strategy import global_norm

_PIPELINE_OPTIONS = (
    "pipeline_parallel_size",
    "schedule",
    "microbatches",
    "stages_per_rank",
    "pp_plan",
    "activation_checkpointing_policy",
    "state_dict_type",
    "process_group_backend",
    "timeout",
)


class PPStrategy(TorchDistributedStrategy):
    """Pipeline parallelism over every process (a 1-D mesh named ``pp``)::

        PPStrategy(schedule="interleaved_1f1b", stages_per_rank=2, microbatches=8, pp_plan=["blocks.4"])

    See :class:`~stratagem_pp.PPConfig` for every option and ``_split`` for the plan's forms.
    """

    #: Mesh dimensions: 1 (pp), 2 (pp, dp), 3 (pp, dp, tp).
    dims = 1
    #: Forward and backward run inside the schedule: the loops hand batches to the step hooks.
    owns_step = True
    _options_name = "PPStrategy"

    def __init__(self, **options: Any) -> None:
        accepted = _PIPELINE_OPTIONS + (_config.FSDP_OPTIONS if self.dims >= 2 else ())
        accepted += _config.TP_OPTIONS if self.dims == 3 else ()
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            elsewhere = [o for o in unknown if o in _config.FSDP_OPTIONS + _config.TP_OPTIONS]
            raise ConfigurationError(
                f"{self._options_name} got unknown options {unknown}. "
                + (f"{elsewhere} belong to 'pp_fsdp' or 'pp_fsdp_tp'. " if elsewhere else "")
                + f"Accepted: {', '.join(accepted)}."
            )
        self.config = _config.PPConfig(**options)
        super().__init__(process_group_backend=self.config.process_group_backend, timeout=self.config.timeout)
        self.sizes: _config.MeshSizes | None = None
        self._device_mesh: Any = None
        self._init_random_state: dict[str, torch.Tensor] | None = None
        self.pipeline: Pipeline | None = None
        #: What wrap_model did (for users and tests): the split, this rank's stages, units, tp styles.
        self.applied: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    @property
    def checkpoint_format(self) -> str:  # type: ignore[override]
        return self.config.state_dict_type

    # environment ----------------------------------------------------------------------------------
    @hookimpl
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        # Checked before joining the group: every rank fails the same way, at once.
        sizes = _config.mesh_sizes(self.config, cluster.world_size, self.dims)
        _config.check_for_world(self.config, sizes)
        self.sizes = sizes
        TorchDistributedStrategy.setup_environment(self, cluster, precision)

    def _sizes(self) -> _config.MeshSizes:
        if self.sizes is None:
            raise ConfigurationError(
                f"{self._options_name}: the mesh exists once the process group does; set the model up through "
                "an Engine or Trainer (which joins it) first."
            )
        return self.sizes

    @property
    def device_mesh(self) -> Any:
        """``("pp",)``, ``("pp", "dp")`` or ``("pp", "dp", "tp")``, the pipeline outermost (built on first use)."""
        if self._device_mesh is None:
            sizes = self._sizes()
            if not dist.is_initialized():
                raise ConfigurationError(f"{self._options_name}: no process group; use an Engine or Trainer.")
            from torch.distributed.device_mesh import init_device_mesh

            shape, names = (sizes.pp, sizes.dp, sizes.tp)[: self.dims], ("pp", "dp", "tp")[: self.dims]
            self._device_mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._device_mesh

    @property
    def pp_rank(self) -> int:
        return self.device_mesh.get_local_rank("pp")

    @property
    def num_stages(self) -> int:
        return self._sizes().pp * self.config.resolved_stages_per_rank

    @property
    def microbatches(self) -> int:
        return _config.microbatches_for(self.config, self._sizes().pp)

    # model -----------------------------------------------------------------------------------------
    @hookimpl
    def model_init_context(self, empty_init: bool) -> ContextManager[None]:
        if empty_init:
            # Rank 0's random state at build time: materialising draws from it, as one eager process would.
            self._init_random_state = self.broadcast(_init.random_state(self.device), 0)
        return Strategy.model_init_context(self, empty_init)

    @hookimpl
    def wrap_model(self, model: torch.nn.Module, compiler: Compiler) -> torch.nn.Module:
        if self.pipeline is not None and model is self.applied.get("holder"):
            compiler.called = True  # set up again (validate after fit): its stages were compiled then
            return model
        _parallelize.check_no_prior_sharding(model)
        sizes, schedule = self._sizes(), self.config.schedule
        spr = self.config.resolved_stages_per_rank
        # 1. Where the model splits, and which stages this rank runs.
        split = _split.resolve(self.config.pp_plan, model, self.num_stages)
        local = _schedules.local_stages(schedule, sizes.pp, spr, self.pp_rank)
        deferred = has_meta_tensors(model)
        order = _materialize.record(model) if deferred else []
        if not deferred:
            model.to(self.device)
        tp = self.check_tensor_parallel(model)
        regions = _parallelize.compile_regions(model, compiler)
        # 2. The stage views and the pruned model (the holder), sharing this rank's modules.
        keys = list(model.state_dict(keep_vars=True))
        holder, views = _stage.build(model, split, local)
        self.applied = {
            "split": split,
            "local_stages": local,
            "units": {},
            "tp_styles": {},
            "checkpointed": 0,
            "compiled": {},
            "order": keys,  # the whole model's state-dict keys: checkpoints list names in this order
        }
        for index, view in zip(local, views):
            # 3. Per stage: tensor parallel, activation checkpointing, compile, FSDP (as the dimensions allow).
            if tp is not None:
                self.applied["tp_styles"][index] = _parallelize.tensor_parallel(
                    view, *tp, self.device_mesh["tp"], deferred
                )
            self.applied["checkpointed"] += _parallelize.checkpoint_activations(
                view, self.config.activation_checkpointing_policy
            )
            self.applied["compiled"][index] = _parallelize.compile_stage(view, regions, compiler)
            self.applied["units"][index] = self.shard_stage(view, split, index)
        # 4. A meta model gets the values one process would give the whole model.
        if deferred:
            owned = [n for i in local for n in split.stages[i]]
            _materialize.materialize(order, holder, views, owned, self.device, _materialize.state_for(self))
        # 5. The schedule over this rank's stages.
        self.pipeline = Pipeline(
            split=split,
            schedule=schedule,
            local=local,
            views=views,
            microbatches=self.microbatches,
            group=self.device_mesh.get_group("pp"),
            device=self.device,
            stage_ranks=_schedules.stage_ranks(schedule, sizes.pp, spr),
            replica_group=self.device_mesh.get_group("dp") if self.dims >= 2 and sizes.dp > 1 else None,
        )
        self.applied.update(holder=holder, views=views)
        holder.register_forward_pre_hook(_refuse_whole_model_call)
        return holder

    def check_tensor_parallel(self, model: torch.nn.Module) -> tuple[str, Any] | None:
        return None

    def shard_stage(self, view: torch.nn.Module, split: _split.Split, index: int) -> list[str]:
        return []

    # the step -------------------------------------------------------------------------------------
    @hookimpl
    def check_batch_size(self, batch_size: int) -> None:
        """Refuse a per-process batch that the micro-batches do not divide (before the first batch)."""
        _config.check_batch(self.microbatches, batch_size)

    @hookimpl
    def run_training_batch(
        self,
        batch: Any,
        split_batch: Callable[[Any], tuple[Any, Any]],
        compute_loss: Callable[[Any, Any], torch.Tensor],
        loss_scale: float,
    ) -> StepOutput:
        inputs, targets = split_batch(batch)
        result = self.train_step(as_inputs(inputs), targets, compute_loss, loss_scale)
        return StepOutput(loss=result.loss, outputs=result.outputs)

    @hookimpl
    def run_evaluation_batch(
        self,
        batch: Any,
        split_batch: Callable[[Any], tuple[Any, Any]],
        compute_loss: Callable[[Any, Any], torch.Tensor] | None,
        stage: str,
    ) -> StepOutput:
        if stage == "predict":
            return StepOutput(loss=None, outputs=self._running().predict(batch, split_batch))
        inputs, targets = split_batch(batch)
        result = self.eval_step(as_inputs(inputs), targets, compute_loss)
        return StepOutput(loss=result.loss, outputs=result.outputs)

    def train_step(
        self,
        inputs: tuple[Any, ...],
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_scale: float = 1.0,
    ) -> StepResult:
        """Forward and backward of one batch, cut into ``microbatches``, inside the schedule.

        :param inputs: the model's positional arguments for the whole per-process batch (used on the first
            stage; pass them on every rank).
        :param targets: what ``loss_fn`` compares the outputs with (used on the last stage).
        :param loss_fn: ``loss_fn(outputs, targets)`` -> the mean loss of one micro-batch (a scalar).
        :param loss_scale: gradients are those of ``loss_scale`` x the batch's mean loss (gradient accumulation).
        :returns: the mean loss over the micro-batches on every rank, and the last stage's outputs there.
        """
        return self._running().train_step(inputs, targets, loss_fn, loss_scale)

    def eval_step(
        self,
        inputs: tuple[Any, ...],
        targets: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> StepResult:
        """Forward only (validation, test, predict): the last stage's outputs, and the mean loss if asked."""
        return self._running().eval_step(inputs, targets, loss_fn)

    def _running(self) -> Pipeline:
        if self.pipeline is None or self.pipeline.schedule is None:
            raise ConfigurationError(
                f"{self._options_name}: no pipeline yet; set the model up (engine.setup) before stepping."
            )
        return self.pipeline

    # data ------------------------------------------------------------------------------------------
    @hookimpl
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every stage (and tp rank) of one pipeline sees the same samples: the sampler spans dp only.
        sizes = self._sizes()
        dp_rank = self.device_mesh.get_local_rank("dp") if self.dims >= 2 else 0
        return {"num_replicas": sizes.dp, "rank": dp_rank}

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def clip_gradients(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """The 2-norm over the gradients of every stage: each rank's norm (whole over dp and tp), squared,
        summed over the pipeline group; then every gradient scaled by the same factor."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        squared = global_norm(grads).to(self.device) ** 2
        dist.all_reduce(squared, group=self.device_mesh.get_group("pp"))
        total = squared.sqrt().cpu()
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if float(coefficient) < 1.0:
            with torch.no_grad():
                for grad in grads:
                    grad.mul_(float(coefficient))
        return total

    @hookimpl
    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        raise ConfigurationError(_OWN_STEP)

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        # The schedule reduces a stage's gradients at the end of each step; accumulation across steps adds to
        # the reduced gradients, which stays exact (see docs/pp-design.md for skipping that reduction).
        return contextlib.nullcontext()

    # checkpoints: a full state dict holds every stage (gathered to rank 0); loading one keeps this rank's
    def module_state_dict(self, module: torch.nn.Module, *, full: bool) -> dict[str, Any]:
        return _state.module_state_dict(self, module, full)

    def optimizer_state_dict(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, full: bool
    ) -> dict[str, Any]:
        return _state.optimizer_state_dict(self, module, optimizer, full)

    def load_module_state_dict(
        self, module: torch.nn.Module, state_dict: dict[str, Any], *, full: bool, strict: bool
    ) -> Any:
        return _state.load_module_state_dict(self, module, state_dict, full, strict)

    def load_optimizer_state_dict(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        *,
        full: bool,
    ) -> None:
        _state.load_optimizer_state_dict(self, module, optimizer, state_dict, full)

    def sends_stage(self) -> bool:
        """Whether this rank sends its stages to a full checkpoint: data- and tensor-parallel rank 0."""
        mesh = self.device_mesh
        return all(mesh.get_local_rank(name) == 0 for name in ("dp", "tp")[: self.dims - 1])

    # teardown --------------------------------------------------------------------------------------
    @hookimpl
    def teardown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.clear()
        self.pipeline, self.applied, self._device_mesh = None, {}, None
        TorchDistributedStrategy.teardown(self)


_OWN_STEP = (
    "a pipeline strategy runs forward and backward of every micro-batch inside its schedule: in a custom loop "
    "call engine.train_batch(model, inputs, targets, loss_fn) (engine.eval_batch for forward only); the "
    "Trainer does so with the module's split_batch and compute_loss. The model returned by setup holds this "
    "rank's stages only, so calling it, or engine.backward on a loss of it, cannot work."
)


def _refuse_whole_model_call(module: torch.nn.Module, args: Any) -> None:
    raise ConfigurationError(_OWN_STEP)


class PPFSDPStrategy(PPStrategy):
    """Pipeline x FSDP2 on a 2-D mesh ``("pp", "dp")``: each stage sharded over its data-parallel group, its
    blocks as units (or ``auto_wrap_policy``'s selection)::

        PPFSDPStrategy(pipeline_parallel_size=2, schedule="1f1b", microbatches=4)

    Rank ``r`` sits at ``(r // dp, r % dp)``: a data-parallel group is ``dp`` consecutive ranks.
    """

    dims = 2
    _options_name = "PPFSDPStrategy"

    def shard_stage(self, view: torch.nn.Module, split: _split.Split, index: int) -> list[str]:
        return _parallelize.shard(
            view,
            _parallelize.stage_blocks(view, split, index),
            self.config.auto_wrap_policy,
            self.device_mesh["dp"],
            _wrap.mixed_precision(self.precision, self.config.mixed_precision),
            self.config.reshard_after_forward,
        )


class PPFSDPTPStrategy(PPFSDPStrategy):
    """Pipeline x FSDP2 x tensor parallel on a 3-D mesh ``("pp", "dp", "tp")``, the pipeline outermost::

        PPFSDPTPStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, tp_plan={"blocks.*.fc1": "colwise"})

    The tensor-parallel plan takes stratagem-tp's forms (default: the model's ``tp_plan``); it is checked on
    the whole model, then each stage applies the entries that match its modules.
    """

    dims = 3
    _options_name = "PPFSDPTPStrategy"

    def check_tensor_parallel(self, model: torch.nn.Module) -> tuple[str, Any] | None:
        return _parallelize.check_tensor_parallel(self.config.tp_plan, model, self._sizes().tp)

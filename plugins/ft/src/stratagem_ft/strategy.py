"""``ft_ddp`` and ``ft_hsdp``: replica groups that train as one data-parallel job, step by step, through a torchft
quorum; a lost group costs the others one quorum, not a restart.

Each replica group is an ordinary ``torch.distributed`` world of W processes (its own launcher, rendezvous and
restarts). Inside it, ``ft_ddp`` averages gradients over its ranks and ``ft_hsdp`` shards with FSDP2; across
the groups, torchft's Manager averages them over the groups in each step's quorum, commits the step only where
every rank of a group succeeded, and heals a group that (re)joins from a live one.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, ContextManager

import torch

from stratagem import hookimpl
from stratagem.errors import ConfigurationError
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem.strategies import Strategy, TorchDistributedStrategy, has_meta_tensors, wrapping_with
from stratagem_ft import _lighthouse, _replica, _state, _sync
from stratagem_ft._config import FTConfig, split_options


class FTStrategy(TorchDistributedStrategy):
    """The torchft Manager of one replica group and the per-step protocol around it: a quorum opened as each
    step begins, gradients averaged over the groups present, the step committed only if the quorum agrees.

    Subclasses say how the model is wrapped inside the group (:meth:`wrap_model`) and which gradients the
    groups average (:meth:`_sync_gradients`).
    """

    #: The name messages use before the registry has named the instance.
    label = "ft"
    #: torchft's asynchronous quorum: computed during the step's forward, healing applied at the commit.
    use_async_quorum = True

    def __init__(
        self,
        *,
        replica_id: int | None = None,
        num_replica_groups: int | None = None,
        lighthouse: str | None = None,
        quorum_timeout: float = 60.0,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        start_timeout: float = 60.0,
        heartbeat_timeout: float = 5.0,
        **unknown: Any,
    ) -> None:
        split_options(self.label, unknown, (FTConfig, *self.extra_configs()))
        self.config = FTConfig(
            strategy=self.label,
            replica_id=replica_id,
            num_replica_groups=num_replica_groups,
            lighthouse=lighthouse,
            quorum_timeout=quorum_timeout,
            timeout=timeout,
            connect_timeout=connect_timeout,
            start_timeout=start_timeout,
            heartbeat_timeout=heartbeat_timeout,
        )
        super().__init__()
        self.replica_id = 0
        self.num_replica_groups = 1
        self.lighthouse = ""
        #: torchft's Manager of this rank (made by ``setup_optimizers``).
        self.manager: Any = None
        self._process_group: Any = None
        self._store: Any = None
        self._lighthouse_server: Any = None
        self._model: torch.nn.Module | None = None
        self._optimizer: Any = None
        self._quorum_open = False
        self._syncing = True
        #: Steps this group committed and steps the quorum refused (a peer failed during them).
        self.committed_steps = 0
        self.refused_steps = 0
        #: ``{replica group: (step it left, host)}`` for groups that left a quorum and have not come back.
        self.lost_groups: dict[int, tuple[int, str]] = {}

    @classmethod
    def extra_configs(cls) -> tuple[type, ...]:
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # environment ----------------------------------------------------------------------------------
    @hookimpl
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        # What needs no process group is checked before joining one.
        self.replica_id, self.num_replica_groups = self.config.identity()
        address = self.config.lighthouse_address()
        if address is None and self.num_replica_groups > 1:
            raise ConfigurationError(
                f"{self.label}(num_replica_groups={self.num_replica_groups}): no lighthouse. Give its address "
                "as lighthouse=http://HOST:PORT or $TORCHFT_LIGHTHOUSE, or start the groups with the "
                "replica_groups launcher, which starts one."
            )
        TorchDistributedStrategy.setup_environment(self, cluster, precision)
        try:
            self._meet_lighthouse(address)
        except ConfigurationError:
            # Every rank refuses alike (the check's outcome is broadcast): none is left waiting, and a refused
            # set-up leaves nothing running, neither its lighthouse nor its process group.
            self.teardown()
            raise

    def _meet_lighthouse(self, address: str | None) -> None:
        if address is None:
            # A job of one replica group has no one to meet: it runs a lighthouse of its own.
            if self.rank == 0:
                self._lighthouse_server = _lighthouse.start(self.config.heartbeat_timeout)
                address = self._lighthouse_server.address()
            address = self.broadcast(address, 0)
        self.lighthouse = address
        problem = None
        if self.rank == 0:
            try:
                _lighthouse.check_reachable(address, self.config.connect_timeout, self.label)
            except ConfigurationError as error:
                problem = str(error)
        problem = self.broadcast(problem, 0)  # every rank fails alike, none waits for the others
        if problem is not None:
            raise ConfigurationError(problem)

    # data ------------------------------------------------------------------------------------------
    @hookimpl
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # The job is one data-parallel world of R x W ranks: group g's rank r takes global rank g * W + r.
        return {
            "num_replicas": self.num_replica_groups * self.world_size,
            "rank": self.replica_id * self.world_size + self.rank,
        }

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def setup_optimizers(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
        if len(optimizers) != 1:
            raise ConfigurationError(
                f"{self.label}: give exactly one optimizer (got {len(optimizers)}): torchft commits one optimizer "
                "step per quorum."
            )
        if self.manager is not None:
            # A second model set up in the same Engine (one loaded from a checkpoint to compare, say): the
            # replica groups keep the newest one in step, under a Manager of its own.
            self._shutdown_manager()
        self._model, self._optimizer = model, optimizers[0]
        self.manager, self._process_group, self._store = _replica.create_manager(
            self.config,
            self.cluster,
            replica_id=self.replica_id,
            lighthouse=self.lighthouse,
            use_async_quorum=self.use_async_quorum,
        )
        self.manager.register_state_dict_fn("stratagem", self._load_healed, self._healing_state)
        prepared = self._prepare_optimizers(model, optimizers)
        self._start()
        return prepared

    def _prepare_optimizers(self, model: torch.nn.Module, optimizers: list[Any]) -> list[Any]:
        return optimizers

    def _healing_state(self) -> dict[str, Any]:
        assert self._model is not None
        return _state.healing_state(self._model, self._optimizer)

    def _load_healed(self, state: dict[str, Any]) -> None:
        assert self._model is not None
        _state.load_healing_state(self._model, self._optimizer, state)

    def _start(self) -> None:
        """The first quorum. A fresh job's groups wait for each other (up to ``start_timeout``), take the weights
        of the quorum's first group (torchft's initial sync) and commit an empty step, so that the first training
        step averages every group's gradients. A group that finds the others training already, or that was
        restarted, keeps this quorum for its first step, in which it heals from a live group."""
        manager = self.manager
        deadline = time.monotonic() + self.config.start_timeout
        fresh = self.cluster.restart_count == 0
        while True:
            manager.start_quorum()
            manager.wait_quorum()
            if not fresh or manager.current_step() > 0:
                self._quorum_open = True
                return
            if manager.num_participants() >= self.num_replica_groups or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        # The empty step's all-reduce is what keeps the first group from committing (which ends the serving of
        # its weights) before a group healing from it has fetched them: a healing group joins it only after.
        manager.allreduce(torch.zeros(1)).wait()
        if not manager.should_commit():
            raise RuntimeError(f"{self.label}: the replica groups' first quorum failed: {manager.errored()}")
        self._track_members()

    def _open_quorum(self) -> None:
        if not self._quorum_open and self.manager is not None:
            self.manager.start_quorum()
            self._quorum_open = True

    @hookimpl
    def run_training_batch(self, model: torch.nn.Module, batch: Any, batch_idx: int) -> Any:
        # The step begins: its quorum is computed while the forward runs.
        self._open_quorum()
        return None

    @hookimpl
    def forward_context(self) -> ContextManager[None]:
        # The Engine's step (Engine.train_batch, or forward/backward/step by hand) calls no hook before its
        # forward but this one: opening the quorum here, not at backward, overlaps the lighthouse's round trip
        # with the forward too. Not under no_grad (an evaluation), whose forward leads to no step. Not earlier,
        # at the end of the step before: a group that died between two steps would then be in the next quorum
        # already, and the survivors would lose that step.
        if torch.is_grad_enabled():
            self._open_quorum()
        return Strategy.forward_context(self)

    @hookimpl
    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        self._open_quorum()
        Strategy.backward(self, loss=loss, model=model)
        if self._syncing and self.manager is not None:
            self._sync_gradients(model)

    def _sync_gradients(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        return self._without_sync()

    @contextlib.contextmanager
    def _without_sync(self) -> Any:
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    @hookimpl
    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self._open_quorum()
        committed = self.manager.should_commit()
        self._quorum_open = False
        if committed:
            Strategy.optimizer_step(self, optimizer=optimizer, model=model)
            self.committed_steps += 1
        else:
            self.refused_steps += 1
        self._track_members()

    def _track_members(self) -> None:
        """Say, on rank 0, when a group leaves the quorum or joins it."""
        group = self._process_group
        members = set(group.members)
        step = self.manager.current_step()
        for lost in sorted(set(group.hosts) - members - set(self.lost_groups)):
            self.lost_groups[lost] = (step, group.hosts[lost])
            self._say(f"replica group {lost} (on {group.hosts[lost]}) left the quorum at step {step}")
        for back in sorted(members & set(self.lost_groups)):
            del self.lost_groups[back]
            self._say(f"replica group {back} (on {group.hosts[back]}) joined the quorum again at step {step}")

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"stratagem-ft: replica group {self.replica_id}: {message}.", file=sys.stderr, flush=True)

    def _shutdown_manager(self) -> None:
        if self._quorum_open:
            # A quorum opened for a step that never came (the job ended after a forward). Its request waits at
            # the lighthouse on the Manager's thread, which the interpreter joins at exit: shut down now, the
            # Manager would stop the heartbeats the lighthouse answers on, and the exit would wait out
            # quorum_timeout. Alive, it is answered once the groups that ended are dropped (heartbeat_timeout).
            with contextlib.suppress(Exception):
                self.manager.wait_quorum()
        self.manager.shutdown(wait=False)
        self.manager = None
        self._quorum_open = False

    # teardown --------------------------------------------------------------------------------------
    @hookimpl
    def teardown(self) -> None:
        if self.manager is not None:
            for lost, (step, host) in sorted(self.lost_groups.items()):
                self._say(
                    f"finished without replica group {lost} (on {host}), lost at step {step} and not back since"
                )
            self._shutdown_manager()
        if self._lighthouse_server is not None:
            self._lighthouse_server.shutdown()
            self._lighthouse_server = None
        TorchDistributedStrategy.teardown(self)


class FTDDPStrategy(FTStrategy):
    """``ft_ddp``: every process holds a full replica; gradients are averaged over the group's ranks, then over
    the replica groups present (one flat all-reduce each, the gradients being views of the flat buffers)."""

    label = "ft_ddp"
    _flat: _sync.FlatGradients | None = None

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = Strategy.wrap_model(self, model)
        if self.world_size > 1:
            # Like DDP at construction: the group starts from its rank 0's weights.
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    torch.distributed.broadcast(tensor, src=0)
        return model

    def _sync_gradients(self, model: torch.nn.Module) -> None:
        self._flat = self._flat or _sync.FlatGradients()
        buffers = self._flat.gather(model.parameters())
        _sync.average_flat(
            buffers, group_size=self.world_size, manager=self.manager, process_group=self._process_group
        )

    @hookimpl
    def teardown(self) -> None:
        self._flat = None
        FTStrategy.teardown(self)


class FTHSDPStrategy(FTStrategy):
    """``ft_hsdp``: FSDP2 shards the model over the group's ranks (its reduce-scatter averages over them); the
    replica groups present then average each rank's gradient shard. Units: the submodules passed through
    ``stratagem.wrap``, then the root."""

    label = "ft_hsdp"

    @property
    def checkpoint_format(self) -> str:  # type: ignore[override]
        return "sharded"

    @hookimpl
    def model_sharded_context(self) -> ContextManager[None]:
        return wrapping_with(self._shard)

    def _shard(self, module: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(module, torch.nn.Module):
            raise ConfigurationError(f"stratagem.wrap({module!r}): give a torch.nn.Module.")
        if isinstance(module, FSDPModule):
            return module
        fully_shard(module, mesh=self._mesh())
        return module

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        if getattr(self, "_device_mesh", None) is None:
            self._device_mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._device_mesh

    @property
    def device_mesh(self) -> Any:
        """The mesh inside the replica group (FSDP's shard dimension; the replica dimension is torchft's)."""
        return self._mesh()

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        if has_meta_tensors(model):
            raise ConfigurationError(
                f"{self.label}: build the model on a device (empty_init=False): it shards a built model."
            )
        model = Strategy.wrap_model(self, model)
        if not isinstance(model, FSDPModule):
            self._shard(model)
        return model

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        return self._accumulating(model)

    @contextlib.contextmanager
    def _accumulating(self, model: torch.nn.Module) -> Any:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            with self._without_sync():
                yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def _sync_gradients(self, model: torch.nn.Module) -> None:
        # FSDP's reduce-scatter has averaged over the group already: only the groups are left to average.
        grads = _sync.local_gradients(model.parameters())
        _sync.average(grads, group_size=1, manager=self.manager, process_group=self._process_group)

    @hookimpl
    def teardown(self) -> None:
        self._device_mesh = None
        FTStrategy.teardown(self)

"""``diloco``: semi-synchronous training across replica groups with torchft's DiLoCo.

Each replica group takes ``sync_every`` steps of its own optimizer (the inner one) on its share of the data,
averaging gradients only over its own ranks; then the groups present average their pseudo-gradients (the
weights at the last synchronisation minus their own) and the outer optimizer steps the shared weights with
them. The groups talk once per ``sync_every`` steps, so slow links and lost groups cost little; the price is
that the groups' weights differ between synchronisations.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem import hookimpl
from stratagem.strategies import Strategy
from stratagem_ft import _sync
from stratagem_ft._config import DiLoCoConfig
from stratagem_ft.strategy import FTStrategy


class DiLoCoStrategy(FTStrategy):
    """``diloco[sync_every=H,outer_optimizer=nesterov,outer_lr=0.7,outer_momentum=0.9]``, with the options of
    every fault-tolerant strategy (``replica_id``, ``num_replica_groups``, ``lighthouse``, the timeouts)."""

    label = "diloco"
    # DiLoCo computes its quorum when it synchronises and applies a healing state at once (torchft requires it).
    use_async_quorum = False
    # Local steps with periodic averaging: equal to data parallelism only in the limit, so no tolerance is claimed.
    contract_tolerance = None

    def __init__(
        self,
        *,
        sync_every: int = 100,
        outer_optimizer: Any = "nesterov",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        **options: Any,
    ) -> None:
        self.diloco_config = DiLoCoConfig(
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
        )
        super().__init__(**options)
        self._diloco: Any = None

    @classmethod
    def extra_configs(cls) -> tuple[type, ...]:
        return (DiLoCoConfig,)

    def __repr__(self) -> str:
        return f"DiLoCoStrategy({self.config!r}, {self.diloco_config!r})"

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = Strategy.wrap_model(self, model)
        if self.world_size > 1:
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    torch.distributed.broadcast(tensor, src=0)
        return model

    def _prepare_optimizers(self, model: torch.nn.Module, optimizers: list[Any]) -> list[Any]:
        from torchft.local_sgd import DiLoCo

        inner = optimizers[0]
        params = [p for p in model.parameters() if p.requires_grad]
        outer = self.diloco_config.build_outer(params)
        # The backup of the weights at the last synchronisation stays on the model's device; pinned host memory
        # only pays off when it is an accelerator's.
        self._diloco = DiLoCo(
            self.manager,
            [model],
            inner,
            outer,
            sync_every=self.diloco_config.sync_every,
            pin_memory=False,
        )
        self._diloco.__enter__()
        return optimizers

    def _start(self) -> None:
        # A restarted group meets the others at their next synchronisation, where it heals; a quorum now would be
        # one of theirs, whose all-reduce it could not take part in.
        if self.cluster.restart_count == 0:
            FTStrategy._start(self)

    # Between synchronisations the groups do not meet: no quorum per step, gradients averaged in the group only.
    def _open_quorum(self) -> None:
        return None

    def _sync_gradients(self, model: torch.nn.Module) -> None:
        if self.world_size > 1:
            _sync.average(_sync.local_gradients(model.parameters()), group_size=self.world_size, manager=None)

    @hookimpl
    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        # DiLoCo's hooks on the inner optimizer count the steps and synchronise every sync_every of them.
        Strategy.optimizer_step(self, optimizer=optimizer, model=model)
        self.committed_steps += 1

    @hookimpl
    def teardown(self) -> None:
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
            self._diloco = None
        FTStrategy.teardown(self)

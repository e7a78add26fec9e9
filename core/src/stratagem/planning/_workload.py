"""What the plan sets up and runs: the model, one micro-batch of its inputs, and its loss; and the simulated
world's sizes, precision and optimizer (:class:`World`)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from stratagem.launchers.cluster import ClusterEnvironment

#: Optimizers the plan can build, by name: AdamW and Adam keep two moments per parameter and a step count per
#: tensor, SGD with momentum one buffer.
OPTIMIZERS = ("adamw", "adam", "sgd")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{attribute.name}={value!r}: give a positive whole number.")


def _known_optimizer(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in OPTIMIZERS:
        close = difflib.get_close_matches(str(value), OPTIMIZERS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"optimizer={value!r} is not one the plan builds: {', '.join(OPTIMIZERS)}.{hint}"
        )


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _precision(value: Any) -> str:
    from stratagem.strategies.precision import normalize

    return normalize(value)


@attrs.frozen(kw_only=True)
class World:
    """The simulated cluster and step.

    :param devices: processes (devices) per node.
    :param nodes: nodes; the world size is ``devices * nodes``.
    :param precision: a precision name (``32-true``, ``bf16-mixed``, ``bf16-true``, ...).
    :param optimizer: ``adamw``, ``adam`` or ``sgd`` (with momentum).
    :param batch_size: samples in one micro-batch of one rank's forward.
    :param sequence_length: tokens per sample, for models that take token sequences.
    """

    devices: int = attrs.field(validator=_positive)
    nodes: int = attrs.field(default=1, validator=_positive)
    precision: str = attrs.field(default="32-true", converter=_precision)
    optimizer: str = attrs.field(default="adamw", converter=_lower, validator=_known_optimizer)
    batch_size: int = attrs.field(default=1, validator=_positive)
    sequence_length: int = attrs.field(default=2048, validator=_positive)

    @property
    def size(self) -> int:
        return self.devices * self.nodes

    def cluster(self, rank: int, backend: str) -> ClusterEnvironment:
        """Where simulated ``rank`` runs: its node and local rank, a CPU device, the simulated backend."""
        from stratagem.launchers.cluster import ClusterEnvironment

        return ClusterEnvironment(
            rank=rank,
            local_rank=rank % self.devices,
            world_size=self.size,
            node_rank=rank // self.devices,
            num_nodes=self.nodes,
            accelerator="cpu",
            device="cpu",
            backend=backend,
        )

    def make_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        params = list(params)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-3)
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "nodes": self.nodes,
            "size": self.size,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "sequence_length": self.sequence_length,
        }


@attrs.frozen(kw_only=True)
class Workload:
    """A model as the plan uses it.

    :param name: what the report calls it.
    :param build: builds the model (called on the meta device, inside the strategy's model contexts; a
        ``stratagem.Module``'s ``configure_model`` is the caller's to run here).
    :param batch: ``batch(model, batch_size, sequence_length)`` -> one micro-batch, in any form ``step`` takes;
        ``None`` when the plan cannot make one (activations and communication are then not estimated).
    :param step: ``step(model, wrapped, batch)`` -> the scalar loss: forward through ``wrapped`` (what the
        strategy's ``wrap_model`` returned, whose hooks gather and synchronise), then the loss. ``model`` is the
        module as built, for a loss that is one of its methods.
    """

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[Any, int, int], Any] | None = None
    step: Callable[[Any, Any, Any], torch.Tensor] | None = None

    @property
    def steps(self) -> bool:
        return self.batch is not None and self.step is not None


def token_batch(vocab: int) -> Callable[[Any, int, int], tuple[Any, Any]]:
    """Random token ids ``(batch, sequence)`` as the input, the same ids as targets."""

    def make(model: Any, batch_size: int, sequence_length: int) -> tuple[Any, Any]:
        import torch

        ids = torch.randint(vocab, (batch_size, sequence_length))
        return ids, ids

    return make


def token_step(model: Any, wrapped: Any, batch: tuple[Any, Any]) -> torch.Tensor:
    """The model on token ids, then cross-entropy of its logits (or an output's ``.logits``) in float32, as
    Hugging Face computes its loss."""
    import torch.nn.functional as F

    ids, targets = batch
    outputs = wrapped(ids)
    logits = getattr(outputs, "logits", outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

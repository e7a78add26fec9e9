"""The model, data and loop the contract suite trains, in every worker and in the one-process reference.

The model has the parts wrap policies look for: an ``Embedding``, ``LayerNorm``\\ s, and ``Block``
submodules (each passed through :func:`stratagem.wrap`, so a strategy that shards by hand shards them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import stratagem

VOCAB = 24
SEQUENCE = 6
WIDTH = 16
BLOCKS = 2
#: Samples per rank per micro-batch, and micro-batches per optimizer step (gradient accumulation).
PER_RANK_BATCH = 4
ACCUMULATE = 2
#: Steps before the checkpoint, and after it (the resume check replays these).
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 2
LEARNING_RATE = 1e-2
#: Low enough that clipping acts on most steps.
MAX_NORM = 0.5
MODEL_SEED = 0
DATA_SEED = 1234


class Block(nn.Module):
    """A pre-norm residual MLP block: the unit a wrap policy shards."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ContractModel(nn.Module):
    """Token embedding, residual blocks, a final norm and a linear head: next-token logits."""

    #: A tensor-parallel plan, in the form strategies that split layers read from a model's ``tp_plan``: each
    #: block's MLP split by columns then by rows (the Megatron pair: one all-reduce per block). Strategies that
    #: do not split layers never look at it.
    tp_plan = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def pp_plan(self, num_stages: int) -> list[Any]:
        """Where a pipeline splits it, for the stage counts the suite runs (the form strategies that split a
        model into stages read from a model's ``pp_plan``: the module names each stage holds, or where each
        begins). Strategies that do not split never call it."""
        if num_stages == 2:
            return ["blocks.1"]
        if num_stages == 4:
            return [["embedding"], ["blocks.0"], ["blocks.1"], ["norm", "head"]]
        raise ValueError(f"the contract model splits into 2 or 4 pipeline stages, not {num_stages}")

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(stratagem.wrap(Block(WIDTH)) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class StepModule(ContractModel, stratagem.Module):
    """The same model trained by the Trainer, written as most users write one: the step calls the submodules
    directly, so a strategy that shards in place must still gather the root's own parameters (the embedding,
    the final norm, the head) around it."""

    def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss alone, for strategies that run the step themselves (a pipeline calls it on its last stage
        and never calls training_step)."""
        return loss_fn(logits, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return loss_fn(self.head(self.norm(x)), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)


def build_step_module(seed: int = MODEL_SEED) -> StepModule:
    torch.manual_seed(seed)
    return StepModule()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build_model(seed: int = MODEL_SEED) -> ContractModel:
    torch.manual_seed(seed)
    return ContractModel()


def step_batch(world_size: int) -> int:
    """Samples in one optimizer step over all ranks (the reference's batch)."""
    return PER_RANK_BATCH * ACCUMULATE * world_size


def dataset(world_size: int) -> torch.utils.data.TensorDataset:
    """Enough samples for every step; the targets follow from the tokens, so the loss falls."""
    total = step_batch(world_size) * (STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(VOCAB, (total, SEQUENCE), generator=generator)
    targets = (tokens + torch.roll(tokens, 1, dims=1)) % VOCAB
    return torch.utils.data.TensorDataset(tokens, targets)


def plain_state(value: Any) -> Any:
    """Detached CPU copies of the tensors in a (nested) state dict, so results travel between processes."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: plain_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_state(v) for v in value)
    return value


def reference_run(world_size: int, replicas: int | None = None) -> dict[str, Any]:
    """Train in this process on the global batch with plain PyTorch: what every strategy must reproduce.

    The batch of step ``s`` holds samples ``[s * B, (s + 1) * B)`` with ``B = step_batch(replicas)``:
    exactly the samples the ranks see in that step through a ``DistributedSampler`` without shuffling.
    ``replicas`` is the sampler's number of replicas (the data-parallel size, which the strategy's
    ``distributed_sampler_kwargs`` gives): the world size, or fewer when ranks of a tensor-parallel group share
    their samples.
    """
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    data = dataset(world_size)
    size = step_batch(world_size if replicas is None else replicas)
    losses, norms, at_save, evaluated = [], [], None, None
    for step in range(STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE):
        if step == STEPS_BEFORE_SAVE:
            at_save = plain_state(model.state_dict())
            # The first batch of every replica, forward only (what each rank evaluates before saving).
            tokens, targets = data[: PER_RANK_BATCH * (world_size if replicas is None else replicas)]
            with torch.no_grad():
                evaluated = float(loss_fn(model(tokens), targets))
        tokens, targets = data[step * size : (step + 1) * size]
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "norms": norms,
        "params_at_save": at_save,
        "eval_loss": evaluated,
        "params_final": plain_state(model.state_dict()),
    }


def plan_workload() -> Any:
    """The contract's model as ``stratagem.planning`` plans it: the same model, one micro-batch of
    ``PER_RANK_BATCH`` token sequences, the same loss, the same step (``Engine.train_batch``'s path)."""
    from stratagem.planning import Workload

    def batch(model: Any, batch_size: int, sequence_length: int) -> Any:
        return torch.randint(VOCAB, (batch_size, SEQUENCE)), torch.randint(VOCAB, (batch_size, SEQUENCE))

    def step(model: Any, wrapped: Any, batch: Any) -> torch.Tensor:
        tokens, targets = batch
        return loss_fn(wrapped(tokens), targets)

    return Workload(name="the contract's model", build=ContractModel, batch=batch, step=step)

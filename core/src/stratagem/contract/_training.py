"""What every section of the contract's workers builds on: the model and its optimizer set up by the strategy,
the batches, training through ``Engine.train_batch``, and what the suite observes (parameters as the module
shows them, full checkpoints written by the strategy's own save hook, read back weights-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stratagem.contract import _suite_model as m

#: The live training objects, kept from one section of a phase to the next.
_live: dict[str, Any] = {}


def _clean_name(name: str) -> str:
    from stratagem.engine._strategy_optimizer import _clean_name as clean

    return clean(name)


def _clean_optimizer(state: dict[str, Any]) -> dict[str, Any]:
    cleaned = dict(state)
    if isinstance(state.get("state"), dict):
        cleaned["state"] = {_clean_name(k) if isinstance(k, str) else k: v for k, v in state["state"].items()}
    if isinstance(state.get("param_groups"), list):
        cleaned["param_groups"] = [
            {**g, "params": [_clean_name(p) if isinstance(p, str) else p for p in g.get("params", [])]}
            for g in state["param_groups"]
        ]
    return cleaned


# The suite observes a strategy only as users do: the module's public API, and checkpoints written by the
# strategy's own save hook, read back weights-only. Never its helper methods.


def observed_params(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The parameters as ``named_parameters()`` shows them, gathered whole (a ``DTensor``'s full tensor), over
    every rank (a pipeline rank shows its stages' only; where ranks show the same names, rank 0's values).

    A collective: every rank calls it. ``None`` when the module does not show its parameters (a strategy that
    partitions them in place, as ZeRO-3 does); the checks then read them from a full checkpoint the strategy
    writes.
    """
    import torch.distributed as dist

    out: dict[str, torch.Tensor] | None = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        if tensor.numel() == 0:
            out = None
            break
        out[_clean_name(name)] = tensor.detach().cpu().clone()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return out
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    if any(part is None for part in every):
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in reversed(every):
        merged.update(part)
    return merged


def saved_full(engine: Any, state: dict[str, Any], path: str) -> dict[str, Any] | None:
    """Save ``state`` through the strategy's hook in the full format and read the file back weights-only:
    ``{"params", "optimizer"}`` on rank 0, ``None`` elsewhere."""
    engine.save(path, state, format="full")
    engine.barrier("stratagem-contract-saved")
    if engine.rank != 0:
        return None
    payload = torch.load(path, weights_only=True)
    return {
        "params": {_clean_name(k): v for k, v in payload["model"]["model"].items()},
        "optimizer": _clean_optimizer(payload["optimizers"]["optimizer"]),
    }


def build(engine: Any, seed: int, compile: Any = False) -> tuple[torch.nn.Module, Any]:
    with engine.init_module():
        model = m.build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.LEARNING_RATE)
    return engine.setup(model, optimizer, compile=compile)


def batches(engine: Any) -> list[Any]:
    loader = torch.utils.data.DataLoader(
        m.dataset(engine.world_size), batch_size=m.PER_RANK_BATCH, shuffle=False
    )
    loader = engine.setup_dataloaders(loader)
    # As the Trainer does before the first batch: a strategy that runs the step may refuse the batch size.
    engine.check_batch_size(m.PER_RANK_BATCH)
    # The data-parallel size the strategy chose (fewer than the ranks under tensor parallelism): the reference
    # trains on that many ranks' samples per step.
    _live["replicas"] = getattr(loader.sampler, "num_replicas", 1)
    return list(loader)


def train(
    engine: Any, model: torch.nn.Module, optimizer: Any, data: list[Any], start: int, steps: int
) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps from step ``start``; each accumulates ``ACCUMULATE`` micro-batches."""
    losses, norms = [], []
    for step in range(start, start + steps):
        micro = data[step * m.ACCUMULATE : (step + 1) * m.ACCUMULATE]
        total = torch.zeros(())
        for index, (tokens, targets) in enumerate(micro):
            with engine.no_sync(model, enabled=index < m.ACCUMULATE - 1):
                # forward_context, the model, the loss and backward; or the strategy's own step (a pipeline).
                result = engine.train_batch(model, tokens, targets, m.loss_fn, loss_scale=1 / m.ACCUMULATE)
            total += result.loss.float() / m.ACCUMULATE
        norm = engine.clip_gradients(model, optimizer, m.MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(engine.all_reduce(total, "mean")))
        norms.append(float(norm))
    return losses, norms


def checkpoint_path(workdir: str, fmt: str) -> str:
    return str(Path(workdir) / ("checkpoint.pt" if fmt == "full" else "checkpoint-sharded"))


def held_after_step(engine: Any) -> dict[str, int]:
    """What this rank holds in one step of a fresh model (one micro-batch), as the strategy counts it: its
    gradients as backward leaves them, the rest after the optimizer step. The plan's check compares the plan
    with this. Gradients are counted before the step because a strategy may free them in it (DeepSpeed's ZeRO
    1 and 2 do); every other strategy holds the same gradients before the step and after."""
    from stratagem.engine._strategy_optimizer import _unwrap

    model, optimizer = build(engine, m.MODEL_SEED)
    tokens, targets = batches(engine)[0]
    engine.train_batch(model, tokens, targets, m.loss_fn)
    gradients = engine.strategy.memory_held(model, _unwrap(optimizer))["gradients"]
    optimizer.step()
    held = {**engine.strategy.memory_held(model, _unwrap(optimizer)), "gradients": gradients}
    optimizer.zero_grad()
    return held

"""What runs in the workers of tests/test_plan_against_runs.py: each strategy in turn, each model, one real step,
and the bytes every rank then holds.

Module-level functions, so that function workers import them. The models are rebuilt here from the same
``stratagem plan`` workloads the test plans (their closures do not travel between processes).
"""

from __future__ import annotations

import resource
import traceback
from typing import Any

import torch
import torch.nn.functional as F

#: One micro-batch per rank: samples and tokens (the plan's ``World(batch_size, sequence_length)``). Four
#: samples give each of up to four pipeline stages a micro-batch.
BATCH, SEQUENCE = 4, 16


def workloads(llama_config: str) -> dict[str, Any]:
    """The models by name: the demo's (``--model demo``), the same with four blocks (four pipeline stages split
    it; the demo's default has two), and a tiny Hugging Face Llama (``--model PATH/config.json``)."""
    import attrs

    from stratagem.cli.demo.model import CharLM, load_text
    from stratagem.cli.plan import _plan_models

    demo = _plan_models.demo(None)
    vocab = len(set(load_text()))

    def four_blocks() -> Any:
        model = CharLM(vocab, block=_plan_models._DEMO_BLOCK, layers=4)
        model.configure_model()
        return model

    return {
        "demo": demo,
        "demo-4-blocks": attrs.evolve(demo, name="demo (4 blocks)", build=four_blocks),
        "llama": _plan_models.workload(llama_config),
    }


def lm_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (a Hugging Face output's ``.logits``) in float32: both workloads' loss."""
    logits = getattr(outputs, "logits", outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def held_after_step(engine: Any, workload: Any) -> list[int]:
    """``[parameters, buffers, gradients, optimizer]`` bytes this rank holds in one step of a fresh model, as the
    strategy counts them (``Strategy.memory_held``): gradients as backward leaves them, the rest after the
    optimizer step (the contract's rule: DeepSpeed's ZeRO 1 and 2 free their gradient partitions in the step)."""
    from stratagem.engine._strategy_optimizer import _unwrap

    with engine.init_module():
        torch.manual_seed(0)
        model = workload.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped, optimizer = engine.setup(model, optimizer)
    # The same batch on every rank: a pipeline's stages and a tensor-parallel group must see the same one.
    torch.manual_seed(1)
    tokens, targets = workload.batch(model, BATCH, SEQUENCE)
    engine.train_batch(wrapped, tokens, targets, lm_loss)
    gradients = engine.strategy.memory_held(wrapped, _unwrap(optimizer))["gradients"]
    optimizer.step()
    held = {**engine.strategy.memory_held(wrapped, _unwrap(optimizer)), "gradients": gradients}
    optimizer.zero_grad()
    return [held["parameters"], held["buffers"], held["gradients"], held["optimizer"]]


def run_all(engine: Any, runs: list[tuple[str, str]], llama_config: str) -> dict[str, Any]:
    """Each ``(strategy, model)`` of ``runs`` in turn, in these processes: a fresh Engine per strategy on the
    launch's process group (it joins the group the launching engine formed, and leaves it to that engine),
    torn down before the next. Returns, on every rank, ``{"held": {(strategy, model): {rank: [bytes...]}},
    "errors": {(strategy, model): {rank: traceback}}, "cpu_seconds": {rank: seconds}}``; a run that raises is
    recorded, and the next goes on."""
    import torch.distributed as dist

    from stratagem.engine import Engine

    torch.set_num_threads(1)
    models = workloads(llama_config)
    held: dict[tuple[str, str], list[int]] = {}
    errors: dict[tuple[str, str], str] = {}
    by_strategy: dict[str, list[str]] = {}
    for strategy, model in runs:
        by_strategy.setdefault(strategy, []).append(model)
    for strategy, names in by_strategy.items():
        run = Engine(strategy=strategy, accelerator="cpu", devices=engine.world_size, timeout=120)
        run.setup_environment()
        for name in names:
            try:
                held[strategy, name] = held_after_step(run, models[name])
            except Exception:
                errors[strategy, name] = traceback.format_exc()
            # Every rank ends this run before any starts the next (a failed rank may have left its peers
            # inside a collective of the step; their own timeout ends that).
            engine.barrier("plan-against-runs")
        run.teardown()
    # What the runs cost this worker (a forked worker's counts start at its fork).
    usage = resource.getrusage(resource.RUSAGE_SELF)
    every: list[Any] = [None] * engine.world_size
    dist.all_gather_object(every, (engine.rank, held, errors, usage.ru_utime + usage.ru_stime))
    out: dict[str, Any] = {"held": {}, "errors": {}, "cpu_seconds": {}}
    for rank, rank_held, rank_errors, seconds in every:
        out["cpu_seconds"][rank] = seconds
        for key, counts in rank_held.items():
            out["held"].setdefault(key, {})[rank] = counts
        for key, text in rank_errors.items():
            out["errors"].setdefault(key, {})[rank] = text
    return out

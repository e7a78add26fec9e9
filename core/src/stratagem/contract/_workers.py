"""What runs inside the contract suite's worker processes.

Two launches per strategy, each a real multi-process run started by torch's elastic agent:

- phase one: collectives; training from step 0 (``STEPS_BEFORE_SAVE`` steps); a checkpoint in every declared
  format; the remaining steps (the straight run); the same training through the Trainer; teardown;
- phase two, in new processes: load each checkpoint into a freshly built model and resume; load a full
  checkpoint written by ``single_device``; load its weights as Hugging Face safetensors and export them back
  (``_hf_weights``); teardown.

Each section records an error instead of raising, so one broken operation fails its own checks only. The
strategy is observed as a user sees it, through the module's parameters and the checkpoints its own save hook
writes (read back with ``torch.load(weights_only=True)``), never through its helper methods. The results
(plain tensors and builtins) go back to the pytest process, which asserts on them.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stratagem.contract import _suite_model as m
from stratagem.contract._hf_weights import hf_weights
from stratagem.contract._training import (
    _clean_name,
    _clean_optimizer,
    _live,
    batches,
    build,
    checkpoint_path,
    held_after_step,
    observed_params,
    saved_full,
    train,
)

#: Seed of the model each load starts from: different from the saved one, so loading must overwrite it.
FRESH_SEED = 99


# -------------------------------------------------------------------------------------------------
# sections
# -------------------------------------------------------------------------------------------------


def collectives(engine: Any) -> dict[str, Any]:
    rank, world = engine.rank, engine.world_size
    x = torch.tensor([rank + 1.0, 2.0 * (rank + 1), -(rank + 1.0)])
    before = x.clone()
    out: dict[str, Any] = {
        "all_reduce": {op: engine.all_reduce(x, op) for op in ("sum", "mean", "max", "min")},
        "all_reduce_int_sum": engine.all_reduce(torch.tensor([rank + 1, 10 * (rank + 1)]), "sum"),
        "all_gather_1d": engine.all_gather(torch.arange(rank + 2, dtype=torch.float32) + 10 * rank),
        "all_gather_2d": engine.all_gather(torch.full((rank + 1, 3), float(rank))),
        "broadcast": engine.broadcast(
            {"sender": rank, "items": [rank] * 3, "text": f"from rank {rank}"} if rank == world - 1 else None,
            src=world - 1,
        ),
    }
    out["input_unchanged"] = torch.equal(x, before)
    # The last rank to arrive is rank 0, late on purpose: nobody may leave the barrier before it arrives.
    if rank == 0:
        time.sleep(0.3)
        out["barrier_arrived"] = time.time()
    engine.barrier("stratagem-contract")
    out["barrier_left"] = time.time()
    return out


def _has_full(spec: dict[str, Any]) -> bool:
    return "full" in spec["formats"]


def straight_run(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Training alone: ``STEPS_BEFORE_SAVE`` steps and the parameters then (saving is the next section)."""
    model, optimizer = build(engine, m.MODEL_SEED)
    data = batches(engine)
    _live.update(model=model, optimizer=optimizer, data=data)
    losses, norms = train(engine, model, optimizer, data, 0, m.STEPS_BEFORE_SAVE)
    tokens, targets = data[0]
    evaluated = engine.eval_batch(model, tokens, targets, m.loss_fn)
    return {
        "losses": losses,
        "norms": norms,
        "params": observed_params(model),
        "replicas": _live["replicas"],
        "eval_loss": float(engine.all_reduce(evaluated.loss.detach().float(), "mean")),
    }


def saving(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint in every declared format; the full one, read back, is what the round trip compares."""
    from stratagem.checkpoint import PerRank

    torch.manual_seed(1000 + engine.rank)
    rng = torch.get_rng_state()
    saved, save_errors = {}, {}
    for fmt in spec["formats"]:
        path = checkpoint_path(spec["workdir"], fmt)
        state = {
            "model": _live["model"],
            "optimizer": _live["optimizer"],
            "step": m.STEPS_BEFORE_SAVE,
            "rng": PerRank(rng),
            "note": "stratagem contract",
            "extra": torch.arange(3),
        }
        try:
            engine.save(path, state, format=fmt)
            saved[fmt] = path
        except Exception:
            save_errors[fmt] = traceback.format_exc()
    at_save = None
    if "full" in saved and engine.rank == 0:
        payload = torch.load(saved["full"], weights_only=True)
        at_save = {
            "params": {_clean_name(k): v for k, v in payload["model"]["model"].items()},
            "optimizer": _clean_optimizer(payload["optimizers"]["optimizer"]),
        }
    return {"rng": rng, "saved": saved, "save_errors": save_errors, "at_save": at_save}


def continued(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The remaining steps of the straight run, whatever the saving did."""
    model, optimizer, data = _live["model"], _live["optimizer"], _live["data"]
    losses, norms = train(engine, model, optimizer, data, m.STEPS_BEFORE_SAVE, m.STEPS_AFTER_SAVE)
    return {"losses": losses, "norms": norms, "params": observed_params(model)}


def final_state(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The straight run's end as a full checkpoint (the exact-resume check compares optimizer state)."""
    path = str(Path(spec["workdir"]) / "straight-final.pt")
    return {"": saved_full(engine, {"model": _live["model"], "optimizer": _live["optimizer"]}, path)}


def _load(engine: Any, path: str, spec: dict[str, Any], tag: str) -> dict[str, Any]:
    model, optimizer = build(engine, FRESH_SEED)
    rest = engine.load(path, {"model": model, "optimizer": optimizer})
    out: dict[str, Any] = {"remainder": m.plain_state(dict(rest)), "params": observed_params(model)}
    if _has_full(spec):
        out["loaded"] = saved_full(
            engine, {"model": model, "optimizer": optimizer}, f"{path}.{tag}.reloaded.pt"
        )
    _live.update(model=model, optimizer=optimizer)
    return out


def resume(engine: Any, spec: dict[str, Any], fmt: str) -> dict[str, Any]:
    path = checkpoint_path(spec["workdir"], fmt)
    if not Path(path).exists():
        raise FileNotFoundError(f"phase one left no {fmt} checkpoint at {path} (its save failed)")
    out = _load(engine, path, spec, "resume")
    model, optimizer = _live["model"], _live["optimizer"]
    start = int(out["remainder"].get("step", 0))
    out["losses"], out["norms"] = train(engine, model, optimizer, batches(engine), start, m.STEPS_AFTER_SAVE)
    out["final_params"] = observed_params(model)
    if _has_full(spec):
        out["final"] = saved_full(engine, {"model": model, "optimizer": optimizer}, f"{path}.final.pt")
    return out


def load_single_device(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    return _load(engine, spec["single_device_checkpoint"], spec, "single")


def trainer_run(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The Trainer around a model whose step calls its submodules directly (never ``self(x)``), with
    parameters at the root outside any block: what most user models look like."""
    from stratagem.trainer import Trainer

    trainer = Trainer(
        strategy=_strategy(spec),
        accelerator="cpu",
        devices=spec["world_size"],
        precision=spec["precision"],
        max_steps=m.STEPS_BEFORE_SAVE + m.STEPS_AFTER_SAVE,
        accumulate_grad_batches=m.ACCUMULATE,
        gradient_clip_val=m.MAX_NORM,
        default_root_dir=str(Path(spec["workdir"]) / "trainer"),
        enable_progress_bar=False,
        use_distributed_sampler=True,
    )
    module = m.build_step_module()
    loader = torch.utils.data.DataLoader(m.dataset(engine.world_size), batch_size=m.PER_RANK_BATCH)
    trainer.fit(module, loader)
    assert trainer.model is not None
    out: dict[str, Any] = {"params": observed_params(trainer.model), "step": trainer.global_step}
    if out["params"] is None and _has_full(spec):
        path = str(Path(spec["workdir"]) / "trainer-final.pt")
        trainer.save_checkpoint(path, format="full")
        engine.barrier("stratagem-contract-trainer-saved")
        if engine.rank == 0:
            payload = torch.load(path, weights_only=True)
            out["full"] = {"params": {_clean_name(k): v for k, v in payload["model"]["model"].items()}}
    return out


#: The compile section's options: Dynamo's tracing and AOTAutograd's graphs without inductor's code generation,
#: so the section costs seconds; the repository's own tests compile each strategy family with inductor too.
COMPILE = {"backend": "aot_eager"}


def compiled_run(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The straight run's training again, compiled in the framework's place (each block once): per-step losses
    and norms, the frames Dynamo compiled by the end of each step, and the full checkpoint's keys as written."""
    from stratagem.strategies.compiling import dynamo_counts

    # As in a process of its own: a strategy certified earlier in this worker (shared launches) compiled the
    # same blocks, and Dynamo would reuse that code instead of compiling under this strategy.
    torch._dynamo.reset()
    start = dynamo_counts()["frames"]
    model, optimizer = build(engine, m.MODEL_SEED, compile=COMPILE)
    regions = list(engine.compiled_regions)
    data = batches(engine)
    losses, norms, frames = [], [], []
    for step in range(m.STEPS_BEFORE_SAVE + m.STEPS_AFTER_SAVE):
        loss, norm = train(engine, model, optimizer, data, step, 1)
        losses += loss
        norms += norm
        frames.append(dynamo_counts()["frames"] - start)
    out: dict[str, Any] = {
        "regions": regions,
        "losses": losses,
        "norms": norms,
        "frames": frames,
        "params": observed_params(model),
        "keys": None,
    }
    if _has_full(spec):
        path = str(Path(spec["workdir"]) / "compiled.pt")
        engine.save(path, {"model": model, "optimizer": optimizer}, format="full")
        engine.barrier("stratagem-contract-compiled-saved")
        if engine.rank == 0:
            payload = torch.load(path, weights_only=True)
            out["keys"] = sorted(payload["model"]["model"])
            out["full"] = {"params": {_clean_name(k): v for k, v in payload["model"]["model"].items()}}
    return out


def _child_processes() -> list[str] | None:
    from stratagem.contract._processes import child_processes

    return child_processes(os.getpid())


def teardown(engine: Any) -> dict[str, Any]:
    import torch.distributed as dist

    port = engine.cluster.master_port
    engine.teardown()
    return {
        "process_group_alive": dist.is_available() and dist.is_initialized(),
        "children": _child_processes(),
        "master_port": port,
    }


# -------------------------------------------------------------------------------------------------
# entry point
# -------------------------------------------------------------------------------------------------


def _strategy(spec: dict[str, Any]) -> Any:
    """The registered name, or a fresh instance created with the options the suite was given."""
    if not spec.get("options"):
        return spec["strategy"]
    from stratagem.registry._manager import get_registry

    return get_registry().get(spec["strategy"]).create(**spec["options"])


def _section(result: dict[str, Any], name: str, function: Callable[[], Any]) -> None:
    start = time.perf_counter()
    try:
        result[name] = function()
    except Exception:
        result["errors"][name] = traceback.format_exc()
    # What each section costs the suite's time (the compile section is meant to stay a few seconds).
    result.setdefault("seconds", {})[name] = time.perf_counter() - start


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one phase in this worker; return this rank's results."""
    from stratagem.contract._recorder import HookRecorder
    from stratagem.engine import Engine

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    recorder = HookRecorder()
    engine = Engine(
        strategy=_strategy(spec),
        accelerator="cpu",
        devices=spec["world_size"],
        precision=spec["precision"],
        timeout=spec["timeout"],
        addons=[recorder],
    )
    engine.setup_environment()
    result: dict[str, Any] = {"rank": engine.rank, "pid": os.getpid(), "errors": {}}
    if spec["phase"] == 1:
        _section(result, "collectives", lambda: collectives(engine))
        if spec["train"]:
            # Separate sections: a failure while saving fails the checkpoint checks, never training's.
            _section(result, "straight", lambda: straight_run(engine, spec))
            _section(result, "saving", lambda: saving(engine, spec))
            _section(result, "continued", lambda: continued(engine, spec))
            if _has_full(spec):
                _section(result, "final", lambda: final_state(engine, spec))
            _section(result, "trainer", lambda: trainer_run(engine, spec))
            # What a rank holds after one step, for the plan's check (stratagem plan, test_plan).
            _section(result, "held", lambda: held_after_step(engine))
            if spec.get("compile"):
                _section(result, "compiled", lambda: compiled_run(engine, spec))
    else:
        if spec["train"]:
            for fmt in spec["formats"]:
                _section(result, f"resume_{fmt}", lambda fmt=fmt: resume(engine, spec, fmt))
            _section(result, "single_device", lambda: load_single_device(engine, spec))
            _section(result, "hf_weights", lambda: hf_weights(engine, spec))
    _section(result, "teardown", lambda: teardown(engine))
    result["calls"] = recorder.snapshot()
    return result


def run_phases(specs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run one phase for each spec in turn in this worker (strategies certified together); results by name."""
    return {spec["name"]: run_phase(spec) for spec in specs}

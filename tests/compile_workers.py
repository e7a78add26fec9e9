"""What ``test_compile_strategies.py`` runs in its workers: one launch per strategy trains the contract model
compiled for ten AdamW steps, then crosses checkpoints between compiled and plain models in both formats,
resumes a compiled run from step five, and has a Trainer fit the module given as ``torch.compile(module)``.
Results are plain tensors and numbers, returned from rank 0."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any

import torch

import stratagem as sg
from stratagem.contract import _suite_model as m

STEPS = 10
SAVE_AT = 5
PER_RANK_BATCH = 4
#: The Trainer's steps with a torch.compile'd module (against the first steps of the Engine's run).
TRAINER_STEPS = 3


def _build(engine: Any, seed: int, compile: Any) -> tuple[torch.nn.Module, Any]:
    with engine.init_module():
        model = m.build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.LEARNING_RATE)
    return engine.setup(model, optimizer, compile=compile)


def _data(engine: Any) -> tuple[list[Any], int]:
    loader = torch.utils.data.DataLoader(m.dataset(engine.world_size), batch_size=PER_RANK_BATCH)
    loader = engine.setup_dataloaders(loader)
    return list(loader), getattr(loader.sampler, "num_replicas", 1)


def _steps(
    engine: Any, model: Any, optimizer: Any, data: list[Any], steps: range, on_step: Any = None
) -> list[float]:
    losses = []
    for step in steps:
        tokens, targets = data[step]
        loss = m.loss_fn(model(tokens), targets)
        engine.backward(loss, model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(engine.all_reduce(loss.detach(), "mean")))
        if on_step is not None:
            on_step(step)
    return losses


def _full(engine: Any, state: dict[str, Any], path: Path) -> dict[str, torch.Tensor] | None:
    """The model's state as the strategy's own full checkpoint holds it (rank 0; keys as written)."""
    engine.save(str(path), state, format="full")
    engine.barrier("compile-test-saved")
    return torch.load(path, weights_only=True)["model"]["model"] if engine.rank == 0 else None


def run(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from stratagem.strategies.compiling import dynamo_counts

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    work, compile = Path(spec["workdir"]), spec["compile"]
    out: dict[str, Any] = {}
    start = dynamo_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = _build(engine, m.MODEL_SEED, compile)
        out["regions"] = list(engine.compiled_regions)
        data, out["replicas"] = _data(engine)
        frames: list[int] = []

        def after(step: int) -> None:
            frames.append(dynamo_counts()["frames"] - start["frames"])
            if step + 1 == SAVE_AT:
                state = {"model": model, "optimizer": optimizer, "step": SAVE_AT}
                engine.save(str(work / "at-5.pt"), state, format="full")

        out["losses"] = _steps(engine, model, optimizer, data, range(STEPS), after)
    out["frames"] = frames
    out["graph_breaks"] = dynamo_counts()["graph_breaks"] - start["graph_breaks"]
    out["reported"] = [str(w.message) for w in caught if "stratagem compile" in str(w.message)]
    state = {"model": model, "optimizer": optimizer}
    out["final"] = _full(engine, state, work / "final.pt")

    # Checkpoints across compiled and plain models, each format: bit-equal weights both ways.
    crossed: dict[str, Any] = {}
    for fmt in spec["formats"]:
        engine.save(str(work / f"compiled-{fmt}"), state, format=fmt)
        plain, plain_opt = _build(engine, 99, False)
        engine.load(str(work / f"compiled-{fmt}"), {"model": plain, "optimizer": plain_opt})
        into_plain = _full(engine, {"model": plain, "optimizer": plain_opt}, work / f"plain-{fmt}.pt")
        engine.save(str(work / f"plain-{fmt}"), {"model": plain, "optimizer": plain_opt}, format=fmt)
        again, again_opt = _build(engine, 98, compile)
        engine.load(str(work / f"plain-{fmt}"), {"model": again, "optimizer": again_opt})
        into_compiled = _full(engine, {"model": again, "optimizer": again_opt}, work / f"again-{fmt}.pt")
        crossed[fmt] = {"into_plain": into_plain, "into_compiled": into_compiled}
    out["crossed"] = crossed

    # Exact resume with compile on: a fresh compiled model from the step-5 checkpoint, five more steps.
    resumed, resumed_opt = _build(engine, 97, compile)
    rest = engine.load(str(work / "at-5.pt"), {"model": resumed, "optimizer": resumed_opt})
    out["resumed_losses"] = _steps(engine, resumed, resumed_opt, data, range(int(rest["step"]), STEPS))
    out["resumed"] = _full(engine, {"model": resumed, "optimizer": resumed_opt}, work / "resumed.pt")
    out["trainer"] = trainer_run(engine, spec)
    return out


class _Seen:
    """Each step's loss, averaged over the ranks, and the module callbacks see."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.modules: list[Any] = []

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        self.losses.append(float(trainer.engine.all_reduce(outputs.detach(), "mean")))
        self.modules.append(trainer.module)


def trainer_run(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """``trainer.fit(torch.compile(module, **options))``, as Lightning documents it: what the Trainer holds and
    compiled, the line it printed, its losses, and its full checkpoint's keys (rank 0)."""
    work = Path(spec["workdir"]) / "trainer"
    module = m.build_step_module(m.MODEL_SEED)
    seen = _Seen()
    trainer = sg.Trainer(
        strategy=spec["strategy"],
        accelerator="cpu",
        devices=engine.world_size,
        max_steps=TRAINER_STEPS,
        enable_progress_bar=False,
        loggers=[],
        default_root_dir=work,
        callbacks=[seen],
    )
    loader = torch.utils.data.DataLoader(m.dataset(engine.world_size), batch_size=PER_RANK_BATCH)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(torch.compile(module, **spec["compile"]), loader)
    trainer.save_checkpoint(work / "full.ckpt", format="full")
    out = {
        "holds_the_module": trainer.module is module and all(s is module for s in seen.modules),
        "regions": list(trainer.engine.compiled_regions),
        "printed": printed.getvalue().splitlines(),
        "losses": seen.losses,
    }
    if engine.rank == 0:
        out["keys"] = list(torch.load(work / "full.ckpt", weights_only=True)["model"]["model"])
    trainer.engine.teardown()
    return out


def reference(replicas: int, world_size: int) -> dict[str, Any]:
    """Ten AdamW steps of one eager process on the global batch (the samples every replica saw in a step)."""
    torch.manual_seed(0)
    model = m.build_model(m.MODEL_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.LEARNING_RATE)
    data = m.dataset(world_size)
    size = PER_RANK_BATCH * replicas
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses = []
    for step in range(STEPS):
        tokens, targets = data[step * size : (step + 1) * size]
        loss = m.loss_fn(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": dict(model.state_dict()), "initial": initial}

"""The pipeline runs of the tests, through the Trainer (and one custom loop through ``Engine.train_batch``), and
the launches that batch them: module-level, so that spawned workers import them.

Launch A (2 processes): ``pp`` at 2 stages with every schedule (4 stages, 2 per rank, for the interleaved ones),
a model built on the meta device, a tiny Hugging Face Llama split by its own plan, a custom loop, checkpoints
(exact resume, a full checkpoint, the sharded one loaded under ``fsdp``), predict, epochs with a shorter last
batch, and bad input. Launch B (4 processes): ``pp`` at 4 stages, ``pp_fsdp`` 2 x 2 and ``pp_fsdp_tp`` 2 x 1 x 2
(each with predict), launch A's checkpoints loaded at 4 stages, the demo under ``pp_fsdp``. Launch C: a rank that
dies in the middle of a schedule.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pp_workers as w
import torch

import stratagem as sg

#: The run whose checkpoints the other checks load: a checkpoint every CKPT_EVERY steps, the state then kept.
CKPT_RUN, CKPT_EVERY = "1f1b/1", 5


class Record:
    """Each batch's loss as the Trainer hands it to callbacks, and the state at one checkpoint."""

    def __init__(self, snapshot_at: int | None = None) -> None:
        self.losses: list[float] = []
        self.snapshot_at, self.snapshot = snapshot_at, None

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        self.losses.append(float(outputs))

    @sg.hookimpl
    def on_save_checkpoint(self, trainer: Any, path: str, state: dict[str, Any]) -> None:
        if trainer.global_step == self.snapshot_at:  # every rank: the gathering is a collective
            self.snapshot = {
                "params": w.gathered_params(trainer.model),
                "optimizer": w.gathered_optimizer(trainer.model, trainer.optimizers[0]),
            }


def trainer(strategy: Any, devices: int, root: str, **options: Any) -> sg.Trainer:
    return sg.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=w.STEPS,
        gradient_clip_val=w.MAX_NORM,
        default_root_dir=root,
        enable_progress_bar=False,
        loggers=[],
        # A rank stuck in a schedule ends the launch (the watchdog names it) instead of the test's timeout.
        timeout=90,
        **options,
    )


def fit(
    strategy: Any,
    devices: int,
    root: str,
    *,
    module_fn: Any = w.make_module,
    data: list | None = None,
    dp: int = 1,
    val_batches: int = 1,
    empty_init: bool = False,
    snapshot_at: int | None = None,
    ckpt_path: str | None = None,
    callbacks: tuple[Any, ...] = (),
    **options: Any,
) -> dict[str, Any]:
    """``Trainer.fit`` for 10 AdamW steps with clipping, then ``Trainer.validate`` on the first batches."""
    record = Record(snapshot_at)
    t = trainer(strategy, devices, root, callbacks=[record, *callbacks], **options)
    if empty_init:
        torch.manual_seed(0)
        with t.init_module(empty_init=True):
            module = module_fn()
    else:
        module = module_fn()
    data = data if data is not None else w.batches()
    per_process = data[0][0].shape[0] // dp
    t.fit(module, w.loader(data, per_process), ckpt_path=ckpt_path)
    validated = t.validate(module, w.loader(data[:val_batches], per_process))
    s = t.strategy
    out = {
        "params": w.gathered_params(t.model),
        "losses": record.losses,
        "eval_loss": validated["val_loss"],
        "snapshot": record.snapshot,
        "step": t.global_step,
        "local_shapes": w.local_shapes(t.model),
        "stages": [list(stage) for stage in s.applied["split"].stages],
        "source": s.applied["split"].source,
        "local_stages": s.applied["local_stages"],
        "units": s.applied["units"],
        "tp_styles": s.applied["tp_styles"],
        "mesh": (tuple(s.device_mesh.shape), tuple(s.device_mesh.mesh_dim_names)),
        "sampler": s.distributed_sampler_kwargs(),
        "microbatches": s.microbatches,
        "checkpointed": s.applied["checkpointed"],
        "trainer": t,
    }
    return out


def done(result: dict[str, Any]) -> dict[str, Any]:
    """Leave the run's process group; what goes back to the test."""
    result.pop("trainer").engine.teardown()
    return result


def engine_loop(strategy: Any, devices: int) -> dict[str, Any]:
    """A custom loop: ``Engine.train_batch`` (the pipeline's own step), the strategy's clipping, AdamW."""
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=devices)
    model = w.make_model()
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=w.LR))
    losses = []
    for inputs, targets in w.batches():
        result = engine.train_batch(model, inputs, targets, w.loss_fn)
        engine.clip_gradients(model, opt, w.MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(float(result.loss))
    evaluated = engine.eval_batch(model, w.batches()[0][0], w.batches()[0][1], w.loss_fn)
    out = {"params": w.gathered_params(model), "losses": losses, "eval_loss": float(evaluated.loss)}
    engine.teardown()
    return out


def loaded(strategy: Any, devices: int, path: str) -> dict[str, Any]:
    """A fresh model (another seed) and AdamW under ``strategy``, filled from ``path`` by ``Engine.load``."""
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=devices, timeout=90)
    model = w.make_model(seed=5)
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=w.LR))
    rest = engine.load(path, {"model": model, "optimizer": opt})
    out = {
        "params": w.gathered_params(model),
        "optimizer": w.gathered_optimizer(model, opt),
        "step": int(rest["progress"]["step"]),
    }
    engine.teardown()
    return out


def error_of(function: Any) -> str | None:
    try:
        function()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def compiled_then_predicted(root: str) -> dict[str, Any]:
    """Zero bubble (2 stages per rank, split backward) with activation checkpointing, the module given as
    ``torch.compile(module, backend="aot_eager")`` (as Lightning documents it; fit and validate take it): what
    each rank compiled and the line rank 0 printed; a full checkpoint (stages 0 and 2 on rank 0: names out of
    model order there); then ``Trainer.predict`` on batches of tokens alone (the last stage on rank 1)."""
    import contextlib
    import io

    import torch._dynamo
    import torch.distributed as dist

    from stratagem.strategies.compiling import dynamo_counts
    from stratagem_pp import PPStrategy

    torch._dynamo.reset()
    start = dynamo_counts()["frames"]
    strategy = PPStrategy(schedule="zero_bubble", activation_checkpointing_policy={w.Block})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = fit(strategy, 2, root, module_fn=lambda: torch.compile(w.make_module(), backend="aot_eager"))
    t = result["trainer"]
    mine = {
        "printed": printed.getvalue().splitlines(),
        "holds": type(t.module).__name__,
        "regions": list(t.engine.compiled_regions),
        "by_stage": t.strategy.applied["compiled"],
        "frames": dynamo_counts()["frames"] - start,
    }
    result["ranks"] = [None] * dist.get_world_size()
    dist.all_gather_object(result["ranks"], mine)
    full = f"{root}/full.ckpt"
    t.save_checkpoint(full, format="full")
    if dist.get_rank() == 0:
        payload = torch.load(full, weights_only=True)
        optimizer = payload["optimizers"]["optimizer"]
        result["full_order"] = {
            "model": [w.clean(k) for k in payload["model"]["model"]],
            "optimizer_state": [w.clean(k) for k in optimizer["state"]],
            "optimizer_groups": [[w.clean(k) for k in g["params"]] for g in optimizer["param_groups"]],
        }
    return done(predicted(result, 12))


def predicted(result: dict[str, Any], count: int, per_process: int = w.GLOBAL_BATCH) -> dict[str, Any]:
    """``Trainer.predict`` after ``fit``, on ``count`` samples of tokens alone (each data-parallel replica
    predicts its share; rank 0 puts them back in dataset order). A count that ``per_process`` does not divide
    ends each share with a shorter batch."""
    tokens = torch.cat([x for x, _ in w.batches()[:2]])[:count]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=per_process)
    result.update(predictions=result["trainer"].predict(dataloaders=loader), predict_tokens=tokens)
    return result


class StepOnly(w.TinyLM, sg.Module):
    """A module written with a training step only: a pipeline cannot call it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return w.loss_fn(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=w.LR)


def refused(
    strategy: Any,
    root: str,
    module_fn: Any = w.make_module,
    devices: int = 2,
    loader: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """What ``fit`` raises, and how far training got (nothing, if refused before the first batch)."""
    record = Record()
    t = trainer(strategy, devices, root, callbacks=[record], **options)
    message = error_of(lambda: t.fit(module_fn(), loader or w.loader()))
    t.engine.teardown()
    return {"error": message, "batches": len(record.losses)}


# -------------------------------------------------------------------------------------------------
# launches
# -------------------------------------------------------------------------------------------------


def two_process_checks(engine: sg.Engine, root: str) -> dict[str, Any]:
    from stratagem_pp import PPStrategy

    out: dict[str, Any] = {}
    for schedule, spr in w.TWO_PROCESS_SCHEDULES:
        key = f"{schedule}/{spr}"
        options = (
            {"snapshot_at": CKPT_EVERY, "checkpoint_every_n_steps": CKPT_EVERY} if key == CKPT_RUN else {}
        )
        strategy = PPStrategy(schedule=schedule, stages_per_rank=spr)
        w.guard(out, key, lambda k=key, s=strategy, o=options: done(fit(s, 2, f"{root}/{k}", **o)))
    ckpt = Path(root, CKPT_RUN, "checkpoints")
    # Exact resume from the step-5 checkpoint in a new Trainer, then a full checkpoint of the end.
    full = f"{root}/final-full.ckpt"

    def resumed() -> dict[str, Any]:
        result = fit(PPStrategy(), 2, f"{root}/resumed", ckpt_path=str(ckpt / f"step-{CKPT_EVERY:06d}"))
        result["trainer"].save_checkpoint(full, format="full")
        if engine.rank == 0:
            payload = torch.load(full, weights_only=True)
            result["full_file"] = {w.clean(k): v for k, v in payload["model"]["model"].items()}
        return done(result)

    w.guard(out, "resumed", resumed)
    w.guard(out, "fsdp_loads", lambda: loaded("fsdp", 2, str(ckpt / f"step-{CKPT_EVERY:06d}")))
    w.guard(out, "meta_init", lambda: done(fit(PPStrategy(), 2, f"{root}/meta", empty_init=True)))
    w.guard(
        out,
        "llama",
        lambda: done(
            fit(PPStrategy(), 2, f"{root}/llama", module_fn=w.make_llama_module, data=w.llama_data())
        ),
    )
    w.guard(out, "engine_loop", lambda: engine_loop(PPStrategy(schedule="gpipe"), 2))
    w.guard(out, "compiled", lambda: compiled_then_predicted(f"{root}/compiled"))
    # Epochs of 12 samples in batches of 8: every other step, and in validation, a shorter batch of 4.
    w.guard(
        out,
        "shorter_batches",
        lambda: done(fit(PPStrategy(), 2, f"{root}/short", data=w.uneven_batches()[:2], val_batches=2)),
    )
    out["bad"] = {
        "microbatches": refused(PPStrategy(microbatches=3), f"{root}/bad1"),
        "step_only": refused(PPStrategy(), f"{root}/bad2", StepOnly),
        "stages": refused(PPStrategy(schedule="interleaved_1f1b", stages_per_rank=8), f"{root}/bad3"),
    }
    return out if engine.rank == 0 else {}


def four_process_checks(engine: sg.Engine, root: str, checkpoints: dict[str, str]) -> dict[str, Any]:
    from stratagem.cli.demo.lm import run as demo
    from stratagem_pp import PPFSDPStrategy, PPFSDPTPStrategy, PPStrategy

    out: dict[str, Any] = {}
    for schedule in ("1f1b", "interleaved_1f1b"):
        w.guard(
            out, f"pp4/{schedule}", lambda s=schedule: done(fit(PPStrategy(schedule=s), 4, f"{root}/{s}"))
        )
    w.guard(
        out,
        "pp_fsdp",
        lambda: done(predicted(fit(PPFSDPStrategy(pipeline_parallel_size=2), 4, f"{root}/f", dp=2), 10, 4)),
    )
    w.guard(
        out,
        "pp_fsdp_meta_resharding",
        lambda: done(fit(PPFSDPStrategy(reshard_after_forward=True), 4, f"{root}/m", dp=2, empty_init=True)),
    )
    w.guard(
        out,
        "pp_fsdp_checkpointing",
        lambda: done(
            fit(
                PPFSDPStrategy(schedule="zero_bubble", activation_checkpointing_policy={w.Block}),
                4,
                f"{root}/c",
                dp=2,
            )
        ),
    )
    tp = PPFSDPTPStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, tp_plan=w.TP_PLAN)
    w.guard(out, "pp_fsdp_tp", lambda: done(predicted(fit(tp, 4, f"{root}/t"), 12)))
    for name, path in checkpoints.items():
        w.guard(out, f"pp4_loads_{name}", lambda p=path: loaded(PPStrategy(), 4, p))
    w.guard(
        out,
        "demo_pp_fsdp",
        lambda: demo(strategy="pp_fsdp", devices=4, steps=6, root_dir=f"{root}/demo", progress_bar=False),
    )
    out["bad_size"] = error_of(
        lambda: sg.Engine(
            strategy=PPFSDPStrategy(pipeline_parallel_size=3), accelerator="cpu", devices=4
        ).setup_environment()
    )
    # Each replica's epoch: 6 samples, a batch of 4 then one of 2, accumulated into one step.
    out["bad_accumulation"] = refused(
        PPFSDPStrategy(),
        f"{root}/bad",
        devices=4,
        loader=w.loader(w.uneven_batches()[:2], 4),
        accumulate_grad_batches=2,
    )
    return out if engine.rank == 0 else {}


class DieMidSchedule:
    """On rank 1: the second micro-batch's forward of step ``step`` on its first stage ends the process."""

    def __init__(self, step: int = 3) -> None:
        self.step = step

    @sg.hookimpl
    def on_fit_start(self, trainer: Any) -> None:
        if trainer.engine.rank != 1:
            return
        seen = []

        def hook(module: Any, args: Any) -> None:
            seen.append(1)
            if trainer.global_step == self.step and len(seen) >= 2:
                os._exit(7)
            if trainer.global_step < self.step:
                seen.clear()

        trainer.strategy.applied["views"][0].register_forward_pre_hook(hook)


def dying_rank(engine: sg.Engine, root: str) -> dict[str, Any]:
    from stratagem_pp import PPStrategy

    return done(fit(PPStrategy(schedule="1f1b"), 2, root, callbacks=(DieMidSchedule(),)))

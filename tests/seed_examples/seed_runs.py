"""The one launch of test_trainer_seed_examples.py: in the same two worker processes, one Trainer after another,

- fit, test and predict (after fit, from ``"best"``, ``"last"`` and a path, in a fresh Trainer) under ddp, fsdp,
  tp and deepspeed_stage_3, with ``save_hyperparameters`` in every checkpoint, some written to S3;
- ``precision="16-true"`` under ddp, fsdp and tp;
- seeds 000 / 001: FSDP auto-wrap, activation checkpointing by policy and by hand, manual wrapping with torch's
  ``wrap`` (under fsdp, and under ddp where it does nothing);
- seed 004: the DDP communication hooks.

Each example returns what its test checks, or the error it raised (one failing example does not hide the
others). Rank 0's results come back to the test process.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from seed_models import (
    MICRO,
    BlockModel,
    EncoderDecoder,
    MyModel,
    MyTransformerBlock,
    Regression,
    eval_dataset,
    train_loader,
)
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem.callbacks import ModelCheckpoint
from stratagem.trainer._run_dir import checkpoint_name

STEPS = 4
EVAL_STEPS = 6


def _trainer(strategy: Any, root: Path, steps: int = STEPS, **options: Any) -> sg.Trainer:
    return sg.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        enable_progress_bar=False,
        default_root_dir=str(root),
        seed=0,
        **options,
    )


def _params(trainer: sg.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.strategy.module_state_dict(trainer.model, full=True).items()}


def _guarded(out: dict[str, Any], name: str, example: Callable[[], Any]) -> None:
    try:
        out[name] = example()
    except Exception:
        out[name] = {"error": traceback.format_exc()}


def run_all(engine: Any, workdir: str, s3_url: str | None) -> dict[str, Any]:
    root, out = Path(workdir), {}
    strategies = ["ddp", "fsdp", "tp"]
    if importlib.util.find_spec("deepspeed") is not None:
        strategies.append("deepspeed_stage_3")
    for name in strategies:
        _guarded(out, f"eval/{name}", lambda name=name: _test_and_predict(name, root / name, s3_url))
    for name in ("ddp", "fsdp", "tp"):
        _guarded(out, f"16-true/{name}", lambda name=name: _sixteen_true(name, root / f"16-{name}"))
    _guarded(out, "seed000/auto_wrap", lambda: _auto_wrap(root / "auto_wrap"))
    _guarded(out, "seed001/encoder_decoder", lambda: _encoder_decoder(root / "encdec"))
    _guarded(out, "seed000/checkpointing_policy", lambda: _checkpointing_policy(root / "ac_policy"))
    _guarded(out, "seed000/manual_wrap", lambda: _manual_wrap("fsdp", root / "manual_fsdp", False))
    _guarded(out, "seed000/manual_wrap_checkpointing", lambda: _manual_wrap("fsdp", root / "manual_ac", True))
    _guarded(out, "seed000/manual_wrap_ddp", lambda: _manual_wrap("ddp", root / "manual_ddp", False))
    _guarded(
        out, "seed000/manual_wrap_fsdp_tp", lambda: _manual_wrap("fsdp_tp", root / "manual_fsdp_tp", False)
    )
    _guarded(out, "seed000/wrap_overrides", lambda: _wrap_overrides(root / "wrap_overrides"))
    for hook in ("fp16", "powersgd", "powersgd_fp16", "post_local_sgd"):
        _guarded(out, f"seed004/{hook}", lambda hook=hook: _comm_hook(hook, root / hook))
    return out


# -------------------------------------------------------------------------------------------------
# test and predict (seed 004, DeepSpeed ZeRO stage 3: "trainer.fit(model); trainer.test(); trainer.predict()")
# -------------------------------------------------------------------------------------------------


def _eval_loader() -> DataLoader:
    return DataLoader(eval_dataset(), batch_size=MICRO)


def _test_and_predict(strategy: str, root: Path, s3_url: str | None) -> dict[str, Any]:
    model = Regression()
    # mode="max": the "best" is the first validation's weights, so that loading it visibly changes the metric
    # (the loss falls at every validation: by "min" the best would be the final weights).
    checkpoint = ModelCheckpoint(monitor="val_loss", mode="max")
    trainer = _trainer(
        strategy,
        root,
        steps=EVAL_STEPS,
        val_check_interval=2,
        checkpoint_every_n_steps=EVAL_STEPS,
        checkpoint_format="sharded" if strategy != "ddp" else "full",
        callbacks=[checkpoint],
    )
    data = eval_dataset()
    trainer.fit(model, DataLoader(data, batch_size=MICRO, shuffle=True), _eval_loader())
    out: dict[str, Any] = {"params": _params(trainer), "best_scores": [e[1] for e in checkpoint.best]}
    out["test"] = trainer.test(dataloaders=_eval_loader())
    out["predict"] = trainer.predict(dataloaders=DataLoader(data, batch_size=MICRO, shuffle=True))
    out["best"] = str(checkpoint.best_checkpoint(trainer))
    out["best_model_path"] = checkpoint.best_model_path
    out["test_best"] = trainer.test(dataloaders=_eval_loader(), ckpt_path="best")
    out["predict_last"] = trainer.predict(dataloaders=_eval_loader(), ckpt_path="last")
    out["last"] = str(trainer.checkpoint_dir / checkpoint_name(EVAL_STEPS, trainer.checkpoint_format))
    if s3_url is not None and strategy in ("ddp", "fsdp"):
        out["s3"] = f"{s3_url}/{strategy}" + (".ckpt" if strategy == "ddp" else "")
        trainer.save_checkpoint(out["s3"])
    # Seed 004: "trainer.test(ckpt_path=...)" in a Trainer that never trained this model.
    fresh = _trainer(strategy, root / "fresh")
    out["fresh_validate"] = fresh.validate(Regression(), _eval_loader(), ckpt_path=out["last"])
    out["fresh_test"] = fresh.test(dataloaders=_eval_loader(), ckpt_path=out["best"])
    out["fresh_predict"] = fresh.predict(dataloaders=_eval_loader())
    return out


# -------------------------------------------------------------------------------------------------
# 16-true
# -------------------------------------------------------------------------------------------------


def _sixteen_true(strategy: str, root: Path) -> dict[str, Any]:
    model = Regression(optimizer="sgd", lr=0.05)
    trainer = _trainer(strategy, root, precision="16-true")
    trainer.fit(model, DataLoader(eval_dataset(), batch_size=MICRO))
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    return {"params": _params(trainer), "param_dtypes": dtypes, "step_dtypes": sorted(model.seen_dtypes)}


# -------------------------------------------------------------------------------------------------
# seeds 000 / 001: FSDP
# -------------------------------------------------------------------------------------------------


def _units(model: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))


def _checkpointed(model: torch.nn.Module) -> list[str]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return sorted(name for name, m in model.named_modules() if isinstance(m, CheckpointWrapper))


def _fsdp_run(strategy: Any, model: sg.Module, root: Path) -> dict[str, Any]:
    trainer = _trainer(strategy, root)
    trainer.fit(model, train_loader())
    calls = [m.calls for m in model.modules() if isinstance(m, MyTransformerBlock)]
    return {
        "params": _params(trainer),
        "units": _units(trainer.model),
        "checkpointed": _checkpointed(trainer.model),
        "block_calls": calls,
    }


def _auto_wrap(root: Path) -> dict[str, Any]:
    from stratagem_fsdp import FSDPStrategy

    # Seed 000: "fsdp = FSDPStrategy(auto_wrap_policy={MyTransformerBlock})".
    return _fsdp_run(FSDPStrategy(auto_wrap_policy={MyTransformerBlock}), BlockModel(), root)


def _encoder_decoder(root: Path) -> dict[str, Any]:
    import torch.nn as nn

    from stratagem_fsdp import FSDPStrategy

    # Seed 001: "policy = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}", and "it is typical to set
    # the activation_checkpointing_policy the same as auto_wrap_policy".
    policy = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    strategy = FSDPStrategy(auto_wrap_policy=policy, activation_checkpointing_policy=policy)
    return _fsdp_run(strategy, EncoderDecoder(), root)


def _checkpointing_policy(root: Path) -> dict[str, Any]:
    from stratagem_fsdp import FSDPStrategy

    # Seed 000: "fsdp = FSDPStrategy(activation_checkpointing_policy={MyTransformerBlock})".
    return _fsdp_run(FSDPStrategy(activation_checkpointing_policy={MyTransformerBlock}), BlockModel(), root)


def _manual_wrap(strategy: str, root: Path, checkpointing: bool) -> dict[str, Any]:
    return _fsdp_run(strategy, MyModel(checkpointing=checkpointing), root)


def _wrap_overrides(root: Path) -> dict[str, Any]:
    from torch.distributed.fsdp.wrap import wrap

    class Overrides(MyModel):
        def configure_model(self) -> None:
            self.model = wrap(torch.nn.Linear(32, 32), cpu_offload=True)

    try:
        _trainer("fsdp", root).fit(Overrides(), train_loader())
    except sg.ConfigurationError as error:
        return {"raised": str(error)}
    return {"raised": None}


# -------------------------------------------------------------------------------------------------
# seed 004: DDP communication hooks
# -------------------------------------------------------------------------------------------------


def _hook_strategy(hook: str) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    from stratagem_ddp import DDPStrategy

    if hook == "fp16":
        return DDPStrategy(ddp_comm_hook=default.fp16_compress_hook)
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=5000)
    if hook == "powersgd":
        return DDPStrategy(ddp_comm_state=state, ddp_comm_hook=powerSGD.powerSGD_hook)
    if hook == "powersgd_fp16":
        return DDPStrategy(
            ddp_comm_state=state,
            ddp_comm_hook=powerSGD.powerSGD_hook,
            ddp_comm_wrapper=default.fp16_compress_wrapper,
        )
    return DDPStrategy(
        ddp_comm_state=post_localSGD.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=8
        ),
        ddp_comm_hook=post_localSGD.post_localSGD_hook,
        model_averaging_period=4,
    )


def _comm_hook(hook: str, root: Path) -> dict[str, Any]:
    strategy = _hook_strategy(hook)
    steps = 12 if hook == "post_local_sgd" else STEPS
    trainer = _trainer(strategy, root, steps=steps)
    model = BlockModel()
    trainer.fit(model, train_loader())
    logged = trainer.model._get_ddp_logging_data()
    optimizer = trainer.optimizers[0]
    inner = getattr(optimizer, "optimizer", optimizer)
    averager = getattr(inner, "averager", None)
    state = strategy.config.ddp_comm_state
    return {
        "params": _params(trainer),
        "comm_hook": logged.get("comm_hook"),
        "optimizer": type(inner).__name__,
        "averager": None if averager is None else [averager.period, averager.warmup_steps, averager.step],
        "state_iter": getattr(state, "iter", None),
    }

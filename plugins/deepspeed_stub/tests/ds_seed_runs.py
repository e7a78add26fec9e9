"""The launch of test_seed_examples.py: every DeepSpeed example of seed 004 with ``Trainer.fit``, one after the
other in the same two worker processes, and what each shows collected for the test (rank 0's return value).

The models, data and references are in ds_seed_workers.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from ds_seed_workers import (
    CONFIG_RESUME_AT,
    CONFIG_STEPS,
    MICRO,
    NVME_WIDTH,
    SEED_CONFIG,
    STEPS,
    WORLD,
    BothOptimizersModel,
    ConfigOptimizerModel,
    MyModel,
    TorchSchedulerModel,
    count_synchronize,
    dataset,
)

import stratagem as sg


def _fit(
    strategy: Any, model: MyModel, root: Path, steps: int = STEPS, ckpt_path: Any = None, **options: Any
) -> sg.Trainer:
    trainer = sg.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        max_steps=steps,
        enable_progress_bar=False,
        default_root_dir=str(root),
        **options,
    )
    trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=MICRO), ckpt_path=ckpt_path)
    return trainer


def _params(trainer: sg.Trainer) -> dict[str, torch.Tensor]:
    return trainer.strategy.module_state_dict(trainer.model, full=True)


def _outcome(trainer: sg.Trainer, model: MyModel) -> dict[str, Any]:
    return {"params": _params(trainer), "built": model.built, "seen": model.seen, "lrs": model.lrs}


def _nvme_files(nvme: Path) -> dict[str, int]:
    return {str(f.relative_to(nvme)): f.stat().st_size for f in sorted(nvme.rglob("*.swp")) if f.is_file()}


def _engine_of(trainer: sg.Trainer) -> Any:
    return trainer.model.__dict__["engine"]


def seed_examples(engine: Any, workdir: str, config_file: str, with_nvme: bool = True) -> dict[str, Any]:
    """Every DeepSpeed example of the seed, one Trainer each, in this launch's two processes (the NVMe one
    only ``with_nvme``: where libaio is installed)."""
    count_synchronize()
    root, out = Path(workdir), {}
    # "Shard Model Instantly": configure_model under deepspeed_stage_3 (no activation setting: the control).
    model = MyModel(checkpointing="non_reentrant")
    out["stage_3"] = _outcome(_fit("deepspeed_stage_3", model, root / "stage_3"), model)
    # "DeepSpeed ZeRO Stage 3 Offload", both spellings (the name, and the options it presets).
    model = MyModel()
    out["stage_3_offload"] = _outcome(_fit("deepspeed_stage_3_offload", model, root / "offload"), model)
    # "DeepSpeed Infinity (NVMe Offloading)", with a folder of the local disk for the drive, and the tuning
    # options at values other than their defaults, to be read back from DeepSpeed's parsed config.
    if with_nvme:
        out["nvme"] = _nvme_run(engine, root)
    out.update(_activation_runs(root))
    out["config"] = _config_file_runs(root, config_file)
    out["errors"] = _error_runs(root, config_file)
    return out if engine.rank == 0 else {}


def _nvme_run(engine: Any, root: Path) -> dict[str, Any]:
    from stratagem_deepspeed import DeepSpeedStrategy

    nvme = root / "local_nvme"
    nvme.mkdir(exist_ok=True)
    strategy = DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        remote_device="nvme",
        offload_params_device="nvme",
        offload_optimizer_device="nvme",
        nvme_path=str(nvme),
        params_buffer_count=4,
        params_buffer_size=600_000,
        max_in_cpu=0,
        optimizer_buffer_count=5,
        block_size=524_288,
        queue_depth=4,
        single_submit=True,
        overlap_events=False,
        thread_count=2,
        pin_memory=False,
        sub_group_size=500_000_000,
        logging_batch_size_per_gpu=MICRO,
    )
    model = MyModel(NVME_WIDTH)
    trainer = _fit(strategy, model, root / "nvme")
    ds = _engine_of(trainer)
    parsed = ds._config.zero_config
    return {
        **_outcome(trainer, model),
        "files": _gather(engine, _nvme_files(nvme)),
        "swapped_out": _gather(
            engine, [str(getattr(p.ds_tensor, "final_location", None)) for p in trainer.module.parameters()]
        ),
        "parsed": {
            "aio": dict(ds._config.aio_config),
            "offload_param": parsed.offload_param.model_dump(),
            "offload_optimizer": parsed.offload_optimizer.model_dump(),
            "sub_group_size": parsed.sub_group_size,
            "micro_batch": ds.train_micro_batch_size_per_gpu(),
            "throughput_batch": ds.tput_timer.batch_size,
            "remote_device": str(trainer.module.block_1[0].weight.ds_tensor.final_location),
        },
    }


def _activation_runs(root: Path) -> dict[str, Any]:
    """ "DeepSpeed Activation Checkpointing": the seed's strategy, then every activation option on."""
    from stratagem_deepspeed import DeepSpeedStrategy

    out = {}
    model = MyModel(checkpointing="reentrant")
    strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, cpu_checkpointing=True)
    out["cpu_checkpointing"] = _outcome(_fit(strategy, model, root / "cpu_checkpointing"), model)
    model = MyModel(checkpointing="non_reentrant")
    strategy = DeepSpeedStrategy(
        stage=2,
        partition_activations=True,
        cpu_checkpointing=True,
        contiguous_memory_optimization=True,
        number_checkpoints=1,
        synchronize_checkpoint_boundary=True,
    )
    out["all_activation_options"] = _outcome(_fit(strategy, model, root / "activations"), model)
    return out


def _error_runs(root: Path, config_file: str) -> dict[str, str | None]:
    """Both an optimizer section and configure_optimizers; a config scheduler and a torch one."""
    from stratagem.errors import ConfigurationError
    from stratagem_deepspeed import DeepSpeedStrategy

    errors = {}
    for name, cls, config in (
        ("both_optimizers", BothOptimizersModel, config_file),
        ("both_schedulers", TorchSchedulerModel, {"scheduler": SEED_CONFIG["scheduler"]}),
    ):
        try:
            _fit(DeepSpeedStrategy(config=config), cls(), root / name)
            errors[name] = None
        except ConfigurationError as error:
            errors[name] = str(error)
    return errors


def _config_file_runs(root: Path, config_file: str) -> dict[str, Any]:
    """The config's optimizer and scheduler, trained straight through; then resumed halfway from the
    DeepSpeed-format checkpoint, and from a full one."""
    from stratagem_deepspeed import DeepSpeedStrategy

    def fit(name: str, steps: int = CONFIG_STEPS, **options: Any) -> tuple[sg.Trainer, MyModel]:
        model = ConfigOptimizerModel()
        return _fit(DeepSpeedStrategy(config=config_file), model, root / name, steps, **options), model

    straight, model = fit("straight", checkpoint_every_n_steps=CONFIG_RESUME_AT)
    out = {"straight": _outcome(straight, model)}
    out["optimizer_class"] = type(_engine_of(straight).basic_optimizer).__name__
    out["scheduler_class"] = type(_engine_of(straight).lr_scheduler).__name__
    halfway = Path(straight.checkpoint_dir) / f"step-{CONFIG_RESUME_AT:06d}"
    resumed, model = fit("resumed_sharded", ckpt_path=str(halfway))
    out["resumed_sharded"] = _outcome(resumed, model)
    first, _ = fit(
        "full_first_half",
        steps=CONFIG_RESUME_AT,
        checkpoint_format="full",
        checkpoint_every_n_steps=CONFIG_RESUME_AT,
    )
    full = Path(first.checkpoint_dir) / f"step-{CONFIG_RESUME_AT:06d}.ckpt"
    resumed, model = fit("resumed_full", ckpt_path=str(full), checkpoint_format="full")
    out["resumed_full"] = _outcome(resumed, model)
    if os.environ.get("RANK") == "0":
        saved = torch.load(full, weights_only=True)["optimizers"]
        out["full_scheduler_state"] = {k: v.get("lr_scheduler") for k, v in saved.items()}
    return out


def _gather(engine: Any, value: Any) -> list[Any]:
    gathered: list[Any] = [None] * engine.world_size
    torch.distributed.all_gather_object(gathered, value)
    return gathered

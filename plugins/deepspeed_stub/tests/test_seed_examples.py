"""Seed 004's DeepSpeed examples under stratagem, on 2 CPU processes with the real deepspeed package: stage 3
with ``configure_model``, stage 3 offload to CPU, ZeRO-Infinity offload to NVMe (a folder of the local disk),
activation checkpointing with ``deepspeed.checkpointing.checkpoint``, and the config file that brings its own
optimizer and scheduler. One launch runs them all (ds_seed_workers.seed_examples); each test checks one.

Every run is compared with one process of plain torch on the global batch (ds_seed_workers.reference).
"""

from __future__ import annotations

import importlib.util
import json
import math
from typing import Any

import ds_seed_workers as w
import pytest
import torch
from ds_seed_runs import seed_examples

import stratagem as sg

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.multiprocess,
    # A fresh machine first compiles DeepSpeed's asynchronous I/O op (2-3 minutes on 2 cores).
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]

#: fp32 ZeRO differs from one process on the global batch only in the order of float32 sums: relative distances
#: of 5e-8 (3e-7 for the wide NVMe model) were measured; 6 AdamW steps at lr 1e-2 move the parameters by 0.07 to
#: 0.28 in the same measure (checked with each use), so an untrained or wrongly scaled run fails.
TOL = 1e-5


def _libaio() -> bool:
    """Whether DeepSpeed can build its asynchronous I/O op here (libaio's headers and library)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("seed_examples")
    config_file = workdir / "deepspeed_config.json"
    config_file.write_text(json.dumps(w.SEED_CONFIG))
    engine = sg.Engine(strategy="deepspeed_stage_2", accelerator="cpu", devices=2, timeout=600)
    return engine.launch(seed_examples, str(workdir), str(config_file), _libaio())


@pytest.fixture
def nvme_run(runs: dict[str, Any]) -> dict[str, Any]:
    if "nvme" not in runs:
        pytest.skip("libaio is not installed (apt-get install libaio-dev): DeepSpeed cannot build its AIO op")
    return runs["nvme"]


def _gap(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The distance between two parameter sets, relative to the size of the reference."""
    assert sorted(got) == sorted(want)
    return _norm({k: got[k].double() - want[k].double() for k in want}) / _norm(want)


def _moved(want: dict[str, torch.Tensor], width: int = 32) -> float:
    """How far training moved the reference from its initial values, in the same relative measure."""
    initial = w.MyModel(width)
    initial.configure_model()
    start = initial.state_dict()
    return _norm({k: want[k].double() - start[k].double() for k in want}) / _norm(want)


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().norm() ** 2) for t in tensors.values()))


def test_stage_3_configure_model_shards_each_layer_as_it_is_built(runs: dict[str, Any]) -> None:
    run = runs["stage_3"]
    # Inside configure_model, right after construction: DeepSpeed parameters holding half of each tensor.
    assert [b["ds_id"] for b in run["built"]] == [True, True]
    assert [b["partition"] for b in run["built"]] == [32 * 32 // 2, 32 // 2]
    assert all(b["numel"] == 0 for b in run["built"])  # the whole tensor exists only inside forward
    want = w.reference()
    assert _gap(want, run["params"]) < TOL < _moved(want)


def test_stage_3_offload_to_cpu_matches_one_process(runs: dict[str, Any]) -> None:
    from stratagem import get_registry
    from stratagem_deepspeed import DeepSpeedStrategy

    want = w.reference()
    assert _gap(want, runs["stage_3_offload"]["params"]) < TOL < _moved(want)
    # The seed's two spellings are one configuration.
    by_name = get_registry().get("deepspeed_stage_3_offload").create()
    by_options = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    assert by_name.config == by_options.config
    zero = by_options.config.deepspeed_config("32-true")["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"


def test_nvme_offload_trains_with_parameters_and_optimizer_state_in_files(nvme_run: dict[str, Any]) -> None:
    run = nvme_run
    for rank, files in enumerate(run["files"]):
        params = [f for f in files if f.startswith(f"zero_stage_3/float32params/rank{rank}/")]
        states = [f for f in files if f.startswith(f"zero_stage_3/optimizer/rank{rank}/")]
        # The first weight (1 MiB per rank) lives in a file; Adam's two moments and the fp32 master copy too.
        assert len(params) == 1 and files[params[0]] >= 2**20, files
        assert any("exp_avg-" in f for f in states) and any("exp_avg_sq-" in f for f in states), files
        assert all(files[f] >= 2**20 for f in states), files
    # block_1.0.weight (the first parameter) is out of memory on both ranks after training.
    assert all(locations[0] == "OffloadDeviceEnum.nvme" for locations in run["swapped_out"])
    want = w.reference(width=w.NVME_WIDTH)
    assert _gap(want, run["params"]) < TOL < _moved(want, w.NVME_WIDTH)


def test_nvme_tuning_options_reach_deepspeed(nvme_run: dict[str, Any]) -> None:
    parsed = nvme_run["parsed"]
    assert parsed["aio"] == {
        "block_size": 524_288,
        "queue_depth": 4,
        "intra_op_parallelism": 2,
        "single_submit": True,
        "overlap_events": False,
        "use_gds": False,
    }
    param, optimizer = parsed["offload_param"], parsed["offload_optimizer"]
    assert (param["buffer_count"], param["buffer_size"], param["max_in_cpu"]) == (4, 600_000, 0)
    assert str(param["device"]).endswith("nvme") and str(optimizer["device"]).endswith("nvme")
    assert str(param["nvme_path"]).endswith("local_nvme") and str(optimizer["nvme_path"]).endswith(
        "local_nvme"
    )
    assert optimizer["buffer_count"] == 5 and param["pin_memory"] is False is optimizer["pin_memory"]
    assert parsed["sub_group_size"] == 500_000_000
    assert parsed["remote_device"].endswith("nvme")
    # logging_batch_size_per_gpu: the batch DeepSpeed's throughput figures count (per process x processes).
    assert parsed["micro_batch"] == w.MICRO and parsed["throughput_batch"] == w.MICRO * 2


def test_seed_activation_checkpointing_keeps_the_saved_input_on_the_cpu(runs: dict[str, Any]) -> None:
    run, control = runs["cpu_checkpointing"], runs["stage_3"]
    # cpu_checkpointing alone partitions too (partition_activations=None follows it, as DeepSpeed documents
    # CPU checkpointing of partitioned activations).
    assert run["seen"]["settings"]["CPU_CHECKPOINT"] and run["seen"]["settings"]["PARTITION_ACTIVATIONS"]
    # DeepSpeed kept a flat copy of the checkpointed input on the CPU, and emptied the input until backward.
    assert run["seen"]["input_emptied"] and run["seen"]["saved_shape"] == [w.MICRO * w.FEATURES]
    assert run["seen"]["saved_device"] == "cpu"
    # Without the setting the input stays as it was (the same model and checkpoint call under stage 3).
    assert not any(control["seen"]["settings"][k] for k in ("CPU_CHECKPOINT", "PARTITION_ACTIVATIONS"))
    assert not control["seen"]["input_emptied"] and control["seen"]["saved_shape"] is None
    # The seed's reentrant checkpoint of the first block: its input needs no gradient, so backward gives the
    # block none. ZeRO steps it with a zero gradient: only AdamW's weight decay moves it. The rest trains, and
    # everything matches one process in which that block's gradient is zero.
    want = w.reference(no_gradient="block_1")
    assert _gap(want, run["params"]) < TOL < _moved(want)
    initial = w.MyModel()
    initial.configure_model()
    decay = (1 - w.LR * 0.01) ** w.STEPS  # torch's AdamW default weight_decay
    for name, value in initial.block_1.state_dict().items():
        torch.testing.assert_close(run["params"][f"block_1.{name}"], value * decay, rtol=1e-6, atol=1e-9)


def test_every_activation_checkpointing_option_takes_effect(runs: dict[str, Any]) -> None:
    seen = runs["all_activation_options"]["seen"]
    assert seen["settings"] == {
        "PARTITION_ACTIVATIONS": True,
        "CPU_CHECKPOINT": True,
        "CONTIGUOUS_CHECKPOINTING": True,
        "SYNCHRONIZE": True,
        "num_layers": 1,
    }
    # Partitioned (one flat copy: no model parallelism), in DeepSpeed's contiguous buffer, on the CPU, with a
    # device synchronisation before and after the checkpointed forward.
    assert seen["saved_shape"] == [w.MICRO * w.FEATURES] and seen["in_contiguous_buffer"]
    assert seen["saved_device"] == "cpu" and seen["input_emptied"]
    assert seen["sync_calls"] >= 2
    # Non-reentrant checkpointing trains every block.
    want = w.reference()
    assert _gap(want, runs["all_activation_options"]["params"]) < TOL < _moved(want)


def test_config_file_optimizer_and_scheduler_train(runs: dict[str, Any]) -> None:
    config = runs["config"]
    assert config["optimizer_class"] == "AdamW" and config["scheduler_class"] == "WarmupLR"
    straight = config["straight"]
    lrs = [w.warmup_lr(step) for step in range(w.CONFIG_STEPS)]
    assert straight["lrs"] == pytest.approx(lrs, rel=1e-12, abs=0)
    assert lrs[0] == 0 and lrs[-1] > 0
    params = w.SEED_CONFIG["optimizer"]["params"]
    want = w.reference(
        steps=w.CONFIG_STEPS,
        lr_at=w.warmup_lr,
        betas=tuple(params["betas"]),
        eps=params["eps"],
        weight_decay=params["weight_decay"],
    )
    initial = w.MyModel()
    initial.configure_model()
    start = initial.state_dict()
    # The seed's learning rates are small (3e-5 at most): compare the change of the parameters, which an
    # untrained run (no change) or a constant learning rate (a far larger one) misses by 100%.
    change = math.sqrt(sum(float((want[k] - start[k]).norm() ** 2) for k in want))
    error = math.sqrt(sum(float((straight["params"][k] - want[k]).norm() ** 2) for k in want))
    assert change > 1e-5 and error / change < 1e-2, (change, error)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_config_file_optimizer_and_scheduler_resume_exactly(runs: dict[str, Any], fmt: str) -> None:
    config = runs["config"]
    straight, resumed = config["straight"], config[f"resumed_{fmt}"]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert resumed["lrs"] == straight["lrs"][w.CONFIG_RESUME_AT :]
    if fmt == "full":
        # After 4 steps the scheduler has stepped 4 times from -1; the full file carries its state.
        assert list(config["full_scheduler_state"].values()) == [
            {"last_batch_iteration": w.CONFIG_RESUME_AT - 1}
        ]


def test_two_optimizers_or_two_schedulers_are_refused(runs: dict[str, Any]) -> None:
    errors = runs["errors"]
    assert errors["both_optimizers"] is not None
    assert "'optimizer' section (AdamW)" in errors["both_optimizers"]
    assert "remove configure_optimizers()" in errors["both_optimizers"]
    assert "remove the 'optimizer' section" in errors["both_optimizers"]
    assert errors["both_schedulers"] is not None
    assert "'scheduler' section (WarmupLR)" in errors["both_schedulers"]

"""Each named option of the DeepSpeed strategies, read back from DeepSpeed's own parser of the config the
strategy writes (``deepspeed.runtime.config.DeepSpeedConfig``: what ``deepspeed.initialize`` reads), and each
bad value refused with a message that names it. In one process; the runs are in test_seed_examples.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from stratagem.errors import ConfigurationError
from stratagem_deepspeed._config import DeepSpeedConfig, option_names

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def parse() -> Any:
    """Parse a config as ``deepspeed.initialize`` does (no process group needed: world size 1)."""
    pytest.importorskip("torch")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    runtime_config = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed is not installed")

    def parse(precision: str = "32-true", **options: Any) -> Any:
        ds = DeepSpeedConfig.from_options(options).deepspeed_config(precision, "cpu")
        return runtime_config.DeepSpeedConfig(ds)

    return parse


@pytest.fixture
def nvme(tmp_path: Path) -> dict[str, Any]:
    return {
        "stage": 3,
        "offload_parameters": True,
        "offload_optimizer": True,
        "offload_params_device": "nvme",
        "offload_optimizer_device": "nvme",
        "nvme_path": str(tmp_path),
    }


def test_offload_devices_and_nvme_path(parse: Any, nvme: dict[str, Any], tmp_path: Path) -> None:
    zero = parse(**nvme).zero_config
    assert zero.offload_param.device == "nvme" and zero.offload_optimizer.device == "nvme"
    assert zero.offload_param.nvme_path == tmp_path == zero.offload_optimizer.nvme_path
    cpu = parse(stage=3, offload_parameters=True, offload_optimizer=True).zero_config
    assert cpu.offload_param.device == "cpu" and cpu.offload_optimizer.device == "cpu"
    mixed = parse(**{**nvme, "offload_optimizer_device": "cpu"}).zero_config
    assert mixed.offload_param.device == "nvme" and mixed.offload_optimizer.device == "cpu"
    assert parse().zero_config.offload_param is None  # nothing offloaded by default


def test_nvme_swap_and_aio_tuning(parse: Any, nvme: dict[str, Any]) -> None:
    tuned = {
        "params_buffer_count": 7,
        "params_buffer_size": 123_456,
        "max_in_cpu": 0,
        "optimizer_buffer_count": 6,
        "block_size": 262_144,
        "queue_depth": 16,
        "single_submit": True,
        "overlap_events": False,
        "thread_count": 3,
        "pin_memory": True,
        "sub_group_size": 2e8,
    }
    parsed = parse(**nvme, **tuned)
    param, optimizer = parsed.zero_config.offload_param, parsed.zero_config.offload_optimizer
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (7, 123_456, 0)
    assert optimizer.buffer_count == 6
    assert param.pin_memory is True and optimizer.pin_memory is True
    assert parsed.zero_config.sub_group_size == 200_000_000
    # thread_count is DeepSpeed 0.19's intra_op_parallelism (the old key would be ignored).
    assert parsed.aio_config == {
        "block_size": 262_144,
        "queue_depth": 16,
        "intra_op_parallelism": 3,
        "single_submit": True,
        "overlap_events": False,
        "use_gds": False,
    }
    defaults = parse(**nvme)
    assert defaults.zero_config.offload_param.buffer_count == 5
    assert defaults.zero_config.offload_param.pin_memory is False  # on CPU unless asked
    assert defaults.aio_config["intra_op_parallelism"] == 1


def test_activation_checkpointing_options(parse: Any) -> None:
    parsed = parse(
        partition_activations=True,
        cpu_checkpointing=True,
        contiguous_memory_optimization=True,
        number_checkpoints=4,
        synchronize_checkpoint_boundary=True,
    ).activation_checkpointing_config
    assert parsed.partition_activations and parsed.cpu_checkpointing
    assert parsed.contiguous_memory_optimization and parsed.number_checkpoints == 4
    assert parsed.synchronize_checkpoint_boundary
    # The seed's cpu_checkpointing=True alone partitions too (DeepSpeed moves partitioned activations).
    seed = parse(cpu_checkpointing=True).activation_checkpointing_config
    assert seed.cpu_checkpointing and seed.partition_activations
    assert not parse().activation_checkpointing_config.partition_activations


def test_fp16_loss_scaling_options(parse: Any) -> None:
    pytest.importorskip("torch")
    scaled = parse(
        "16-mixed",
        loss_scale=0,
        initial_scale_power=12,
        loss_scale_window=500,
        hysteresis=4,
        min_loss_scale=8,
    ).float16_config
    assert scaled.enabled and scaled.loss_scale == 0
    assert (scaled.initial_scale_power, scaled.loss_scale_window, scaled.hysteresis) == (12, 500, 4)
    assert scaled.min_loss_scale == 8
    assert parse("16-mixed", loss_scale=1024).float16_config.loss_scale == 1024


def test_logging_batch_size_and_logging_level(parse: Any) -> None:
    assert parse(logging_batch_size_per_gpu=32).train_micro_batch_size_per_gpu == 32
    assert parse().train_micro_batch_size_per_gpu == 1
    # DeepSpeed prints its throughput (computed with that batch size) only when its logging is asked for.
    assert parse(logging_level=logging.INFO).steps_per_print == 10
    assert parse().steps_per_print == 2**62


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"offload_params_device": "gpu"}, "offload_params_device='gpu': use 'cpu'"),
        ({"offload_optimizer_device": 1}, "offload_optimizer_device=1: use 'cpu'"),
        ({"stage": 3, "offload_parameters": True, "offload_params_device": "nvme"}, "needs nvme_path"),
        ({"offload_optimizer": True, "offload_optimizer_device": "nvme"}, "needs nvme_path"),
        ({"offload_params_device": "nvme"}, "without offload_parameters=True"),
        ({"offload_optimizer_device": "nvme"}, "without offload_optimizer=True"),
        ({"nvme_path": "{tmp}"}, "no offload device is 'nvme'"),
        ({"remote_device": "disk", "stage": 3}, "remote_device='disk'"),
        ({"remote_device": "cpu"}, "only stage 3"),
        ({"remote_device": "nvme", "stage": 3}, "needs offload_parameters=True"),
        (
            {
                "remote_device": "cpu",
                "stage": 3,
                "offload_parameters": True,
                "offload_params_device": "nvme",
                "nvme_path": "{tmp}",
            },
            "Give the same device",
        ),
        ({"params_buffer_count": 2}, "tunes the NVMe swap"),
        ({"stage": 3, "offload_parameters": True, "max_in_cpu": 5}, "tunes the NVMe swap"),
        ({"optimizer_buffer_count": 8}, "tunes the NVMe swap"),
        ({"queue_depth": 16}, "tunes the NVMe swap"),
        ({"thread_count": 2}, "tunes the NVMe swap"),
        ({"pin_memory": True}, "nothing is offloaded"),
        ({"pin_memory": "yes", "offload_optimizer": True}, "pin_memory='yes'"),
        ({"sub_group_size": 1e6}, "only ZeRO stage 3"),
        ({"params_buffer_count": 0}, "params_buffer_count=0: give a positive"),
        ({"params_buffer_size": 1.5}, "params_buffer_size=1.5"),
        ({"max_in_cpu": -1}, "max_in_cpu=-1"),
        ({"block_size": True}, "block_size=True"),
        ({"single_submit": 1}, "single_submit=1: use True or False"),
        ({"contiguous_memory_optimization": True}, "needs partition_activations=True"),
        ({"contiguous_memory_optimization": True, "partition_activations": True}, "needs number_checkpoints"),
        ({"number_checkpoints": 2}, "contiguous_memory_optimization, which is off"),
        ({"partition_activations": "on"}, "partition_activations='on'"),
        ({"loss_scale": -1}, "loss_scale=-1"),
        ({"initial_scale_power": -2}, "initial_scale_power=-2"),
        ({"loss_scale_window": 0}, "loss_scale_window=0"),
        ({"hysteresis": 0}, "hysteresis=0"),
        ({"min_loss_scale": 0.5}, "min_loss_scale=0.5"),
        ({"logging_batch_size_per_gpu": "auto"}, "never see the data loader"),
        ({"logging_batch_size_per_gpu": 0}, "logging_batch_size_per_gpu=0"),
        (
            {"config": {"zero_optimization": {"stage": 3}}, "nvme_path": "{tmp}"},
            "zero_optimization.offload_*",
        ),
        ({"config": {"aio": {}}, "thread_count": 4}, "thread_count -> aio.intra_op_parallelism"),
        ({"config": {"zero_optimization": {"offload_param": {"device": "nvme"}}}}, "needs an nvme_path"),
        (
            {"config": {"activation_checkpointing": {"contiguous_memory_optimization": True}}},
            "number_checkpoints",
        ),
        ({"config": {"train_micro_batch_size_per_gpu": 8}, "logging_batch_size_per_gpu": 4}, "Keep one"),
        ({"offload_parameter": True}, "Did you mean 'offload_parameters'?"),
        ({"nvme_pth": "/x"}, "Did you mean 'nvme_path'?"),
        ({"save_full_weights": False}, "Trainer(checkpoint_format='full')"),
    ],
)
def test_bad_values_say_what_to_do(options: dict[str, Any], fragment: str, tmp_path: Path) -> None:
    options = {k: (v.format(tmp=tmp_path) if isinstance(v, str) else v) for k, v in options.items()}
    with pytest.raises(ConfigurationError, match=_escaped(fragment)):
        DeepSpeedConfig.from_options(options)


def _escaped(fragment: str) -> str:
    import re

    return re.escape(fragment)


def test_nvme_path_must_exist_be_a_directory_and_be_writable(nvme: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no such directory"):
        DeepSpeedConfig.from_options({**nvme, "nvme_path": str(tmp_path / "missing")})
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError, match="is not a directory"):
        DeepSpeedConfig.from_options({**nvme, "nvme_path": str(tmp_path / "file")})
    # A directory nobody can create files in, whoever runs the test (root ignores permission bits).
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc for a directory that refuses new files")
    with pytest.raises(ConfigurationError, match="not writable"):
        DeepSpeedConfig.from_options({**nvme, "nvme_path": "/proc/self"})
    # A whole config's NVMe path is checked the same way.
    config = {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/proc/self"}}
    }
    with pytest.raises(ConfigurationError, match="not writable"):
        DeepSpeedConfig(config=config)


def test_options_that_depend_on_the_run_are_refused_at_set_up() -> None:
    with pytest.raises(ConfigurationError, match=r"loss_scale.*precision='16-mixed' only"):
        DeepSpeedConfig(loss_scale=128).deepspeed_config("bf16-mixed")
    # DeepSpeed's unpartitioned CPU checkpointing loses the input where it is in host memory already.
    config = DeepSpeedConfig(cpu_checkpointing=True, partition_activations=False)
    with pytest.raises(ConfigurationError, match="would lose each checkpointed input"):
        config.deepspeed_config("32-true", "cpu")
    assert config.deepspeed_config("32-true", "cuda")["activation_checkpointing"]["cpu_checkpointing"]


def test_every_option_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [name for name in option_names() if f"`{name}`" not in readme]
    assert not missing, f"README.md lists no default for {missing}"

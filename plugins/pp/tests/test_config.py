"""Options, schedule names, mesh sizes and registration, in one process: refused with a clear message before
any worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stratagem import get_registry
from stratagem.errors import ConfigurationError
from stratagem_pp import (
    SCHEDULES,
    PPConfig,
    PPFSDPStrategy,
    PPFSDPTPStrategy,
    PPStrategy,
    _config,
    _schedules,
)


def test_every_schedule_torch_offers_has_a_name() -> None:
    from torch.distributed.pipelining import schedules

    offered = {
        name
        for name in schedules.__all__
        if name.startswith("Schedule") and isinstance(getattr(schedules, name), type)
    }
    assert {info.torch_class for info in SCHEDULES.values()} == offered
    assert list(SCHEDULES)[:4] == ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"]


@pytest.mark.parametrize(
    ("given", "name"),
    [
        ("1F1B", "1f1b"),
        ("GPipe", "gpipe"),
        ("Interleaved1F1B", "interleaved_1f1b"),
        ("ScheduleInterleavedZeroBubble", "zero_bubble"),
        ("ZBVZeroBubble", "zbv_zero_bubble"),
        ("DualPipeV", "dual_pipe_v"),
        ("looped-bfs", "looped_bfs"),
    ],
)
def test_torch_spellings_are_accepted(given: str, name: str) -> None:
    assert PPConfig(schedule=given).schedule == name


def test_an_unknown_schedule_lists_them_and_the_closest() -> None:
    with pytest.raises(ConfigurationError) as error:
        PPStrategy(schedule="interleaved_1fb1")
    message = str(error.value)
    assert "unknown schedule 'interleaved_1fb1'. Did you mean 'interleaved_1f1b'?" in message
    for name in SCHEDULES:
        assert name in message


def test_stages_per_rank_follows_the_schedule() -> None:
    assert PPConfig(schedule="1f1b").resolved_stages_per_rank == 1
    assert PPConfig(schedule="interleaved_1f1b").resolved_stages_per_rank == 2
    with pytest.raises(ConfigurationError, match=r"'gpipe' runs one stage per rank.*interleaved_1f1b"):
        PPConfig(schedule="gpipe", stages_per_rank=2)
    with pytest.raises(ConfigurationError, match="exactly two stages per rank"):
        PPConfig(schedule="dual_pipe_v", stages_per_rank=3)


def test_micro_batch_rules_of_the_schedules() -> None:
    with pytest.raises(ConfigurationError, match=r"at least as many micro-batches as stages \(8\)"):
        PPConfig(schedule="dual_pipe_v", pipeline_parallel_size=4, microbatches=6)
    with pytest.raises(ConfigurationError, match="not a multiple of its 2 rounds"):
        PPConfig(schedule="interleaved_1f1b", pipeline_parallel_size=4, microbatches=9)
    # Known only with the world size: checked in setup_environment, before the process group.
    config = PPConfig(schedule="interleaved_1f1b", microbatches=9)
    with pytest.raises(ConfigurationError, match="not a multiple"):
        _config.check_for_world(config, _config.mesh_sizes(config, 4, 1))
    assert _config.microbatches_for(PPConfig(schedule="zbv_zero_bubble"), 2) == 4


def test_split_backward_schedules_keep_fsdp_parameters_gathered() -> None:
    for schedule in ("zero_bubble", "zbv_zero_bubble", "dual_pipe_v"):
        with pytest.raises(ConfigurationError, match="reshard_after_forward=False"):
            PPFSDPStrategy(schedule=schedule, reshard_after_forward=True)
    PPFSDPStrategy(schedule="1f1b", reshard_after_forward=True)


def test_micro_batches_must_divide_the_batch() -> None:
    with pytest.raises(
        ConfigurationError, match=r"microbatches=4 does not divide .* of 6 samples.*\[1, 2, 3, 6\]"
    ):
        _config.check_batch(4, 6)
    _config.check_batch(4, 8)


def test_mesh_sizes() -> None:
    assert _config.mesh_sizes(PPConfig(), 4, 1) == _config.MeshSizes(pp=4)
    assert _config.mesh_sizes(PPConfig(), 8, 2) == _config.MeshSizes(pp=2, dp=4)
    assert _config.mesh_sizes(PPConfig(), 4, 3) == _config.MeshSizes(pp=2, dp=1, tp=2)
    sizes = _config.mesh_sizes(PPConfig(pipeline_parallel_size=2, tensor_parallel_size=2), 8, 3)
    assert sizes == _config.MeshSizes(pp=2, dp=2, tp=2)
    with pytest.raises(ConfigurationError, match=r"pipeline_parallel_size=2 with 4 processes.*'pp_fsdp'"):
        _config.mesh_sizes(PPConfig(pipeline_parallel_size=2), 4, 1)
    with pytest.raises(ConfigurationError, match=r"=3 does not divide the world size 4.*\[1, 2, 4\]"):
        _config.mesh_sizes(PPConfig(pipeline_parallel_size=3), 4, 2)
    with pytest.raises(ConfigurationError, match="at least 2 ranks"):
        _config.mesh_sizes(PPConfig(pipeline_parallel_size=1), 4, 2)


def test_options_of_other_dimensions_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"\['auto_wrap_policy'\] belong to 'pp_fsdp'"):
        PPStrategy(auto_wrap_policy=set())
    with pytest.raises(ConfigurationError, match=r"\['tp_plan'\] belong to"):
        PPFSDPStrategy(tp_plan={})
    with pytest.raises(ConfigurationError, match=r"unknown options \['schedul'\]"):
        PPFSDPTPStrategy(schedul="1f1b")
    PPFSDPTPStrategy(tp_plan={"blocks.*.fc1": "colwise"}, tensor_parallel_size=2, reshard_after_forward=False)


@pytest.mark.parametrize("plan", ["blocks.4", {"a": 1}, [], [["a"], "b"], [["a"], []], [1]])
def test_pp_plan_forms(plan: object) -> None:
    with pytest.raises(ConfigurationError, match="where each stage begins"):
        PPConfig(pp_plan=plan)


def test_stage_placement_by_schedule() -> None:
    assert _schedules.local_stages("interleaved_1f1b", 2, 2, 0) == [0, 2]
    assert _schedules.local_stages("zbv_zero_bubble", 2, 2, 0) == [0, 3]
    assert _schedules.local_stages("dual_pipe_v", 4, 2, 1) == [1, 6]
    assert _schedules.local_stages("1f1b", 4, 1, 3) == [3]


def test_registered_with_declared_capabilities() -> None:
    registry = get_registry()
    for name, smallest in (("pp", 2), ("pp_fsdp", 4), ("pp_fsdp_tp", 4)):
        info = registry.get(name)
        assert info.capabilities.min_world_size == smallest
        assert info.capabilities.checkpoint_formats == {"full", "sharded"}
    assert type(registry.get("pp_fsdp").create()) is PPFSDPStrategy


def test_the_entry_point_module_does_not_import_torch() -> None:
    code = "import sys, stratagem_pp._plugin, stratagem_pp; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

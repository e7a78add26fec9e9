"""Options, policies and the mesh plan, checked in this process without a process group."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from stratagem.errors import ConfigurationError
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem_fsdp import FSDPConfig, FSDPStrategy
from stratagem_fsdp._mesh import plan
from stratagem_fsdp._policy import to_policy


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(10, 10)  # 110 parameters


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(10, 2)  # 22 parameters


def names(model: torch.nn.Module, selected: list[torch.nn.Module]) -> list[str]:
    lookup = {id(m): n for n, m in model.named_modules()}
    return [lookup[id(m)] for m in selected]


# -------------------------------------------------------------------------------------------------
# policies
# -------------------------------------------------------------------------------------------------


def test_class_set_and_single_class() -> None:
    model = Model()
    assert names(model, to_policy("p")({Block}).select(model)) == ["blocks.0", "blocks.1"]
    assert names(model, to_policy("p")(Block).select(model)) == ["blocks.0", "blocks.1"]


def test_callable_predicate() -> None:
    model = Model()
    policy = to_policy("p")(lambda m: isinstance(m, torch.nn.Linear))
    assert names(model, policy.select(model)) == ["blocks.0.fc", "blocks.1.fc", "head"]


def test_fsdp1_size_based_policy_runs_bottom_up() -> None:
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    model = Model()
    policy = to_policy("p")(functools.partial(size_based_auto_wrap_policy, min_num_params=100))
    # Each Linear of 110 parameters is taken first; its Block then has nothing left to claim.
    assert names(model, policy.select(model)) == ["blocks.0.fc", "blocks.1.fc"]
    bigger = to_policy("p")(functools.partial(size_based_auto_wrap_policy, min_num_params=200))
    # No single Linear reaches 200; the Sequential (220) does.
    assert names(model, bigger.select(model)) == ["blocks"]


def test_fsdp1_policy_objects() -> None:
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    model = Model()
    assert names(model, to_policy("p")(ModuleWrapPolicy({Block})).select(model)) == ["blocks.0", "blocks.1"]
    custom = CustomPolicy(lambda m: m is model.head)
    assert names(model, to_policy("p")(custom).select(model)) == ["head"]


def test_outermost_selection_for_checkpointing() -> None:
    model = Model()
    policy = to_policy("p")({Block, torch.nn.Linear})
    assert names(model, policy.select_outermost(model)) == ["blocks.0", "blocks.1", "head"]


@pytest.mark.parametrize("bad", ["Block", 3, {"Block"}, set()])
def test_bad_policy_names_the_field_and_value(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"FSDPStrategy\(auto_wrap_policy="):
        FSDPStrategy(auto_wrap_policy=bad)


# -------------------------------------------------------------------------------------------------
# options
# -------------------------------------------------------------------------------------------------


def test_defaults() -> None:
    config = FSDPStrategy().config
    assert config.sharding_strategy == "FULL_SHARD"
    assert config.state_dict_type == "full"
    assert config.cpu_offload is False
    assert FSDPStrategy(state_dict_type="sharded").checkpoint_format == "sharded"


def test_lightnings_former_activation_checkpointing_name_is_the_policy() -> None:
    # Seed 002's signature: activation_checkpointing takes a class or a list of classes.
    for value in (torch.nn.Linear, [torch.nn.Linear]):
        policy = FSDPStrategy(activation_checkpointing=value).config.activation_checkpointing_policy
        assert (
            policy
            == FSDPStrategy(
                activation_checkpointing_policy={torch.nn.Linear}
            ).config.activation_checkpointing_policy
        )


def test_fsdp1_enums_and_objects_are_translated() -> None:
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

    config = FSDPStrategy(
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        cpu_offload=CPUOffload(offload_params=True),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    ).config
    assert config.sharding_strategy == "SHARD_GRAD_OP"
    assert config.cpu_offload is True
    assert config.mixed_precision == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert config.backward_prefetch == "BACKWARD_PRE"
    assert FSDPStrategy(sharding_strategy="hybrid_shard").config.sharding_strategy == "HYBRID_SHARD"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"sharding_strategy": "ZERO3"}, r"sharding_strategy='ZERO3'\): use one of 'FULL_SHARD'"),
        ({"state_dict_type": "local"}, r"state_dict_type='local'\): use one of 'full', 'sharded'"),
        ({"cpu_offload": "yes"}, r"cpu_offload='yes'\)"),
        ({"mixed_precision": torch.bfloat16}, r"mixed_precision=torch.bfloat16\)"),
        ({"reshard_after_forward": 0}, r"reshard_after_forward=0\)"),
        ({"process_group_backend": "tcp"}, r"process_group_backend='tcp'\)"),
        ({"timeout": -1}, r"timeout=datetime.timedelta"),
        ({"forward_prefetch": "yes"}, r"forward_prefetch='yes'\): give True or False"),
        ({"backward_prefetch": "EARLY"}, r"backward_prefetch='EARLY'\)"),
        ({"shard_size": 2}, r"only HYBRID_SHARD has a replicate and a shard dimension"),
        ({"sharding_strategy": "NO_SHARD", "reshard_after_forward": True}, r"nothing to reshard"),
        ({"sync_module_states": True}, r"sync_module_states=True\): not accepted: build the model under"),
        ({"device_id": 0}, r"device_id=0\): not accepted"),
        ({"bucket_cap_mb": 25}, r"unknown options \['bucket_cap_mb'\]"),
        (
            {
                "activation_checkpointing": torch.nn.Linear,
                "activation_checkpointing_policy": {torch.nn.Linear},
            },
            r"activation_checkpointing=<class 'torch.nn.modules.linear.Linear'>\): it is the former name",
        ),
    ],
)
def test_bad_options_name_the_field_and_value(options: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        FSDPStrategy(**options)


def test_options_that_no_longer_apply_are_kept_to_warn_about() -> None:
    config = FSDPStrategy(limit_all_gathers=True, use_orig_params=False).config
    assert config.legacy_options == {"limit_all_gathers": True, "use_orig_params": False}


def test_offload_policy_applies_on_cuda_only() -> None:
    strategy = FSDPStrategy(cpu_offload=True)
    strategy.cluster = ClusterEnvironment(device="cuda:0", accelerator="cuda")
    assert isinstance(strategy.offload(), CPUOffloadPolicy) and strategy.offload().pin_memory
    strategy.cluster = ClusterEnvironment(device="cpu", accelerator="cpu")
    assert type(strategy.offload()) is OffloadPolicy
    assert type(FSDPStrategy().offload()) is OffloadPolicy


def test_mixed_precision_from_precision() -> None:
    strategy = FSDPStrategy()
    strategy.precision = "bf16-mixed"
    assert strategy.mixed_precision() == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    strategy.precision = "32-true"
    assert strategy.mixed_precision() == MixedPrecisionPolicy()
    given = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert FSDPStrategy(mixed_precision=given).mixed_precision() is given


# -------------------------------------------------------------------------------------------------
# mesh plan
# -------------------------------------------------------------------------------------------------


def cluster(world: int, nodes: int = 1) -> ClusterEnvironment:
    return ClusterEnvironment(world_size=world, num_nodes=nodes)


@pytest.mark.parametrize(
    ("options", "world", "nodes", "shape", "unit", "root"),
    [
        ({}, 4, 1, (4,), True, None),
        ({"sharding_strategy": "SHARD_GRAD_OP"}, 4, 1, (4,), False, False),
        ({"sharding_strategy": "NO_SHARD"}, 4, 1, (4, 1), False, False),
        ({"sharding_strategy": "HYBRID_SHARD"}, 16, 2, (2, 8), True, None),
        ({"sharding_strategy": "HYBRID_SHARD"}, 8, 1, (1, 8), True, None),
        ({"sharding_strategy": "HYBRID_SHARD"}, 2, 1, (1, 2), True, None),
        ({"sharding_strategy": "HYBRID_SHARD", "replicate_size": 4}, 8, 1, (4, 2), True, None),
        ({"sharding_strategy": "HYBRID_SHARD", "shard_size": 8}, 8, 1, (1, 8), True, None),
        ({"sharding_strategy": "_HYBRID_SHARD_ZERO2"}, 16, 2, (2, 8), False, False),
        ({"reshard_after_forward": False}, 4, 1, (4,), False, False),
    ],
)
def test_plan(options: dict, world: int, nodes: int, shape: tuple, unit: object, root: object) -> None:
    result = plan(FSDPConfig(**options), cluster(world, nodes))
    assert (result.mesh_shape, result.unit_reshard, result.root_reshard) == (shape, unit, root)
    assert result.mesh_dim_names == (("replicate", "shard") if len(shape) == 2 else None)


def test_hybrid_sizes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="must equal the world size 8"):
        plan(FSDPConfig(sharding_strategy="HYBRID_SHARD", replicate_size=3), cluster(8))
    with pytest.raises(ConfigurationError, match="must equal the world size 4"):
        plan(FSDPConfig(sharding_strategy="HYBRID_SHARD", replicate_size=2, shard_size=3), cluster(4))


# -------------------------------------------------------------------------------------------------
# registration
# -------------------------------------------------------------------------------------------------


def test_registered_names_and_capabilities() -> None:
    from stratagem import get_registry

    registry = get_registry()
    for name in ("fsdp", "fsdp_cpu_offload", "hsdp"):
        info = registry.get(name)
        assert info.capabilities.checkpoint_formats == {"full", "sharded"}
        assert {"32-true", "bf16-mixed", "bf16-true", "16-mixed"} <= info.capabilities.precisions
    assert registry.get("hsdp").capabilities.min_world_size == 1  # one node: a 1 x N mesh
    assert registry.get("fsdp").capabilities.min_world_size == 1
    assert registry.get("fsdp_cpu_offload").create().config.cpu_offload is True
    assert registry.get("hsdp").create().config.sharding_strategy == "HYBRID_SHARD"


def test_entry_point_module_does_not_import_torch() -> None:
    code = "import sys, stratagem_fsdp._plugin, stratagem_fsdp; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr

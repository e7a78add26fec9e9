"""The plan and option checks of stratagem-tp, which run before any process group exists."""

from __future__ import annotations

import pytest
import tp_workers as w
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from stratagem.errors import ConfigurationError
from stratagem_tp import FSDPTPStrategy, TPStrategy, _config, _plan


def resolve(plan: dict, heads: int = w.HEADS, tp: int = 2) -> _plan.ResolvedPlan:
    model = w.make_model(heads=heads)
    resolved = _plan.resolve("option", plan, model)
    _plan.check_heads(model, resolved, tp)
    return resolved


def test_globs_expand_to_module_names_with_a_fresh_style_each() -> None:
    resolved = resolve(w.PLAN)
    assert sorted(resolved.styles) == sorted(
        ["embed", "head"]
        + [
            f"blocks.{i}.{m}"
            for i in (0, 1)
            for m in ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.fc1", "mlp.fc2")
        ]
    )
    assert isinstance(resolved.styles["blocks.0.attn.q"], ColwiseParallel)
    assert resolved.styles["blocks.0.attn.q"] is not resolved.styles["blocks.1.attn.q"]
    # rowwise on an embedding takes whole token ids (torch's default input layout is for Linear).
    assert str(resolved.styles["embed"].input_layouts) == "(Replicate(),)"
    assert str(resolved.styles["blocks.0.mlp.fc2"].input_layouts) == "(Shard(dim=-1),)"


def test_hugging_face_names_and_torch_styles_are_accepted() -> None:
    resolved = resolve(
        {
            "embed": "embedding_rowwise",
            "head": "colwise_rep",
            "norm": "sequence_parallel",
            "blocks.0.mlp.fc2": RowwiseParallel(),
        }
    )
    assert isinstance(resolved.styles["embed"], RowwiseParallel)
    assert str(resolved.styles["head"].output_layouts) == "(Replicate(),)"
    assert isinstance(resolved.styles["norm"], SequenceParallel)
    assert resolve({"blocks.*.norm1": "replicate"}).styles == {"blocks.0.norm1": None, "blocks.1.norm1": None}


def test_a_glob_matching_nothing_names_the_modules_that_exist() -> None:
    with pytest.raises(ConfigurationError) as caught:
        resolve({"blocks.*.ffn.fc1": "colwise"})
    message = str(caught.value)
    assert "'blocks.*.ffn.fc1' matches no module" in message
    assert "blocks.0.mlp.fc1" in message and "Closest" in message


def test_an_unknown_style_suggests_the_closest() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown style 'rowise'.*Did you mean 'rowwise'"):
        resolve({"head": "rowise"})


def test_a_splitting_style_on_a_norm_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match=r"'colwise' cannot apply to module 'norm' \(LayerNorm\)"):
        resolve({"norm": "colwise"})


def test_heads_must_divide_by_the_tensor_parallel_size() -> None:
    resolve(w.PLAN, heads=4, tp=4)
    with pytest.raises(
        ConfigurationError,
        match=r"blocks\.0\.attn\.num_heads=2 is not divisible by the tensor-parallel size 4",
    ):
        resolve(w.PLAN, heads=2, tp=4)
    # A plan that splits only the MLP leaves attention whole: its heads need not divide.
    resolve({"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}, heads=1, tp=2)


def test_hugging_face_config_heads_are_checked() -> None:
    model = w.make_llama()
    resolved = _plan.resolve("model.tp_plan", dict(model.tp_plan), model)
    _plan.check_heads(model, resolved, 2)
    with pytest.raises(
        ConfigurationError, match=r"model\.config\.num_key_value_heads=2 is not divisible .* 4"
    ):
        _plan.check_heads(model, resolved, 4)


def test_plan_precedence_option_then_model_attribute() -> None:
    model = w.make_model()
    model.tp_plan = {"head": "colwise_gather_output"}
    assert _plan.find({"embed": "rowwise"}, model)[0] == "option"
    assert _plan.find(None, model) == ("model.tp_plan", {"head": "colwise_gather_output"})
    assert _plan.find(None, w.make_model()) == ("none", None)


def test_mesh_sizes() -> None:
    config = _config.TPConfig(tensor_parallel_size=2)
    assert _config.mesh_shape(config, 4, 1, two_d=True) == (2, 2)
    assert _config.mesh_shape(_config.TPConfig(), 4, 1, two_d=True) == (1, 4)  # one node: all its ranks
    assert _config.mesh_shape(_config.TPConfig(), 2, 1, two_d=True) == (1, 2)
    assert _config.mesh_shape(_config.TPConfig(), 8, 2, two_d=True) == (2, 4)  # ranks of one node
    assert _config.mesh_shape(_config.TPConfig(), 6, 1, two_d=False) == (1, 6)
    with pytest.raises(
        ConfigurationError, match=r"tensor_parallel_size=3 does not divide the world size 4.*\[1, 2, 4\]"
    ):
        _config.mesh_shape(_config.TPConfig(tensor_parallel_size=3), 4, 1, two_d=True)
    with pytest.raises(ConfigurationError, match="'tp' splits over every process"):
        _config.mesh_shape(config, 4, 1, two_d=False)


def test_options_are_checked_when_the_strategy_is_built() -> None:
    with pytest.raises(
        ConfigurationError, match=r"\['auto_wrap_policy'\] apply to the FSDP dimension of 'fsdp_tp' only"
    ):
        TPStrategy(auto_wrap_policy={w.Block})
    with pytest.raises(ConfigurationError, match="plan= or parallelize=, not both"):
        TPStrategy(plan=w.PLAN, parallelize=w.manual_parallelize)
    with pytest.raises(ConfigurationError, match="tensor_parallel_size=0"):
        FSDPTPStrategy(tensor_parallel_size=0)
    with pytest.raises(ConfigurationError, match="plan=42"):
        TPStrategy(plan=42)
    with pytest.raises(ConfigurationError, match="unknown options \\['sharding_strategy'\\]"):
        FSDPTPStrategy(sharding_strategy="FULL_SHARD")
    assert FSDPTPStrategy(reshard_after_forward=False).checkpoint_format == "sharded"


def test_tp_size_is_another_name_for_tensor_parallel_size() -> None:
    assert FSDPTPStrategy(tp_size=2).config == FSDPTPStrategy(tensor_parallel_size=2).config
    assert FSDPTPStrategy(tp_size=2, tensor_parallel_size=2).config.tensor_parallel_size == 2
    with pytest.raises(ConfigurationError, match="tp_size=2 and tensor_parallel_size=4 disagree"):
        FSDPTPStrategy(tp_size=2, tensor_parallel_size=4)
    with pytest.raises(ConfigurationError, match="tensor_parallel_size=0"):
        TPStrategy(tp_size=0)


def test_fsdp_tp_serves_two_processes_as_a_1_by_2_mesh() -> None:
    """As hsdp on one node: 2 processes are a valid (dp, tp) = (1, 2) mesh, so `stratagem compare
    --strategies ...,fsdp_tp --devices 2` and `stratagem demo --strategy fsdp_tp --devices 2` run."""
    from stratagem import get_registry
    from stratagem.errors import CapabilityError

    registry = get_registry()
    assert (
        registry.check_request("fsdp_tp", accelerator="cpu", precision="32-true", world_size=2).name
        == "fsdp_tp"
    )
    with pytest.raises(CapabilityError, match="world size"):
        registry.check_request("fsdp_tp", accelerator="cpu", precision="32-true", world_size=1)
    # The contract suite still certifies it where both the default (1 x 4) and 2 x 2 live.
    assert FSDPTPStrategy().contract_world_size == 4

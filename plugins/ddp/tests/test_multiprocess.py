"""Real 2-process gloo runs of ``ddp``: equivalence with a one-process reference, every option, checkpoints.

Two launches in all (each worker batches many checks, see ddp_workers.py); the tests below read their results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ddp_workers as w
import pytest
import torch

import stratagem as sg

TOL = 1e-5
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """A full checkpoint written by single_device in this process, and its parameters."""
    path = tmp_path_factory.mktemp("single") / "single.ckpt"
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model = engine.setup(w.make_model(seed=5))
    engine.save(path, {"model": model})
    return str(path), w.named_params(model)


@pytest.fixture(scope="module")
def run1(tmp_path_factory: pytest.TempPathFactory, single_ckpt: Any) -> dict[str, Any]:
    ckpt_dir = tmp_path_factory.mktemp("ddp")
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2)
    result = engine.launch(w.equivalence_and_options, str(ckpt_dir), *single_ckpt)
    result["ckpt_dir"] = ckpt_dir
    return result


@pytest.fixture(scope="module")
def run2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from stratagem_ddp import DDPStrategy

    ckpt_dir = tmp_path_factory.mktemp("post_local")
    strategy = DDPStrategy(process_group_backend="gloo", timeout=77)
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=2)
    result = engine.launch(w.group_alias_post_local, str(ckpt_dir))
    result["ckpt_dir"] = ckpt_dir
    return result


# -------------------------------------------------------------------------------------------------
# training equivalence
# -------------------------------------------------------------------------------------------------


def test_launched_by_name(run1: dict) -> None:
    assert run1["strategy"] == "DDPStrategy"
    assert run1["registered"] == "ddp"


def test_matches_one_process_reference_on_global_batch(run1: dict) -> None:
    assert run1["diff_plain"] < TOL


def test_accumulation_with_no_sync_matches_reference(run1: dict) -> None:
    assert run1["diff_accumulate"] < TOL


def test_no_sync_skips_synchronisation_until_last_micro_batch(run1: dict) -> None:
    # Two micro-batches under no_sync keep each rank's own gradient; the last one all-reduces.
    assert run1["no_sync_probe"] == [False, False, True]


# -------------------------------------------------------------------------------------------------
# options
# -------------------------------------------------------------------------------------------------


def test_static_graph_trains_a_model_with_an_unused_parameter(run1: dict) -> None:
    assert run1["static_graph_flag"] is True
    assert run1["diff_static_graph"] < TOL
    # The same model under plain ddp fails: the option is what made the difference.
    assert run1["plain_unused_error"] is not None
    assert "did not receive grad" in run1["plain_unused_error"] or "reduction" in run1["plain_unused_error"]


def test_gradient_as_bucket_view(run1: dict) -> None:
    assert run1["diff_bucket_view_True"] < TOL
    assert run1["diff_bucket_view_False"] < TOL
    assert run1["bucket_view_False_storages"] == run1["n_params"]
    assert run1["bucket_view_True_storages"] < run1["n_params"]


def test_ddp_kwargs_pass_through(run1: dict) -> None:
    assert run1["bucket_cap_bytes"] == int(1e-5 * 1024 * 1024)
    assert run1["n_buckets_tiny_cap"] == run1["n_params"]
    assert run1["diff_tiny_cap"] < TOL
    assert run1["tags_broadcast_True"] == [1.0, 1.0]
    assert run1["tags_broadcast_False"] == [1.0, 2.0]


def test_fp16_compress_hook_communicates_in_float16(run1: dict) -> None:
    # The gradients are exactly the float16 average of the ranks' gradients, which is not the float32 one.
    assert run1["fp16_hook_vs_fp16"] < 1e-7
    assert run1["fp16_hook_vs_fp32"] > 1e-5
    assert run1["fp32_vs_fp32"] < 1e-7
    assert run1["fp32_vs_fp16"] > 1e-5


def test_comm_wrapper_compresses_the_wrapped_hook(run1: dict) -> None:
    assert run1["fp16_wrapper_vs_fp16"] < 1e-7
    assert run1["fp16_wrapper_vs_fp32"] > 1e-5


def test_process_group_backend_and_timeout(run2: dict) -> None:
    assert run2["backend"] == "gloo"
    assert run2["timeout_s"] == 77.0


def test_find_unused_parameters_alias(run2: dict) -> None:
    assert run2["alias_name"] == "ddp_find_unused_parameters_true"
    assert run2["alias_find_unused"] is True
    assert run2["alias_diff"] < TOL


def test_post_local_sgd_averages_every_period_and_not_between(run2: dict) -> None:
    assert run2["optimizer_type"] == "PostLocalSGDOptimizer"
    # start_localSGD_iter=2, model_averaging_period=3: gradients all-reduced in steps 1-2, then local steps,
    # with the parameters averaged after steps 3, 6, 9.
    expected = [True, True, True, False, False, True, False, False, True]
    assert run2["post_local_equal"] == expected
    # Right after an average, each replica holds the mean of what the ranks' local steps gave.
    assert run2["post_local_is_mean_of_local_steps"] == expected
    assert run2["averager_step"] == 9


def test_post_local_sgd_default_subgroup_on_cpu(run2: dict) -> None:
    assert run2["default_subgroup_size"] == 2
    assert run2["default_subgroup_replicas_equal"] is True


# -------------------------------------------------------------------------------------------------
# precision
# -------------------------------------------------------------------------------------------------


def test_bf16_mixed(run1: dict) -> None:
    assert run1["bf16_mixed_output"] == "torch.bfloat16"
    assert run1["bf16_mixed_param"] == "torch.float32"
    assert run1["bf16_mixed_replicas_equal"] is True
    assert run1["bf16_mixed_diff"] < 2e-2


def test_bf16_true(run1: dict) -> None:
    assert run1["bf16_true_param"] == "torch.bfloat16"
    assert run1["bf16_true_replicas_equal"] is True


# -------------------------------------------------------------------------------------------------
# checkpoints
# -------------------------------------------------------------------------------------------------


def test_full_checkpoint_round_trip_under_ddp(run1: dict) -> None:
    assert run1["ddp_roundtrip_all_ranks"] == [True, True]
    assert run1["ddp_roundtrip_rest"] == {"step": 2}


def test_ddp_checkpoint_has_plain_names_and_loads_under_single_device(run1: dict) -> None:
    path = Path(run1["ckpt_dir"]) / "ddp.ckpt"
    saved = torch.load(path, weights_only=True)["model"]["model"]
    assert sorted(saved) == sorted([*run1["saved_params"], "tag"])
    assert not any(key.startswith("module.") for key in saved)
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model = engine.setup(w.make_model(seed=11))
    engine.load(path, {"model": model})
    assert w.max_diff(w.named_params(model), run1["saved_params"]) == 0.0


def test_single_device_checkpoint_loads_under_ddp_on_every_rank(run1: dict) -> None:
    assert run1["single_to_ddp_all_ranks"] == [True, True]


def test_post_local_sgd_checkpoint_resumes_the_averager(run2: dict) -> None:
    assert run2["resumed_averager_step"] == 9
    assert run2["resumed_params_equal"] is True
    # The same file loads under single_device into a plain optimizer.
    path = Path(run2["ckpt_dir"]) / "post_local.ckpt"
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model = w.make_model(seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR)
    model, opt = engine.setup(model, opt)
    engine.load(path, {"model": model, "optimizer": opt})
    assert w.max_diff(w.named_params(model), run2["post_local_params"]) == 0.0

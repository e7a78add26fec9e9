"""Real gloo runs of ``tp`` (2 processes) and ``fsdp_tp`` (4 processes, a 2 x 2 mesh), many checks per launch.

The 4-process launch trains the small transformer with a string plan and with a parallelize callable,
a Hugging Face Llama with its own plan, and writes a sharded checkpoint; the 2-process launch trains under
``tp`` and loads that checkpoint at 1 x 2 and under ``fsdp``; the pytest process consolidates it and loads it
under ``single_device``. Every comparison is against plain torch in one process on the global batch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import tp_workers as w

import stratagem as sg

TOL = 1e-5
LLAMA_TOL = 1e-4
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def run4(workdir: Path) -> dict[str, Any]:
    return sg.Engine(strategy="fsdp_tp", accelerator="cpu", devices=4).launch(
        w.four_process_checks, str(workdir)
    )


@pytest.fixture(scope="module")
def run2(run4: dict[str, Any], workdir: Path) -> dict[str, Any]:
    # After run4: it loads the checkpoint run4 wrote.
    return sg.Engine(strategy="tp", accelerator="cpu", devices=2).launch(w.two_process_checks, str(workdir))


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return w.reference()


def _ok(run: dict[str, Any], key: str) -> dict[str, Any]:
    assert key in run, run.get("errors", {}).get(key, f"no result {key!r}")
    return run[key]


def test_untrained_gap_is_far_above_the_tolerance(ref: dict) -> None:
    # What a run that never trained (or trained wrong) would show against the reference.
    untrained = w.max_diff({n: p.detach() for n, p in w.make_model().named_parameters()}, ref["params"])
    assert untrained > 1000 * TOL
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("key", ["string", "callable", "meta_init"])
def test_tp_matches_one_process_reference(run2: dict, ref: dict, key: str) -> None:
    result = _ok(run2, key)
    assert w.max_diff(result["params"], ref["params"]) < TOL
    assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert result["sampler_replicas"] == 1  # every tp rank sees the whole batch


@pytest.mark.parametrize("key", ["string", "callable", "meta_options"])
def test_fsdp_tp_matches_one_process_reference(run4: dict, ref: dict, key: str) -> None:
    result = _ok(run4, key)
    assert w.max_diff(result["params"], ref["params"]) < TOL
    assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert result["sampler_replicas"] == 2


def test_fsdp_tp_on_two_processes_is_a_1_by_2_mesh_and_matches_the_reference(run2: dict, ref: dict) -> None:
    result = _ok(run2, "fsdp_tp_1x2")
    assert result["mesh"] == ((1, 2), ("dp", "tp"))
    assert w.max_diff(result["params"], ref["params"]) < TOL
    assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert result["sampler_replicas"] == 1  # one dp rank: both tp ranks see the whole batch
    shapes, placements = result["local_shapes"], result["placements"]
    assert shapes["blocks.0.attn.q.weight"] == ((8, 16), (16, 16))  # half over tp, all of it over dp
    # A 2-D DTensor: FSDP's placement on dp (a strided shard of one rank), rows split on tp.
    assert (
        len(placements["blocks.0.attn.q.weight"]) == 2 and placements["blocks.0.attn.q.weight"][1] == "S(0)"
    )
    assert shapes["norm.weight"] == ((16,), (16,)) and placements["norm.weight"] == ["S(0)"]


def test_demo_under_fsdp_tp_on_four_processes_splits_its_model(run4: dict, workdir: Path) -> None:
    """`stratagem demo --strategy fsdp_tp --devices 4`: the default 1 x 4 mesh with the demo model's tp_plan
    holds about a quarter per rank (not all of it, as without a plan) and trains as one process does."""
    from stratagem.cli.demo.lm import run

    report = _ok(run4, "demo")
    assert report["mesh"] == {"shape": (1, 4), "names": ("dp", "tp")}
    for rank in report["ranks"]:
        for part in ("parameters", "gradients", "optimizer"):
            # The LayerNorms and row-split biases (0.9 K of 111.7 K parameters) stay whole on every rank.
            assert 0.25 <= rank[part] / report["replica"][part] < 0.26, (part, rank)
    threads = torch.get_num_threads()
    try:
        one = run(
            strategy="single_device",
            steps=w.DEMO_STEPS,
            root_dir=str(workdir / "demo-one"),
            progress_bar=False,
        )
    finally:
        torch.set_num_threads(threads)
    # The same batches (one data-parallel rank); a wrong split is off by tenths after one step.
    assert report["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert report["losses"][-1] < report["losses"][0] - 0.3


def test_demo_takes_a_strategy_name_with_options(run4: dict) -> None:
    """`stratagem demo --strategy "fsdp_tp[tp_size=2]" --devices 4`: the options reach the strategy, which
    makes a 2 x 2 mesh; FSDP over dp and the plan over tp leave each rank about a quarter."""
    report = _ok(run4, "demo_2x2")
    assert report["mesh"] == {"shape": (2, 2), "names": ("dp", "tp")}
    for rank in report["ranks"]:
        for part in ("parameters", "gradients", "optimizer"):
            assert 0.24 <= rank[part] / report["replica"][part] < 0.26, (part, rank)
    assert report["losses"][-1] < report["losses"][0] - 0.3


def test_fsdp_tp_units_and_activation_checkpointing(run4: dict) -> None:
    result = _ok(run4, "meta_options")
    assert result["units"] == ["<root>", "blocks.0", "blocks.1"]
    assert result["checkpointed"] == 2


def test_trainer_sees_the_mesh_in_configure_model_and_matches_the_reference(run2: dict, ref: dict) -> None:
    result = _ok(run2, "trainer")
    assert result["mesh"] == ((2,), ("tp",)) and result["heads_per_rank"] == 2
    assert w.max_diff(result["params"], ref["params"]) < TOL


#: bf16 against float32 training: a bfloat16 rounding (8 bits of mantissa, 4e-3 relative) per op, not a
#: different trajectory. Three steps move the loss by 0.4 (3.48 -> 3.05 -> 2.70), 20 times this bound.
BF16_LOSS_TOL = 2e-2


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_declared_low_precisions_train(run2: dict, run4: dict, ref: dict, precision: str) -> None:
    for run in (run2, run4):
        result = _ok(run, precision)
        assert result["output_dtype"] == "torch.bfloat16"
        assert result["param_dtype"] == ("torch.float32" if precision == "bf16-mixed" else "torch.bfloat16")
        assert result["losses"] == pytest.approx(ref["losses"][:3], abs=BF16_LOSS_TOL)
    assert ref["losses"][0] - ref["losses"][2] > 20 * BF16_LOSS_TOL


def test_meshes(run2: dict, run4: dict) -> None:
    assert run2["registered"] == "tp" and run4["registered"] == "fsdp_tp"
    assert _ok(run2, "string")["mesh"] == ((2,), ("tp",))
    assert _ok(run4, "string")["mesh"] == ((2, 2), ("dp", "tp"))
    # Default tensor_parallel_size: the ranks of one node (all 4 here), capped by what divides the world.
    assert tuple(_ok(run4, "default_mesh")) == (1, 4)


def test_tp_holds_half_of_each_split_weight(run2: dict) -> None:
    shapes = _ok(run2, "string")["local_shapes"]
    assert shapes["blocks.0.attn.q.weight"] == ((8, 16), (16, 16))  # colwise: half the rows
    assert shapes["blocks.0.attn.q.bias"] == ((8,), (16,))
    assert shapes["blocks.1.attn.out.weight"] == ((16, 8), (16, 16))  # rowwise: half the columns
    assert shapes["blocks.1.attn.out.bias"] == ((16,), (16,))  # replicated
    assert shapes["blocks.0.mlp.fc1.weight"] == ((32, 16), (64, 16))
    assert shapes["embed.weight"] == ((16, 16), (32, 16))  # vocabulary split
    assert shapes["head.weight"] == ((16, 16), (32, 16))
    assert shapes["norm.weight"] == ((16,), (16,))  # no entry: whole on every rank


def test_fsdp_tp_holds_a_quarter_of_each_split_weight(run4: dict) -> None:
    result = _ok(run4, "string")
    shapes = result["local_shapes"]
    assert shapes["blocks.0.attn.q.weight"] == ((4, 16), (16, 16))
    assert shapes["blocks.1.attn.out.weight"] == ((8, 8), (16, 16))
    assert shapes["blocks.0.mlp.fc2.weight"] == ((8, 32), (16, 64))
    assert shapes["embed.weight"] == ((8, 16), (32, 16))
    # Replicated over tp, sharded over dp: half.
    assert shapes["norm.weight"] == ((8,), (16,))
    placements = result["placements"]
    assert placements["blocks.0.attn.q.weight"][1] == "S(0)" and placements["norm.weight"] == ["S(0)"]


def test_plan_was_applied_as_given(run2: dict) -> None:
    applied = _ok(run2, "string")["applied"]
    assert applied["source"] == "option"
    assert applied["styles"]["blocks.1.attn.k"] == "ColwiseParallel"
    assert applied["styles"]["blocks.0.mlp.fc2"] == "RowwiseParallel"
    assert len(applied["styles"]) == 2 + 2 * 6


def test_bad_input_is_a_clear_error(run2: dict, run4: dict) -> None:
    errors = _ok(run2, "errors_bad_input")
    assert "unknown style 'colwize'" in errors["unknown_style"] and "'colwise'" in errors["unknown_style"]
    assert "'layers.*.mlp.fc1' matches no module" in errors["no_match"]
    assert "blocks.0.mlp.fc1" in errors["no_match"]  # the names that exist
    assert "num_heads=1 is not divisible by the tensor-parallel size 2" in errors["heads"]
    assert "blocks.0.norm1" in errors["not_linear"] and "LayerNorm" in errors["not_linear"]
    assert "tensor_parallel_size=4" in errors["tp_size"]
    assert "does not divide the world size 4" in run4["bad_size"] and "[1, 2, 4]" in run4["bad_size"]


# -------------------------------------------------------------------------------------------------
# checkpoints: 2 x 2 -> 1 x 2, -> fsdp at 2, -> single_device after consolidation
# -------------------------------------------------------------------------------------------------


def _saved(run4: dict) -> tuple[dict, dict]:
    result = _ok(run4, "string")
    return result["params"], result["saved_optimizer"]


@pytest.mark.parametrize("key", ["load_tp", "load_fsdp", "load_ddp_full"])
def test_sharded_2x2_checkpoint_loads_bit_equal(run2: dict, run4: dict, key: str) -> None:
    params, optimizer = _saved(run4)
    loaded = _ok(run2, key)
    assert w.max_diff(loaded["params"], params) == 0.0
    assert sorted(loaded["optimizer"]) == sorted(optimizer)
    for name, state in optimizer.items():
        for k, v in state.items():
            assert torch.equal(loaded["optimizer"][name][k], v), (name, k)
    assert loaded["rest"]["step"] == w.STEPS


def test_consolidated_checkpoint_loads_under_single_device_bit_equal(run4: dict, workdir: Path) -> None:
    params, optimizer = _saved(run4)
    target = workdir / "consolidated.pt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratagem",
            "checkpoint",
            "consolidate",
            str(workdir / "fsdp_tp_2x2"),
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    engine = sg.Engine("single_device", accelerator="cpu")
    model = w.make_model(seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=w.LR)
    model, opt = engine.setup(model, opt)
    rest = engine.load(target, {"model": model, "optimizer": opt})
    assert w.max_diff(w.full_params(model), params) == 0.0
    loaded = w.full_optimizer(model, opt)
    for name, state in optimizer.items():
        for k, v in state.items():
            assert torch.equal(loaded[name][k], v), (name, k)
    assert rest["step"] == w.STEPS
    engine.teardown()


class TrainedLM(w.TinyLM, sg.Module):
    """The tests' model as a Module, for ``load_from_checkpoint``."""


def test_load_from_checkpoint_of_the_sharded_2x2_checkpoint_in_one_process(run4: dict, workdir: Path) -> None:
    # Offline, no process group: the DTensors sharded over dp and tp read back whole.
    result = _ok(run4, "string")
    module = TrainedLM.load_from_checkpoint(workdir / "fsdp_tp_2x2", heads=w.HEADS)
    assert w.max_diff({n: p.detach() for n, p in module.named_parameters()}, result["params"]) == 0.0
    tokens = w.dataset()[: w.GLOBAL_BATCH][0]
    with torch.no_grad():
        logits, untrained = module(tokens), w.make_model()(tokens)
    # Against what the 2 x 2 model computed: float32 sums split over tp add up in another order.
    probe = result["probe_logits"]
    scale = float(probe.abs().max())
    assert float((logits - probe).abs().max()) < 1e-5 * scale
    assert float((untrained - probe).abs().max()) > 1e-1 * scale


# -------------------------------------------------------------------------------------------------
# Hugging Face Llama with its own plan
# -------------------------------------------------------------------------------------------------


def test_hf_llama_trains_under_fsdp_tp_with_its_own_plan(run4: dict) -> None:
    result = _ok(run4, "llama")
    expected = w.llama_reference()
    assert result["model_plan"]["model.layers.*.self_attn.q_proj"] == "colwise"
    assert result["applied"]["source"] == "model.tp_plan"
    assert result["applied"]["styles"]["model.layers.1.mlp.down_proj"] == "RowwiseParallel"
    assert result["local_shapes"]["model.layers.0.self_attn.q_proj.weight"] == ((8, 32), (32, 32))
    assert result["local_shapes"]["model.layers.0.self_attn.k_proj.weight"] == ((4, 32), (16, 32))
    # transformers' embedding_rowwise: the vocabulary split over tp, then the rows halved again over dp.
    assert result["model_plan"]["model.embed_tokens"] == "embedding_rowwise"
    assert result["local_shapes"]["model.embed_tokens.weight"] == ((16, 32), (64, 32))
    assert result["local_shapes"]["lm_head.weight"] == ((16, 32), (64, 32))
    untrained = w.max_diff({n: p.detach() for n, p in w.make_llama().named_parameters()}, expected["params"])
    assert untrained > 100 * LLAMA_TOL
    assert w.max_diff(result["params"], expected["params"]) < LLAMA_TOL
    assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4)

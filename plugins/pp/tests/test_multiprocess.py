"""Real gloo runs of the pipeline strategies, many checks per launch, driven by the raw pipeline step.

Launch A (2 processes, ``pp``): every schedule at 2 stages (and the interleaved ones at 4 stages, 2 per rank),
a model built on the meta device, a tiny Hugging Face Llama split by its own ``base_model_pp_plan``, and bad
input. Launch B (4 processes): ``pp`` at 4 stages with 1f1b and with interleaved_1f1b (8 stages, 2 per rank),
``pp_fsdp`` 2 x 2 (also from the meta device), ``pp_fsdp_tp`` 2 x 1 x 2. Launch C: a rank that dies in the
middle of a schedule. Every comparison is against plain torch in one process on the global batch.
"""

from __future__ import annotations

import time
from typing import Any

import pp_workers as w
import pytest

import stratagem as sg
from stratagem.errors import WorkerFailedError

TOL = 1e-5
LLAMA_TOL = 1e-4
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def run2() -> dict[str, Any]:
    return sg.Engine(strategy="pp", accelerator="cpu", devices=2).launch(w.two_process_checks)


@pytest.fixture(scope="module")
def run4() -> dict[str, Any]:
    return sg.Engine(strategy="pp", accelerator="cpu", devices=4).launch(w.four_process_checks)


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return w.reference()


def _ok(run: dict[str, Any], key: str) -> dict[str, Any]:
    assert key in run, run.get("errors", {}).get(key, f"no result {key!r}")
    return run[key]


def _matches(result: dict[str, Any], ref: dict[str, Any], tol: float = TOL) -> None:
    assert w.rel_diff(result["params"], ref["params"]) < tol
    assert result["losses"] == pytest.approx(ref["losses"], rel=tol)
    assert result["norms"] == pytest.approx(ref["norms"], rel=tol)
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], rel=tol)


def test_untrained_model_is_far_outside_the_tolerance(ref: dict) -> None:
    untrained = {n: p.detach() for n, p in w.make_model().named_parameters()}
    assert w.rel_diff(untrained, ref["params"]) > 1000 * TOL
    assert ref["losses"][-1] < ref["losses"][0] - 1.0
    # Clipping is active in some steps: the norms the strategy reports are checked against these.
    assert max(ref["norms"]) > w.MAX_NORM


@pytest.mark.parametrize("key", [f"{s}/{r}" for s, r in w.TWO_PROCESS_SCHEDULES])
def test_pp_on_two_processes_matches_one_process(run2: dict, ref: dict, key: str) -> None:
    result = _ok(run2, key)
    _matches(result, ref)
    spr = int(key.split("/")[1])
    assert len(result["stages"]) == 2 * spr and result["microbatches"] == 2 * spr
    assert result["source"] == "even"


def test_stages_sit_on_ranks_by_schedule(run2: dict) -> None:
    # Loop placement: rank 0 runs stages 0 and 2; V placement: stages 0 and 3 (first and last on rank 0).
    assert _ok(run2, "interleaved_1f1b/2")["local_stages"] == [0, 2]
    assert _ok(run2, "zbv_zero_bubble/2")["local_stages"] == [0, 3]
    assert _ok(run2, "1f1b/1")["local_stages"] == [0]
    # Rank 0's parameters are its stages' only, under their names in the whole model.
    shapes = _ok(run2, "1f1b/1")["local_shapes"]
    assert {n.split(".")[0] for n in shapes} == {"embed", "blocks"}
    assert {n.split(".")[1] for n in shapes if n.startswith("blocks.")} == {"0", "1", "2", "3"}
    assert _ok(run2, "1f1b/1")["stages"] == [
        ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3"],
        ["blocks.4", "blocks.5", "blocks.6", "blocks.7", "norm", "head"],
    ]


def test_meta_device_model_initialises_as_one_process(run2: dict, run4: dict, ref: dict) -> None:
    _matches(_ok(run2, "meta_init"), ref)
    _matches(_ok(run4, "pp_fsdp_meta"), ref)


@pytest.mark.parametrize("key", ["pp4/1f1b", "pp4/interleaved_1f1b"])
def test_pp_on_four_processes_matches_one_process(run4: dict, ref: dict, key: str) -> None:
    result = _ok(run4, key)
    _matches(result, ref)
    expected_stages = 4 if key.endswith("1f1b") and "interleaved" not in key else 8
    assert len(result["stages"]) == expected_stages
    assert result["mesh"] == ((4,), ("pp",))


def test_pp_fsdp_2x2_shards_each_stage(run4: dict, ref: dict) -> None:
    result = _ok(run4, "pp_fsdp")
    _matches(result, ref)
    assert result["mesh"] == ((2, 2), ("pp", "dp"))
    assert result["sampler"] == {"num_replicas": 2, "rank": 0}
    shapes = result["local_shapes"]
    # Rank 0: stage 0 only (embed, blocks 0-3), each parameter halved over dp.
    assert shapes["blocks.0.attn.q.weight"] == ((8, 16), (16, 16))
    assert shapes["blocks.3.mlp.fc1.weight"] == ((32, 16), (64, 16))
    assert shapes["embed.weight"] == ((16, 16), (32, 16))
    assert not any(n.startswith(("blocks.4.", "head.", "norm.")) for n in shapes)
    # The stage's blocks are the FSDP units (sharded innermost first); the stage view is the root.
    assert sorted(result["units"][0]) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def test_activation_checkpointing_per_stage(run4: dict, ref: dict) -> None:
    # Recomputed blocks (checkpoint wrappers inside each stage's FSDP units), zero bubble's split backward.
    result = _ok(run4, "pp_fsdp_checkpointing")
    _matches(result, ref)
    assert result["checkpointed"] == 4  # rank 0: stages 0 and 2 of 4, two blocks each
    assert sorted(result["units"][0]) == ["blocks.0", "blocks.1"]


def test_pp_fsdp_resharding_after_forward_with_1f1b(run4: dict, ref: dict) -> None:
    _matches(_ok(run4, "pp_fsdp_resharding"), ref)


def test_pp_fsdp_tp_2x1x2_splits_tensors_in_each_stage(run4: dict, ref: dict) -> None:
    result = _ok(run4, "pp_fsdp_tp")
    _matches(result, ref)
    assert result["mesh"] == ((2, 1, 2), ("pp", "dp", "tp"))
    shapes = result["local_shapes"]
    assert shapes["blocks.0.attn.q.weight"] == ((8, 16), (16, 16))  # colwise: half the rows
    assert shapes["blocks.1.attn.out.weight"] == ((16, 8), (16, 16))  # rowwise: half the columns
    assert shapes["blocks.2.mlp.fc2.weight"] == ((16, 32), (16, 64))
    assert shapes["embed.weight"] == ((16, 16), (32, 16))  # vocabulary split
    assert shapes["blocks.0.norm1.weight"] == ((16,), (16,))  # no entry: whole
    styles = result["tp_styles"][0]
    assert styles["embed"] == "RowwiseParallel" and styles["blocks.3.mlp.fc1"] == "ColwiseParallel"
    # Stage 0 holds no head: the plan's "head" entry applies on the last stage only.
    assert "head" not in styles


def test_hf_llama_splits_by_its_own_plan(run2: dict) -> None:
    result = _ok(run2, "llama")
    expected = w.reference(w.make_llama(), w.llama_data(), w.llama_loss)
    assert result["source"] == "hf"
    assert result["stages"] == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3", "model.norm", "lm_head"],
    ]
    untrained = {n: p.detach() for n, p in w.make_llama().named_parameters()}
    assert w.rel_diff(untrained, expected["params"]) > 100 * LLAMA_TOL
    _matches(result, expected, LLAMA_TOL)


def test_bad_input_is_refused_before_training(run2: dict, run4: dict) -> None:
    bad = _ok(run2, "bad_batch")
    assert "microbatches=3 does not divide the per-process batch of 8" in bad["batch"]
    assert "[1, 2, 4, 8]" in bad["batch"]
    # The pruned model is not the whole model: calling it, or backward outside the schedule, is refused.
    for misuse in ("call", "backward"):
        assert "runs forward and backward of every micro-batch inside its schedule" in bad[misuse]
    message = run2["too_many_stages"]
    assert "16 pipeline stages" in message and "8 blocks in 'blocks'" in message
    assert "pipeline_parallel_size=3 does not divide the world size 4" in run4["bad_size"]


def test_a_rank_dying_mid_schedule_ends_the_run_naming_it() -> None:
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as failure:
        sg.Engine(strategy="pp", accelerator="cpu", devices=2).launch(w.dying_rank)
    assert failure.value.rank == 1 and failure.value.exitcode == 7
    assert "rank 1" in str(failure.value)
    # Rank 0 was blocked in a receive from rank 1; the launcher stopped it rather than letting it wait.
    assert time.monotonic() - started < 120

"""Real gloo runs of the pipeline strategies through the Trainer, many checks per launch (see ``pp_runs``).

Every comparison is against plain torch in one process on the global batch (float64): parameters after 10
AdamW steps with gradient clipping, each step's loss as the Trainer reports it, and the validation loss.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pp_runs as runs
import pp_workers as w
import pytest
import torch

import stratagem as sg
from stratagem.errors import WorkerFailedError

TOL = 1e-5
# The Llama's attention and RMSNorm in float32 sum in another order per micro-batch than the one-process
# reference: 1.3e-4 was measured on the CI machine (1e-4 here); an untrained model is 0.87 away.
LLAMA_TOL = 5e-4
HERE = Path(__file__).parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pp")


@pytest.fixture(scope="module")
def run2(root: Path) -> dict[str, Any]:
    return sg.Engine(strategy="pp", accelerator="cpu", devices=2).launch(
        runs.two_process_checks, str(root / "a")
    )


@pytest.fixture(scope="module")
def sharded(root: Path, run2: dict) -> Path:
    """The step-5 checkpoint of launch A's 1f1b run: a DCP directory written by 2 pipeline stages."""
    return root / "a" / runs.CKPT_RUN / "checkpoints" / f"step-{runs.CKPT_EVERY:06d}"


@pytest.fixture(scope="module")
def run4(root: Path, run2: dict, sharded: Path) -> dict[str, Any]:
    checkpoints = {"sharded": str(sharded), "full": str(root / "a" / "final-full.ckpt")}
    engine = sg.Engine(strategy="pp", accelerator="cpu", devices=4)
    return engine.launch(runs.four_process_checks, str(root / "b"), checkpoints)


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return w.reference()


def _ok(run: dict[str, Any], key: str) -> dict[str, Any]:
    assert key in run, run.get("errors", {}).get(key, f"no result {key!r}")
    return run[key]


def _matches(result: dict[str, Any], ref: dict[str, Any], tol: float = TOL) -> None:
    assert w.rel_diff(result["params"], ref["params"]) < tol
    assert result["losses"] == pytest.approx(ref["losses"], rel=tol)
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], rel=tol)


def test_untrained_model_is_far_outside_the_tolerance(ref: dict) -> None:
    untrained = {n: p.detach() for n, p in w.make_model().named_parameters()}
    assert w.rel_diff(untrained, ref["params"]) > 1000 * TOL
    assert ref["losses"][-1] < ref["losses"][0] - 1.0
    # Clipping is active in some steps, so the strategy's pipeline-wide norm shapes the result.
    assert max(ref["norms"]) > w.MAX_NORM


@pytest.mark.parametrize("key", [f"{s}/{r}" for s, r in w.TWO_PROCESS_SCHEDULES])
def test_pp_on_two_processes_matches_one_process(run2: dict, ref: dict, key: str) -> None:
    result = _ok(run2, key)
    _matches(result, ref)
    spr = int(key.split("/")[1])
    assert len(result["stages"]) == 2 * spr and result["microbatches"] == 2 * spr
    assert result["source"] == "even" and result["step"] == w.STEPS


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
    _matches(_ok(run4, "pp_fsdp_meta_resharding"), ref)


def test_a_custom_loop_through_engine_train_batch(run2: dict, ref: dict) -> None:
    _matches(_ok(run2, "engine_loop"), ref)


def test_compiled_stages_match_one_eager_process(run2: dict, ref: dict) -> None:
    result = _ok(run2, "compiled")
    _matches(result, ref)
    assert result["checkpointed"] == 4  # rank 0: stages 0 and 2 of 4, two blocks each, recomputed in backward
    blocks = {0: ["blocks.0", "blocks.1"], 1: ["blocks.2", "blocks.3"], 2: ["blocks.4", "blocks.5"]}
    blocks[3] = ["blocks.6", "blocks.7"]
    # Each rank compiled the blocks of its own stages, stage by stage, and Dynamo compiled frames there.
    for rank, (first, second) in enumerate([(0, 2), (1, 3)]):
        seen = result["ranks"][rank]
        assert seen["by_stage"] == {first: blocks[first], second: blocks[second]}
        assert seen["regions"] == blocks[first] + blocks[second]
        assert seen["frames"] >= 1
        # Given as torch.compile(module, backend="aot_eager"): the Trainer holds the module, compiled with that
        # backend in the pipeline's place, and rank 0 said so in one line.
        assert seen["holds"] == "LM"
        notes = [line for line in seen["printed"] if "came compiled by torch.compile" in line]
        if rank == 0:
            assert len(notes) == 1 and notes[0].endswith("(backend=aot_eager)."), seen["printed"]
        else:
            assert notes == [], seen["printed"]
    # Parameter names stay the plain model's (no _orig_mod, no checkpoint wrapper in them).
    assert sorted(result["params"]) == sorted(ref["params"])


def test_a_full_checkpoint_lists_names_in_the_models_order(run2: dict) -> None:
    # Rank 0 held stages 0 and 2: merged rank by rank, blocks 4-5 would come before blocks 2-3, and an optimizer
    # state loaded by position elsewhere (single_device) would give each parameter another's moments.
    order = _ok(run2, "compiled")["full_order"]
    names = [n for n, _ in w.make_model().named_parameters()]
    assert order["model"] == list(w.make_model().state_dict())
    assert order["optimizer_state"] == names and order["optimizer_groups"] == [names]


def _predicts_as_one_process(result: dict[str, Any], batch: int) -> None:
    """Rank 0's predictions are the trained model's forward in one process, batched as one process batches them;
    an untrained model's are far off."""
    predictions = result["predictions"]
    count = len(result["predict_tokens"])
    sizes = [batch] * (count // batch) + ([count % batch] if count % batch else [])
    assert [p.shape for p in predictions] == [(size, w.SEQUENCE, w.VOCAB) for size in sizes]
    trained = w.make_model()
    trained.load_state_dict(result["params"])
    with torch.no_grad():
        expected = trained(result["predict_tokens"])
        untrained = w.make_model()(result["predict_tokens"])
    got = torch.cat(predictions)
    assert float((got - expected).abs().max()) < 1e-8 * float(expected.abs().max())
    assert float((untrained - expected).abs().max()) > 1e-2 * float(expected.abs().max())


def test_predict_returns_the_last_stages_outputs_on_rank_zero(run2: dict) -> None:
    # 12 samples in batches of 8: the second batch, of 4, has micro-batches of another shape than the first's.
    _predicts_as_one_process(_ok(run2, "compiled"), w.GLOBAL_BATCH)


@pytest.mark.parametrize("key", ["pp_fsdp", "pp_fsdp_tp"])
def test_predict_under_sharded_stages_returns_every_replicas_share_in_order(run4: dict, key: str) -> None:
    # pp_fsdp: 10 samples over two replicas, each predicting every other sample in batches of 4, then a batch
    # of 1 that the 2 micro-batches do not divide; pp_fsdp_tp: 12 samples in batches of 8 on one replica whose
    # last stage's head is split over tp and gathered.
    _predicts_as_one_process(_ok(run4, key), 4 if key == "pp_fsdp" else w.GLOBAL_BATCH)


def test_a_shorter_last_batch_trains_and_validates_as_one_process(run2: dict) -> None:
    # Every other step a batch of 4 after one of 8: the stages learn the new micro-batch shape each time.
    data = w.uneven_batches()
    result, expected = _ok(run2, "shorter_batches"), w.reference(data=data)
    assert w.rel_diff(result["params"], expected["params"]) < TOL
    assert result["losses"] == pytest.approx(expected["losses"], rel=TOL)
    trained = w.make_model()
    trained.load_state_dict(expected["params"])
    with torch.no_grad():
        val_loss = sum(float(w.loss_fn(trained(x), y)) for x, y in data[:2]) / 2
    assert result["eval_loss"] == pytest.approx(val_loss, rel=TOL)


@pytest.mark.parametrize("key", ["pp4/1f1b", "pp4/interleaved_1f1b"])
def test_pp_on_four_processes_matches_one_process(run4: dict, ref: dict, key: str) -> None:
    result = _ok(run4, key)
    _matches(result, ref)
    assert len(result["stages"]) == (8 if "interleaved" in key else 4)
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


def test_the_demo_under_pp_fsdp_on_four_processes(run4: dict) -> None:
    # What `stratagem demo --strategy pp_fsdp --devices 4` runs: the demo's plan puts the embeddings and the
    # first block on stage 0 (ranks 0 and 1, sharded between them), the rest on stage 1 (ranks 2 and 3).
    report = _ok(run4, "demo_pp_fsdp")
    assert report["mesh"] == {"shape": (2, 2), "names": ("pp", "dp")}
    assert report["modules"] == [["tok", "pos", "blocks.0"]] * 2 + [["blocks.1", "ln", "head"]] * 2
    losses = report["losses"]
    assert len(losses) == report["steps"] == 6 and losses[-1] < losses[0] - 0.5, losses
    assert len(report["ranks"]) == 4
    shares = [rank["parameters"] / report["replica"]["parameters"] for rank in report["ranks"]]
    # Half a stage each: well under half a replica per rank, one replica over the four (FSDP2's padding aside).
    assert all(0.05 < share < 0.45 for share in shares), shares
    assert sum(shares) == pytest.approx(1.0, abs=0.02), shares


# -------------------------------------------------------------------------------------------------
# checkpoints
# -------------------------------------------------------------------------------------------------


def test_exact_resume_under_pp(run2: dict) -> None:
    straight, resumed = _ok(run2, runs.CKPT_RUN), _ok(run2, "resumed")
    assert resumed["step"] == w.STEPS and len(resumed["losses"]) == w.STEPS - runs.CKPT_EVERY
    assert w.bit_equal(resumed["params"], straight["params"]) == []
    assert resumed["losses"] == straight["losses"][runs.CKPT_EVERY :]


def test_a_full_checkpoint_holds_every_stage(run2: dict) -> None:
    # Written by the two stages, gathered on rank 0: the whole model, bit for bit.
    resumed = _ok(run2, "resumed")
    assert w.bit_equal(resumed["full_file"], resumed["params"]) == []


def test_a_sharded_checkpoint_at_pp2_loads_under_fsdp_and_pp4(run2: dict, run4: dict) -> None:
    saved = _ok(run2, runs.CKPT_RUN)["snapshot"]
    assert saved is not None and len(saved["params"]) == 1 + 8 * 15 + 4
    for loaded in (_ok(run2, "fsdp_loads"), _ok(run4, "pp4_loads_sharded")):
        assert loaded["step"] == runs.CKPT_EVERY
        assert w.bit_equal(loaded["params"], saved["params"]) == []
        assert w.bit_equal(loaded["optimizer"], saved["optimizer"]) == []
    # The full checkpoint written at 2 stages, loaded at 4.
    final = _ok(run4, "pp4_loads_full")
    assert w.bit_equal(final["params"], _ok(run2, "resumed")["params"]) == []


def test_a_sharded_checkpoint_at_pp2_loads_under_single_device_after_consolidation(
    run2: dict, sharded: Path, tmp_path: Path
) -> None:
    from stratagem.checkpoint import consolidate

    consolidate(sharded, tmp_path / "whole.ckpt")
    engine = sg.Engine("single_device", accelerator="cpu")
    model = w.make_model(seed=5)
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=w.LR))
    engine.load(tmp_path / "whole.ckpt", {"model": model, "optimizer": opt})
    saved = _ok(run2, runs.CKPT_RUN)["snapshot"]
    assert w.bit_equal({n: p.detach() for n, p in model.named_parameters()}, saved["params"]) == []
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: dict(s) for p, s in opt.optimizer.state.items()}
    assert w.bit_equal(state, saved["optimizer"]) == []


# -------------------------------------------------------------------------------------------------
# bad input, a dying rank, restarts
# -------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_before_training(run2: dict, run4: dict) -> None:
    bad = run2["bad"]
    assert all(case["batches"] == 0 for case in bad.values()), bad
    assert "microbatches=3 does not divide the per-process batch of 8 samples" in bad["microbatches"]["error"]
    assert "[1, 2, 4, 8]" in bad["microbatches"]["error"]
    assert (
        "cannot call training_step. Give StepOnly compute_loss(outputs, targets)" in bad["step_only"]["error"]
    )
    message = bad["stages"]["error"]
    assert "16 pipeline stages" in message and "8 blocks in 'blocks'" in message
    assert "pipeline_parallel_size=3 does not divide the world size 4" in run4["bad_size"]
    accumulation = run4["bad_accumulation"]
    assert accumulation["batches"] == 1, accumulation  # the batch of 4 trained, the one of 2 refused
    assert "training batch of shapes [(2, 6)] came after batches of shapes [(4, 6)]" in accumulation["error"]
    assert "drop_last=True" in accumulation["error"]


def test_a_module_without_its_loss_is_refused_before_launching(tmp_path: Path) -> None:
    from stratagem_pp import PPStrategy

    trainer = sg.Trainer(strategy=PPStrategy(), accelerator="cpu", devices=2, default_root_dir=tmp_path)
    with pytest.raises(sg.ConfigurationError, match="runs forward and backward of each batch itself"):
        trainer.fit(runs.StepOnly(), w.loader())


def test_a_rank_dying_mid_schedule_ends_the_run_naming_it(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as failure:
        sg.Engine(strategy="pp", accelerator="cpu", devices=2).launch(runs.dying_rank, str(tmp_path))
    assert failure.value.rank == 1 and failure.value.exitcode == 7
    assert "rank 1" in str(failure.value)
    # Rank 0 was blocked in a receive from rank 1; the launcher stopped it rather than letting it wait.
    assert time.monotonic() - started < 120


def test_restarts_resume_and_end_as_an_uninterrupted_run(run2: dict, tmp_path: Path) -> None:
    """max_restarts=1: rank 1 dies mid-schedule at step 7 on the first attempt; the restarted workers resume
    from the step-5 checkpoint and end where the uninterrupted run of launch A ended, bit for bit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HERE / "pp_restart.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "restarting the workers (1 of 1 restarts)" in done.stderr
    assert "rank 1" in done.stdout and f"resumed from step {runs.CKPT_EVERY}" in done.stdout
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    assert w.bit_equal(params, _ok(run2, runs.CKPT_RUN)["params"]) == []

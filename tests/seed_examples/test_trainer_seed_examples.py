"""The seed examples of shared/seeds/ that the Trainer and the non-DeepSpeed plugins serve, adapted only in what
is Lightning-specific (imports, class names), on 2 CPU processes: test and predict after fit (seed 004) under
ddp, fsdp, tp and deepspeed_stage_3, ``load_from_checkpoint`` of what each wrote, ``precision="16-true"``,
FSDP auto-wrap, activation checkpointing and manual wrapping (seeds 000 and 001), and the DDP communication
hooks (seed 004). The DeepSpeed examples themselves are plugins/deepspeed_stub/tests/test_seed_examples.py's.

One launch runs every example (seed_runs.run_all); each test checks one against an independent reference
computed here: weights read back offline, predictions and metrics recomputed in this process, training
compared with one process of plain torch on the global batch.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import pytest
import seed_models as m
import torch
from seed_runs import STEPS, run_all

import stratagem as sg

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAVE_S3 = all(importlib.util.find_spec(p) is not None for p in ("moto", "s3fs", "boto3"))
EVAL_STRATEGIES = [
    "ddp",
    "fsdp",
    "tp",
    pytest.param(
        "deepspeed_stage_3",
        marks=[pytest.mark.deepspeed, pytest.mark.skipif(not HAVE_DEEPSPEED, reason="needs deepspeed")],
    ),
]
#: fp32: 2 processes differ from one on the global batch only in summation order (measured below 1e-6);
#: 4 AdamW steps at lr 1e-2 move the parameters by about 5e-2 in this measure, so an untrained run fails.
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("seed_examples")
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2, timeout=500)
    if not HAVE_S3:
        return {"s3": None, **engine.launch(run_all, str(workdir), None)}
    from s3_server import S3Server

    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    with S3Server() as server:
        server.create_bucket("seeds")
        os.environ.update(server.env())  # the workers inherit it
        try:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            result = engine.launch(run_all, str(workdir), "s3://seeds/runs")
            # Read back here while the server runs.
            for name in ("ddp", "fsdp"):
                run = result.get(f"eval/{name}", {})
                if "s3" in run:
                    run["s3_loaded"] = m.Regression.load_from_checkpoint(run["s3"]).state_dict()
            return {"s3": True, **result}
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _run(runs: dict[str, Any], name: str) -> dict[str, Any]:
    run = runs[name]
    assert "error" not in run, run["error"]
    return run


def _gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The relative distance of two parameter sets (on the names they share: the seed's manual-wrap model
    registers its layers under two names)."""
    got = {m.plain_name(k): v for k, v in got.items()}
    want = {m.plain_name(k): v for k, v in want.items()}
    names = sorted(set(got) & set(want))
    assert names, (sorted(got), sorted(want))
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in names)
    return math.sqrt(num / sum(float(want[k].double().norm() ** 2) for k in names))


def _moved(factory: Any, want: dict[str, torch.Tensor]) -> float:
    start = {k: v.detach() for k, v in m.initial(factory).named_parameters()}
    return _gap(start, want)


# -------------------------------------------------------------------------------------------------
# test / predict after fit, and load_from_checkpoint of what each strategy wrote
# -------------------------------------------------------------------------------------------------


def _replicas(strategy: str) -> int:
    return 1 if strategy == "tp" else 2  # tensor-parallel ranks share their batches


@pytest.mark.parametrize("strategy", EVAL_STRATEGIES)
def test_load_from_checkpoint_rebuilds_the_module_from_its_hyperparameters(runs: dict, strategy: str) -> None:
    run = _run(runs, f"eval/{strategy}")
    loaded = m.Regression.load_from_checkpoint(run["last"])
    assert dict(loaded.hparams) == {"width": 64, "lr": 1e-2, "optimizer": "adamw"}
    assert loaded.net[0].out_features == 64
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, run["params"][name], rtol=0, atol=0)
    # Overrides replace saved arguments (the weights still have to fit).
    assert m.Regression.load_from_checkpoint(run["last"], lr=0.5).hparams.lr == 0.5


@pytest.mark.parametrize("strategy", EVAL_STRATEGIES)
def test_test_after_fit_reduces_like_validation(runs: dict, strategy: str) -> None:
    run = _run(runs, f"eval/{strategy}")
    model = m.Regression.load_from_checkpoint(run["last"])
    want = m.expected_test_loss(model, _replicas(strategy))
    assert run["test"]["test_loss"] == pytest.approx(want, rel=1e-5)
    initial = m.expected_test_loss(m.initial(m.Regression), _replicas(strategy))
    assert want < 0.9 * initial  # trained: the metric is not that of the initial weights


@pytest.mark.parametrize("strategy", EVAL_STRATEGIES)
def test_predict_returns_the_whole_dataset_in_order_on_rank_0(runs: dict, strategy: str) -> None:
    run = _run(runs, f"eval/{strategy}")
    model = m.Regression.load_from_checkpoint(run["last"])
    x = m.eval_dataset().tensors[0]
    with torch.no_grad():
        want = model(x)
    for key in ("predict", "predict_last"):
        batches = run[key]
        # As one process batches the 37 samples (the sampler's repeated sample dropped), in dataset order,
        # although the loader given to the first call shuffles.
        assert [b.shape[0] for b in batches] == [m.MICRO] * 9 + [1], key
        torch.testing.assert_close(torch.cat(batches), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", EVAL_STRATEGIES)
def test_ckpt_path_best_loads_the_model_checkpoints_best(runs: dict, strategy: str) -> None:
    run = _run(runs, f"eval/{strategy}")
    scores = run["best_scores"]
    best = m.Regression.load_from_checkpoint(run["best"])
    want = m.expected_test_loss(best, _replicas(strategy))
    assert run["test_best"]["test_loss"] == pytest.approx(want, rel=1e-5)
    assert run["test_best"]["test_loss"] != pytest.approx(run["test"]["test_loss"], rel=1e-4)
    assert f"val_loss-{scores[0]:.6g}" in Path(run["best"]).name
    assert run["best_model_path"] == run["best"]
    # predict(ckpt_path="last") afterwards went back to the last weights: checked with "predict_last" above.


@pytest.mark.parametrize("strategy", EVAL_STRATEGIES)
def test_a_fresh_trainer_evaluates_a_checkpoint(runs: dict, strategy: str) -> None:
    run = _run(runs, f"eval/{strategy}")
    last = m.Regression.load_from_checkpoint(run["last"])
    best = m.Regression.load_from_checkpoint(run["best"])
    # validate(ckpt_path=last): the same reduction as test's, of val_loss.
    val = m.expected_test_loss(last, _replicas(strategy))
    assert run["fresh_validate"]["val_loss"] == pytest.approx(val, rel=1e-5)
    assert run["fresh_test"]["test_loss"] == pytest.approx(
        m.expected_test_loss(best, _replicas(strategy)), rel=1e-5
    )
    with torch.no_grad():
        want = best(m.eval_dataset().tensors[0])
    torch.testing.assert_close(torch.cat(run["fresh_predict"]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAVE_S3, reason="needs moto, s3fs and boto3 (requirements-test.txt)")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_load_from_checkpoint_reads_a_store(runs: dict, strategy: str) -> None:
    run = _run(runs, f"eval/{strategy}")
    assert run["s3"].startswith("s3://seeds/")
    for name, value in run["s3_loaded"].items():
        torch.testing.assert_close(value, run["params"][name], rtol=0, atol=0)


# -------------------------------------------------------------------------------------------------
# 16-true
# -------------------------------------------------------------------------------------------------


def _sgd() -> m.Regression:
    return m.Regression(optimizer="sgd", lr=0.05)


def _reference_16(replicas: int) -> dict[str, torch.Tensor]:
    """One process in float16 throughout, on the global batch (the ranks' first batches of the
    DistributedSampler split together: samples 0-7, 8-15, ...), with the run's SGD steps."""
    model = m.initial(_sgd, torch.float16)
    optimizer = model.configure_optimizers()
    loader = torch.utils.data.DataLoader(m.eval_dataset(), batch_size=m.MICRO * replicas)
    for _, (x, y) in zip(range(STEPS), loader):
        model.training_step((x.half(), y.half()), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().float() for k, v in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_sixteen_true_trains_in_float16(runs: dict, strategy: str) -> None:
    run = _run(runs, f"16-true/{strategy}")
    assert run["param_dtypes"] == ["torch.float16"] and run["step_dtypes"] == ["torch.float16"]
    assert all(v.dtype == torch.float16 for v in run["params"].values())
    want = _reference_16(_replicas(strategy))
    start = {k: v.detach().float() for k, v in m.initial(_sgd, torch.float16).named_parameters()}
    gap, moved = _gap({k: v.float() for k, v in run["params"].items()}, want), _gap(start, want)
    # float16 rounding differs with the order of sums; training moved the weights far more than that.
    assert gap < 0.05 * moved, (gap, moved)


# -------------------------------------------------------------------------------------------------
# seeds 000 / 001: FSDP
# -------------------------------------------------------------------------------------------------


def test_seed_000_auto_wrap_policy_shards_each_block(runs: dict) -> None:
    run = _run(runs, "seed000/auto_wrap")
    assert run["units"] == ["", "model.1", "model.2"]  # the root and each MyTransformerBlock
    assert run["checkpointed"] == [] and run["block_calls"] == [STEPS, STEPS]
    want = m.reference(m.BlockModel, STEPS)
    assert _gap(run["params"], want) < TOL < _moved(m.BlockModel, want)


def test_seed_001_encoder_decoder_policy_wraps_and_checkpoints_those_layers(runs: dict) -> None:
    run = _run(runs, "seed001/encoder_decoder")
    assert run["units"] == ["", "decoder", "encoder"]
    assert run["checkpointed"] == ["decoder", "encoder"]
    want = m.reference(m.EncoderDecoder, STEPS)
    assert _gap(run["params"], want) < TOL < _moved(m.EncoderDecoder, want)


def test_seed_000_activation_checkpointing_policy_recomputes_the_blocks(runs: dict) -> None:
    run = _run(runs, "seed000/checkpointing_policy")
    assert run["checkpointed"] == ["model.1", "model.2"]
    assert run["block_calls"] == [2 * STEPS, 2 * STEPS]  # forward, and again in backward
    want = m.reference(m.BlockModel, STEPS)
    assert _gap(run["params"], want) < TOL < _moved(m.BlockModel, want)


def test_seed_000_manual_wrap_with_torchs_wrap_shards_the_wrapped_layers(runs: dict) -> None:
    run = _run(runs, "seed000/manual_wrap")
    # The layers wrap() returned are units of their own (the seed's model registers each under two names;
    # modules are listed under the first).
    assert run["units"] == ["", "block.0", "block.1", "linear_layer"]
    want = m.reference(m.MyModel, STEPS)
    assert _gap(run["params"], want) < TOL < _moved(m.MyModel, want)


def test_seed_000_manual_wrap_with_activation_checkpointing(runs: dict) -> None:
    run = _run(runs, "seed000/manual_wrap_checkpointing")
    # The wrapped layers are units, inside the checkpoint wrappers apply_activation_checkpointing put around them.
    assert {"linear_layer", "block.0", "block.1"} <= {m.plain_name(u + ".").rstrip(".") for u in run["units"]}
    assert run["checkpointed"]  # apply_activation_checkpointing(self.model), left as the user applied it
    want = m.reference(lambda: m.MyModel(checkpointing=True), STEPS)
    assert _gap(run["params"], want) < TOL


def test_seed_000_manual_wrap_marks_units_under_fsdp_tp(runs: dict) -> None:
    # fsdp_tp on 2 processes is a 1 x 2 mesh; the layers wrap() marked become its FSDP units.
    run = _run(runs, "seed000/manual_wrap_fsdp_tp")
    assert run["units"] == ["", "block.0", "block.1", "linear_layer"]


def test_torchs_wrap_with_fsdp1_arguments_is_refused(runs: dict) -> None:
    raised = _run(runs, "seed000/wrap_overrides")["raised"]
    assert raised is not None and "wrap(Linear, cpu_offload=...)" in raised
    assert "per-module FSDP1 arguments" in raised and "set the options on FSDPStrategy(...)" in raised


def test_seed_000_wrap_is_a_no_op_under_ddp(runs: dict) -> None:
    run = _run(runs, "seed000/manual_wrap_ddp")
    assert run["units"] == []
    want = m.reference(m.MyModel, STEPS)
    assert _gap(run["params"], want) < TOL < _moved(m.MyModel, want)


# -------------------------------------------------------------------------------------------------
# seed 004: DDP communication hooks
# -------------------------------------------------------------------------------------------------


def test_seed_004_fp16_compress_hook(runs: dict) -> None:
    run = _run(runs, "seed004/fp16")
    assert run["comm_hook"] == "fp16_compress_hook"
    want = m.reference(m.BlockModel, STEPS)
    # Gradients travel in float16: close to the float32 reference, not equal to it.
    assert 1e-7 < _gap(run["params"], want) < 1e-2 * _moved(m.BlockModel, want)


@pytest.mark.parametrize("hook", ["powersgd", "powersgd_fp16"])
def test_seed_004_powersgd_hook_with_its_state(runs: dict, hook: str) -> None:
    run = _run(runs, f"seed004/{hook}")
    wrapper = "fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook"
    assert run["comm_hook"] == ("powerSGD_hook" if hook == "powersgd" else wrapper)
    # start_powerSGD_iter=5000 (the seed's): the first steps all-reduce the whole gradient, counted by the state.
    assert run["state_iter"] == STEPS
    want = m.reference(m.BlockModel, STEPS)
    bound = TOL if hook == "powersgd" else 1e-2 * _moved(m.BlockModel, want)
    assert _gap(run["params"], want) < bound


def test_seed_004_post_local_sgd_averages_every_model_averaging_period(runs: dict) -> None:
    run = _run(runs, "seed004/post_local_sgd")
    assert run["comm_hook"] == "post_localSGD_hook"
    assert run["optimizer"] == "PostLocalSGDOptimizer"
    assert run["averager"] == [4, 8, 12]  # period, warm-up (start_localSGD_iter), steps taken
    # subgroup=None on one node: the local all-reduce spans both processes, so the replicas stay equal and
    # training matches one process.
    want = m.reference(m.BlockModel, 12)
    assert _gap(run["params"], want) < TOL < _moved(m.BlockModel, want)

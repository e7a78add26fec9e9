"""Checkpoints: a round trip in each declared format into new processes, a full checkpoint written by
``single_device`` loading under this strategy, and the same weights as Hugging Face safetensors loaded into
the sharded model and exported back bit-equal."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract import _suite_model as m
from stratagem.contract._comparisons import compare, fail_on, section, skip_undeclared

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _require_training(run: Any) -> None:
    if run.subject.no_training:
        skip_undeclared("precisions", "32-true", run.subject.no_training)


def require_format(run: Any, fmt: str) -> None:
    subject = run.subject
    if fmt not in subject.formats:
        skip_undeclared(
            "checkpoint_formats",
            fmt,
            f"{subject.name} does not declare checkpoint format {fmt!r} "
            f"(capabilities.checkpoint_formats = {subject.formats})",
        )
    _require_training(run)
    saving = section(run, 1, "saving")[0]
    if fmt in saving["save_errors"]:
        pytest.fail(f"saving a {fmt} checkpoint failed:\n{saving['save_errors'][fmt]}", pytrace=False)


def optimizer_state_problems(full: dict, what: str) -> list[str]:
    """AdamW has stepped: every parameter must have its step count and both moments."""
    state = full["optimizer"].get("state", {})
    missing = sorted(
        name for name in full["params"] if not {"step", "exp_avg", "exp_avg_sq"} <= set(state.get(name, {}))
    )
    if not missing:
        return []
    return [
        f"{what}: expected AdamW state (step, exp_avg, exp_avg_sq) for all {len(full['params'])} parameters "
        f"after {m.STEPS_BEFORE_SAVE} steps, got none for {len(missing)}: {', '.join(missing[:4])}"
        + (", ..." if len(missing) > 4 else "")
    ]


def compare_states(run: Any, expected: dict, loaded: dict) -> list[str]:
    """Model (and, with a full checkpoint to read it from, optimizer) state, bit-equal."""
    if "full" in run.subject.formats:
        problems = compare(expected["params"], loaded["loaded"]["params"], "model state")
        problems += compare(expected["optimizer"], loaded["loaded"]["optimizer"], "optimizer state")
        return problems
    return compare(expected["params"], loaded["params"], "model state")


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_round_trip(contract_run: Any, fmt: str) -> None:
    require_format(contract_run, fmt)
    saving = section(contract_run, 1, "saving")
    loaded = section(contract_run, 2, f"resume_{fmt}")
    what = f"{fmt} checkpoint saved after {m.STEPS_BEFORE_SAVE} steps, loaded in new processes"
    if "full" in contract_run.subject.formats:
        # The full checkpoint the strategy's save hook wrote, read back weights-only: what was saved.
        expected = saving[0]["at_save"]
        problems = optimizer_state_problems(expected, "the full checkpoint written after 3 steps")
    else:
        expected = {"params": section(contract_run, 1, "straight")[0]["params"]}
        problems = []
    problems += compare_states(contract_run, expected, loaded[0])
    for rank, data in loaded.items():
        rest = data["remainder"]
        expected_rest = {
            "step": m.STEPS_BEFORE_SAVE,
            "note": "stratagem contract",
            "extra": __import__("torch").arange(3),
            "rng": saving[rank]["rng"],
        }
        problems += compare(expected_rest, rest, f"rank {rank}: entries returned by load (rng is PerRank)")
    fail_on(problems, what)


def test_loads_a_full_checkpoint_written_by_single_device(contract_run: Any) -> None:
    _require_training(contract_run)
    payload = contract_run.single_device_payload
    loaded = section(contract_run, 2, "single_device")
    expected = {"params": payload["model"]["model"], "optimizer": payload["optimizers"]["optimizer"]}
    problems = compare_states(contract_run, expected, loaded[0])
    for rank, data in loaded.items():
        problems += compare({"step": 1}, data["remainder"], f"rank {rank}: entries returned by load")
    fail_on(problems, "a full checkpoint from single_device, loaded under this strategy")


def test_hugging_face_weights_load_and_export_bit_equal(contract_run: Any) -> None:
    """The single_device checkpoint's weights as safetensors, loaded into a model as it is set up
    (``init_weights``), then exported from the sharded state: the same values, and the same file bytes."""
    _require_training(contract_run)
    hf = section(contract_run, 2, "hf_weights")
    single = section(contract_run, 2, "single_device")[0]
    expected = (
        single["params"] if single["params"] is not None else (single.get("loaded") or {}).get("params")
    )
    got = hf[0]["params"] if hf[0]["params"] is not None else (hf[0]["full"] or {}).get("params")
    if expected is None or got is None:
        skip_undeclared(
            "checkpoint_formats", "full", "the parameters are partitioned and no full checkpoint shows them"
        )
    problems = compare(expected, got, "weights loaded from safetensors")
    if hf[0]["differs"]:
        problems.append(f"the export differs from the safetensors it loaded in {hf[0]['differs']}")
    if hf[0]["extra"]:
        problems.append(f"the export has files the input does not: {hf[0]['extra']}")
    fail_on(problems, "Hugging Face weights (load with init_weights, export with save_weights)")

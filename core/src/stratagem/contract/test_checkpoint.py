"""Checkpoints: a round trip in each declared format into new processes, and a full checkpoint written by
``single_device`` loading under this strategy."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.testing import _model as m
from stratagem.testing._checks import compare, fail_on, section

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _require_training(run: Any) -> None:
    if run.subject.no_training:
        pytest.skip(run.subject.no_training)


def require_format(run: Any, fmt: str) -> None:
    subject = run.subject
    if fmt not in subject.formats:
        pytest.skip(
            f"{subject.name} does not declare checkpoint format {fmt!r} "
            f"(capabilities.checkpoint_formats = {subject.formats})"
        )
    _require_training(run)
    straight = section(run, 1, "straight")[0]
    if fmt in straight["save_errors"]:
        pytest.fail(f"saving a {fmt} checkpoint failed:\n{straight['save_errors'][fmt]}", pytrace=False)


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


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_round_trip(contract_run: Any, fmt: str) -> None:
    require_format(contract_run, fmt)
    saved = section(contract_run, 1, "straight")
    loaded = section(contract_run, 2, f"resume_{fmt}")
    what = f"{fmt} checkpoint saved after {m.STEPS_BEFORE_SAVE} steps, loaded in new processes"
    problems = optimizer_state_problems(saved[0]["at_save"], "optimizer_state_dict(full=True) before saving")
    problems += compare(saved[0]["at_save"]["params"], loaded[0]["loaded"]["params"], "model state")
    problems += compare(saved[0]["at_save"]["optimizer"], loaded[0]["loaded"]["optimizer"], "optimizer state")
    for rank, data in loaded.items():
        rest = data["remainder"]
        expected = {
            "step": m.STEPS_BEFORE_SAVE,
            "note": "stratagem contract",
            "extra": __import__("torch").arange(3),
            "rng": saved[rank]["rng"],
        }
        problems += compare(expected, rest, f"rank {rank}: entries returned by load (rng is PerRank)")
    fail_on(problems, what)


def test_loads_a_full_checkpoint_written_by_single_device(contract_run: Any) -> None:
    _require_training(contract_run)
    payload = contract_run.single_device_payload
    loaded = section(contract_run, 2, "single_device")
    problems = compare(payload["model"]["model"], loaded[0]["loaded"]["params"], "model state")
    problems += compare(
        payload["optimizers"]["optimizer"], loaded[0]["loaded"]["optimizer"], "optimizer state"
    )
    for rank, data in loaded.items():
        problems += compare({"step": 1}, data["remainder"], f"rank {rank}: entries returned by load")
    fail_on(problems, "a full checkpoint from single_device, loaded under this strategy")

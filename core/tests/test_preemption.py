"""Preemption in one process (the multi-process runs are tests/test_preemption.py, SLURM's requeue
plugins/slurm/tests/test_requeue.py): a signal during a step stops ``fit`` at that step's end with a checkpoint of
it and :class:`stratagem.Preempted` (exit code 75); the run resumed from it ends bit for bit where an
uninterrupted run ends; the options are checked when the Trainer is made; a requeued SLURM job counts as a
restart whose cause is the preemption."""

from __future__ import annotations

import random
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem.errors import PREEMPTED_EXIT_CODE, ConfigurationError
from stratagem.launchers import _restarts

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
import sg_workloads as wl

STEPS = 8


def _fit(
    root: Path,
    *,
    signal_at: int | None = None,
    ckpt_path: str | None = None,
    steps: int = STEPS,
    **options: Any,
) -> Any:
    """Train (dropout and a shuffled loader: every RNG matters); SIGTERM to this process during step
    ``signal_at`` (counted from 0). Returns the parameters, or the ``Preempted`` it raised."""
    trainer = sg.Trainer(
        accelerator="cpu",
        max_steps=steps,
        default_root_dir=root,
        seed=7,
        enable_progress_bar=False,
        log_every_n_steps=2,
        **options,
    )
    module = wl.Regression(dropout=0.1, optimizer="adamw", scheduler=True)
    step = module.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        if trainer.global_step == signal_at:
            signal.raise_signal(signal.SIGTERM)
        return step(batch, batch_idx)

    module.training_step = training_step  # type: ignore[method-assign]
    loader = DataLoader(wl.dataset(), batch_size=8, shuffle=True)  # 12 batches an epoch: one epoch and a bit
    try:
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    except sg.Preempted as preempted:
        return preempted
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["blocking", "async"])
def test_a_signal_stops_at_the_steps_end_with_its_checkpoint_and_the_resumed_run_is_exact(
    tmp_path: Path, async_checkpoint: bool
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    straight = _fit(tmp_path / "straight")
    # A save of step 4 in flight when step 5 is preempted (async): the preemption waits for it, then for its own.
    options = {"async_checkpoint": async_checkpoint, "checkpoint_every_n_steps": 4}
    preempted = _fit(tmp_path / "run", signal_at=4, **options)
    assert isinstance(preempted, sg.Preempted) and isinstance(preempted, SystemExit)
    assert preempted.code == PREEMPTED_EXIT_CODE == 75
    assert (preempted.signal, preempted.step) == ("SIGTERM", 5)  # the signal came during the fifth step
    checkpoints = tmp_path / "run" / "checkpoints"
    assert preempted.checkpoint == str(checkpoints / "step-000005.ckpt")
    assert (checkpoints / "last").read_text().strip() == "step-000005.ckpt"
    saved = torch.load(checkpoints / "step-000005.ckpt", weights_only=True)
    assert saved["state"]["preempted"]["signal"] == "SIGTERM" and saved["state"]["preempted"]["step"] == 5
    assert saved["state"]["progress"]["step"] == 5
    # The loggers wrote what was pending (step 5's loss: they write every 2 steps), as at the end of a fit.
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["2", "4", "5"]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the Trainer's only while it trains

    resumed = _fit(tmp_path / "run", ckpt_path="last", **options)
    assert isinstance(resumed, dict), resumed
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
    # An untrained model is far from the result: the comparison can fail.
    untrained = wl.Regression()
    untrained.configure_model()
    assert not torch.equal(untrained.state_dict()["net.0.weight"], straight["net.0.weight"])


def test_ten_trials_at_random_steps_each_resume_bit_for_bit(tmp_path: Path) -> None:
    # 20 steps: past the end of the first epoch (12 batches), so some trials resume in the second one.
    seed = random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    straight = _fit(tmp_path / "straight", steps=20)
    for trial in range(10):
        at, every, async_checkpoint = rng.randrange(19), rng.choice([None, 3]), rng.random() < 0.5
        what = (
            f"seed {seed}, trial {trial}: SIGTERM during step {at}, every {every}, async {async_checkpoint}"
        )
        options = {"async_checkpoint": async_checkpoint, "checkpoint_every_n_steps": every, "steps": 20}
        root = tmp_path / f"trial{trial}"
        preempted = _fit(root, signal_at=at, **options)
        assert isinstance(preempted, sg.Preempted) and preempted.step == at + 1, what
        assert (root / "checkpoints" / "last").read_text().strip() == f"step-{at + 1:06d}.ckpt", what
        resumed = _fit(root, ckpt_path="last", **options)
        assert isinstance(resumed, dict), (what, resumed)
        for name, value in straight.items():
            assert torch.equal(resumed[name], value), (what, name)


def test_no_preemption_signals_leaves_the_signals_alone(tmp_path: Path) -> None:
    seen = []

    def mine(number: int, frame: Any) -> None:
        seen.append(number)

    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        result = _fit(tmp_path / "off", preemption_signals=())
        signal.raise_signal(signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert isinstance(result, dict) and seen == [signal.SIGUSR1]
    # And with the default, SIGUSR1 preempts: the Trainer's handler replaced this one while it trained.
    signal.signal(signal.SIGUSR1, mine)
    try:
        trainer = sg.Trainer(accelerator="cpu", max_steps=2, default_root_dir=tmp_path / "on")
        module = wl.Regression()
        step = module.training_step

        def training_step(batch: Any, batch_idx: int) -> Any:
            signal.raise_signal(signal.SIGUSR1)
            return step(batch, batch_idx)

        module.training_step = training_step  # type: ignore[method-assign]
        with pytest.raises(sg.Preempted, match="preempted by SIGUSR1 at step 1"):
            trainer.fit(module, DataLoader(wl.dataset(), batch_size=8))
        assert signal.getsignal(signal.SIGUSR1) is mine and seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_options_are_checked_when_the_trainer_is_made() -> None:
    trainer = sg.Trainer(preemption_signals=["term", signal.SIGUSR2, 10], preemption_grace_s=90)
    assert trainer._preemption.options.signals == ("SIGTERM", "SIGUSR2", "SIGUSR1")
    assert sg.Trainer(preemption_signals="SIGUSR1")._preemption.options.signals == ("SIGUSR1",)
    with pytest.raises(
        ConfigurationError, match=r"'SIGTREM' is not a signal on this system\. Did you mean 'SIGTERM'"
    ):
        sg.Trainer(preemption_signals=["SIGTREM"])
    with pytest.raises(ConfigurationError, match="SIGKILL cannot be caught"):
        sg.Trainer(preemption_signals=["SIGKILL"])
    with pytest.raises(ConfigurationError, match=r"preemption_grace_s=...\): 0; give the seconds"):
        sg.Trainer(preemption_grace_s=0)
    with pytest.raises(ConfigurationError, match="slurm_requeue='yes'"):
        sg.Trainer(slurm_requeue="yes")


def test_a_requeued_slurm_job_is_a_restart_caused_by_its_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*_restarts.RESTART_COUNT_ENVS, _restarts.RESTART_LOG_ENV, _restarts.LAST_FAILURE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # and one restart inside this run of the job
    assert _restarts.restart_count() == 3
    restart = _restarts.latest_restart(7, preempted={"signal": "SIGUSR1", "step": 7})
    assert restart.describe(0) == (
        "restart 3: preempted by SIGUSR1 at step 7 (SLURM requeued the job); resumed from step 7; 0 step(s) lost"
    )

"""Resuming at another world size or per-process batch (stratagem.trainer._batch_rule): the decision in each case, what a
checkpoint records, and ``ckpt_path`` given a run's ``last`` pointer. The multi-process runs that end where the
uninterrupted run ends are in test_resume_world_size.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import stratagem as sg
from stratagem.errors import CheckpointError, ConfigurationError
from stratagem.trainer._batch_rule import Consumption, continue_with, loader_batch_size
from stratagem.trainer._resume import Position

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
import sg_workloads as wl


def _saved(batch_size: int | None, world_size: int, accumulate: int) -> dict:
    return Consumption(batch_size, world_size, accumulate).to_dict()


def _decide(
    saved: dict | None, run: Consumption, batch_in_epoch: int, **options
) -> tuple[int, str | None, int]:
    position = Position(step=5, epoch=0, batch_in_epoch=batch_in_epoch)
    accumulate, message = continue_with(position, saved, run, **options)
    return accumulate, message, position.batch_in_epoch


def test_the_checkpoint_records_what_a_step_consumed() -> None:
    assert _saved(4, 2, 3) == {
        "batch_size": 4,
        "world_size": 2,
        "accumulate_grad_batches": 3,
        "samples_per_step": 24,
    }
    assert _saved(None, 2, 3)["samples_per_step"] is None


def test_a_fixed_per_process_batch_keeps_the_samples_per_step_by_accumulation() -> None:
    # 2 -> 1, the script unchanged: 5 steps of 4 x 2 are 40 samples, the first 10 batches of 4.
    accumulate, message, position = _decide(_saved(4, 2, 1), Consumption(4, 1, 1), 5)
    assert (accumulate, position) == (2, 10)
    assert message is not None and "world size changed from 2 to 1" in message
    assert "keeping the checkpoint's 8 samples per optimizer step" in message
    assert "accumulate_grad_batches 1 -> 2" in message and "seen again" not in message
    # 1 -> 2: a one-process run accumulating 2 batches of 4 goes on with 2 processes and no accumulation.
    accumulate, message, position = _decide(_saved(4, 1, 2), Consumption(4, 2, 2), 10)
    assert (accumulate, position) == (1, 5) and "accumulate_grad_batches 2 -> 1" in message
    # 4 -> 2 with accumulation 3: 24 samples a step stay 24.
    assert _decide(_saved(2, 4, 3), Consumption(2, 2, 3), 6)[:1] == (6,)


def test_a_batch_the_script_scaled_itself_changes_nothing() -> None:
    # batch = 8 // devices: 2 -> 1 and 1 -> 2, 8 samples a step either way; the position follows samples.
    accumulate, message, position = _decide(_saved(4, 2, 1), Consumption(8, 1, 1), 5)
    assert (accumulate, position) == (1, 5)
    assert message is not None and "per-process batch changed from 4 to 8" in message
    assert (
        "8 samples per optimizer step as before" in message and "accumulate_grad_batches=1 is kept" in message
    )
    accumulate, message, position = _decide(_saved(8, 1, 1), Consumption(4, 2, 1), 5)
    assert (accumulate, position) == (1, 5) and "as before" in message


def test_what_cannot_be_restored_or_told_keeps_the_scripts_settings_and_says_so() -> None:
    # 8 samples a step cannot be made of batches of 3: the accumulation stays, 40 samples are 13 batches + 1.
    accumulate, message, position = _decide(_saved(4, 2, 1), Consumption(3, 1, 1), 5)
    assert (accumulate, position) == (1, 13)
    assert "no whole number of batches of 3 x 1 process(es) makes" in message
    assert (
        "accumulate_grad_batches=1 is kept" in message
        and "1 sample(s) of this epoch are seen again" in message
    )
    # No fixed batch size (this run's loader, or the checkpoint's): not compared; the position in batches.
    for saved, run in (
        (_saved(4, 2, 1), Consumption(None, 1, 1)),
        (_saved(None, 2, 1), Consumption(4, 1, 1)),
        (_saved(None, 2, 1), Consumption(None, 1, 1)),
    ):
        accumulate, message, position = _decide(saved, run, 5)
        assert (accumulate, position) == (1, 10), (saved, run)
        assert "no fixed batch size, so the samples per step cannot be compared" in message
    accumulate, message, position = _decide(_saved(None, 2, 1), Consumption(None, 3, 1), 5)
    assert (accumulate, position) == (
        1,
        3,
    ) and "1 per-process batch(es) of this epoch are seen again" in message


def test_a_loader_that_begins_at_any_sample_goes_on_at_the_next_one() -> None:
    # 2 -> 1 with batches of 3: 40 samples consumed are 13 batches and 1 sample; the epoch goes on at sample 40.
    position = Position(step=5, epoch=0, batch_in_epoch=5)
    accumulate, message = continue_with(
        position, _saved(4, 2, 1), Consumption(3, 1, 1), starts_at_sample=True
    )
    assert (accumulate, position.batch_in_epoch, position.samples_in_epoch) == (1, 13, 40)
    assert "this epoch goes on at its sample 40, 1 sample(s) into a batch of 3 of this run" in message
    assert "seen again" not in message
    # The samples the checkpoint recorded count, not its batches (its last batch may have been short).
    position = Position(step=5, epoch=0, batch_in_epoch=5, samples_in_epoch=38)
    continue_with(position, _saved(4, 2, 1), Consumption(4, 1, 1), starts_at_sample=True)
    assert (position.batch_in_epoch, position.samples_in_epoch) == (9, 38)
    # Whole batches of the new run: nothing to say about the position.
    position = Position(step=5, epoch=0, batch_in_epoch=5, samples_in_epoch=40)
    accumulate, message = continue_with(
        position, _saved(4, 2, 1), Consumption(4, 1, 1), starts_at_sample=True
    )
    assert (accumulate, position.batch_in_epoch) == (2, 10) and "sample 40" not in message
    # A loader of the user's own sampler goes on at whole batches of its own: the samples are not counted.
    position = Position(step=5, epoch=0, batch_in_epoch=5, samples_in_epoch=40)
    _, message = continue_with(position, _saved(4, 2, 1), Consumption(3, 1, 1))
    assert (position.batch_in_epoch, position.samples_in_epoch) == (13, None) and "1 sample(s)" in message
    assert "seen again" in message


def test_keep_global_batch_false_keeps_the_scripts_accumulation() -> None:
    accumulate, message, position = _decide(_saved(4, 2, 1), Consumption(4, 1, 1), 5, keep_global_batch=False)
    assert (accumulate, position) == (1, 10)
    assert (
        "keep_global_batch=False" in message
        and "a step takes 4 samples (4 x 1 process(es) x 1 accumulated) where the checkpoint's run took 8"
        in message
    )
    old = {"world_size": 2, "accumulate_grad_batches": 1}
    accumulate, message, position = _decide(old, Consumption(4, 1, 1), 5, keep_global_batch=False)
    assert (accumulate, position) == (1, 10) and "keep_global_batch=False" in message


def test_unchanged_processes_and_old_checkpoints() -> None:
    # Same processes and batch: nothing to say; an accumulation the script changed is its own choice.
    assert _decide(_saved(4, 2, 1), Consumption(4, 2, 1), 5) == (1, None, 5)
    accumulate, message, position = _decide(_saved(4, 2, 1), Consumption(4, 2, 2), 4)
    assert (accumulate, position) == (
        2,
        4,
    ) and "accumulate_grad_batches 1 -> 2, as the script asks" in message
    # Checkpoints written before the per-process batch was recorded: the per-rank batch is taken as unchanged.
    old = {"world_size": 2, "accumulate_grad_batches": 1}
    accumulate, message, position = _decide(old, Consumption(8, 1, 1), 5)
    assert (accumulate, position) == (2, 10) and "does not record its per-process batch" in message
    assert _decide(old, Consumption(8, 2, 3), 5) == (3, None, 5)
    assert _decide(None, Consumption(8, 2, 3), 5) == (3, None, 5)


def test_loader_batch_size() -> None:
    data = wl.dataset()
    assert loader_batch_size(DataLoader(data, batch_size=4)) == 4
    assert (
        loader_batch_size(DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 5, False)))
        == 5
    )
    assert loader_batch_size(DataLoader(data, batch_size=None)) is None
    assert loader_batch_size(DataLoader(data, batch_sampler=[[0, 1], [2, 3, 4]])) is None
    assert loader_batch_size([(torch.zeros(2, 6), torch.zeros(2, 1))]) is None


def test_keep_global_batch_is_checked() -> None:
    with pytest.raises(ConfigurationError, match=r"Trainer\(keep_global_batch='no'\): give True or False"):
        sg.Trainer(keep_global_batch="no")


def test_ckpt_path_given_the_last_pointer_follows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def trainer(steps: int) -> sg.Trainer:
        return sg.Trainer(
            strategy="single_device",
            accelerator="cpu",
            max_steps=steps,
            checkpoint_every_n_steps=2,
            default_root_dir=tmp_path,
            enable_progress_bar=False,
            loggers=[],
            seed=7,
        )

    trainer(4).fit(wl.Regression(), DataLoader(wl.dataset(), batch_size=8))
    checkpoints = tmp_path / "checkpoints"
    saved = torch.load(checkpoints / "step-000004.ckpt", weights_only=True)["state"]["topology"]
    assert saved == _saved(8, 1, 1)
    pointer = checkpoints / "last"
    assert pointer.read_text().strip() == "step-000004.ckpt"
    capsys.readouterr()
    module = wl.Regression()
    again = trainer(6)
    again.fit(module, DataLoader(wl.dataset(), batch_size=8), ckpt_path=pointer)
    out = capsys.readouterr().out
    assert f"ckpt_path={str(pointer)!r} is the `last` pointer of {checkpoints}, not a checkpoint" in out, out
    assert f"Resumed from {checkpoints / 'step-000004.ckpt'} at step 4" in out
    assert again.ckpt_path == checkpoints / "step-000004.ckpt" and again.global_step == 6
    assert len(module.losses) == 2
    # A pointer to nothing complete is refused, not taken for a fresh start.
    elsewhere = tmp_path / "other" / "checkpoints"
    elsewhere.mkdir(parents=True)
    (elsewhere / "last").write_text("step-000002.ckpt\n")
    with pytest.raises(
        CheckpointError, match=r"is the `last` pointer of .*which holds no complete checkpoint"
    ):
        trainer(6).fit(wl.Regression(), DataLoader(wl.dataset(), batch_size=8), ckpt_path=elsewhere / "last")
    # A loader without a fixed batch size is recorded as such.
    varied = DataLoader(wl.dataset(), batch_sampler=[list(range(i, i + 3 + i % 2)) for i in range(0, 40, 5)])
    trainer(8).fit(wl.Regression(), varied, ckpt_path="last")
    saved = torch.load(checkpoints / "step-000008.ckpt", weights_only=True)["state"]["topology"]
    assert saved == _saved(None, 1, 1)

"""Exact resume: k+m steps straight equal k steps, a checkpoint, NEW processes, a load and m steps: parameters,
optimizer state and every loss bit for bit, resuming inside an epoch, with RNG draws from python, numpy and
torch in each step, shuffled data, dropout, an LR scheduler and user extras. And a shuffled epoch resumed with
another per-process batch: it goes on at the sample where the checkpoint stopped, inside a batch of the new run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import stratagem as sg

WORKLOADS = Path(__file__).parent / "workloads"
SCRIPT = WORKLOADS / "sg_workloads.py"
sys.path.insert(0, str(WORKLOADS))
import sg_workloads as wl  # noqa: E402

COMMON = ["--shuffle", "--dropout", "0.2", "--optimizer", "adamw", "--scheduler", "--steps", "10"]


def _run(args: list[str], timeout: float) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _load(out: Path, rank: int) -> dict:
    return torch.load(f"{out}.rank{rank}", weights_only=False)[0]


def _groups(groups: list[dict]) -> list[dict]:
    # A saved tuple (Adam's betas) may come back as a list; the optimizer reads both alike.
    return [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in groups]


def _assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert _groups(a["param_groups"]) == _groups(b["param_groups"])
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


def _assert_resumed_exactly(straight: dict, resumed: dict, resumed_from_batch: int) -> None:
    for name, value in straight["params"].items():
        assert torch.equal(value, resumed["params"][name]), name
    _assert_same_optimizer_state(straight["optimizer"], resumed["optimizer"])
    assert resumed["losses"] == straight["losses"][resumed_from_batch:]
    assert resumed["lr"] == straight["lr"]
    assert resumed["extra_counter"] == straight["extra_counter"]
    assert (resumed["step"], resumed["epoch"]) == (straight["step"], straight["epoch"])


def test_single_device_resume_inside_an_epoch_is_exact(tmp_path: Path) -> None:
    # 96 samples in batches of 16: 6 steps an epoch; the checkpoint at step 8 is 2 batches into epoch 1.
    base = ["--strategy", "single_device", "--devices", "1", "--batch", "16", *COMMON]
    _run([*base, "--root", str(tmp_path / "plain"), "--out", str(tmp_path / "plain")], 60)
    _run([*base, "--root", str(tmp_path / "a"), "--ckpt-every", "4", "--out", str(tmp_path / "a")], 60)
    checkpoint = tmp_path / "a" / "run0" / "checkpoints" / "step-000008.ckpt"
    assert checkpoint.is_file()
    resume = ["--ckpt-path", str(checkpoint), "--root", str(tmp_path / "b"), "--out", str(tmp_path / "b")]
    _run([*base, *resume], 60)
    plain, straight, resumed = (_load(tmp_path / n, 0) for n in ("plain", "a", "b"))
    # Writing checkpoints does not disturb the run.
    assert straight["losses"] == plain["losses"]
    _assert_resumed_exactly(plain, resumed, resumed_from_batch=8)
    assert len(resumed["losses"]) == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_two_process_sharded_resume_with_accumulation_is_exact(tmp_path: Path) -> None:
    # Per rank: 48 samples in batches of 4 = 12 batches, 6 steps an epoch with accumulation 2; the checkpoint
    # at step 4 is 8 batches into epoch 0. The format is sharded (torch.distributed.checkpoint).
    base = ["--strategy", "gradavg", "--devices", "2", "--batch", "4", "--accumulate", "2", *COMMON]
    base += ["--format", "sharded", "--timeout", "60"]
    _run([*base, "--root", str(tmp_path / "a"), "--ckpt-every", "4", "--out", str(tmp_path / "a")], 90)
    checkpoint = tmp_path / "a" / "run0" / "checkpoints" / "step-000004"
    assert (checkpoint / "stratagem.json").is_file()
    resume = ["--ckpt-path", str(checkpoint), "--root", str(tmp_path / "b"), "--out", str(tmp_path / "b")]
    _run([*base, *resume], 90)
    for rank in (0, 1):
        straight, resumed = _load(tmp_path / "a", rank), _load(tmp_path / "b", rank)
        _assert_resumed_exactly(straight, resumed, resumed_from_batch=8)
    # The ranks drew different random numbers, so each got its own RNG state back.
    assert _load(tmp_path / "a", 0)["losses"] != _load(tmp_path / "a", 1)["losses"]


def test_a_resume_inside_a_batch_of_the_new_run_goes_on_at_the_next_sample(tmp_path: Path, capsys) -> None:
    # 64 indices, shuffled, batches of 4: the checkpoint at step 5 has consumed the epoch's first 20 samples.
    # Resumed with batches of 8 (4 samples a step are no whole number of them: the accumulation stays), the
    # epoch goes on at its sample 20, inside the run's third batch: 44 samples in 6 batches of 8, ..., 8, 4;
    # then the next epoch, from its start, in its own order.
    def fit(batch: int, steps: int, ckpt_path: str | None = None, **options: Any) -> list[int]:
        trainer = sg.Trainer(
            strategy="single_device",
            accelerator="cpu",
            default_root_dir=tmp_path,
            seed=7,
            max_steps=steps,
            enable_progress_bar=False,
            loggers=[],
            **options,
        )
        module = wl.Indexed()
        loader = DataLoader(wl.indexed_dataset(64), batch_size=batch, shuffle=True)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module.seen

    def order(epoch: int) -> list[int]:  # the epoch's order at any world size: drawn from the seed alone
        return torch.randperm(64, generator=torch.Generator().manual_seed(7 + epoch)).tolist()

    assert fit(4, 5, checkpoint_every_n_steps=5) == order(0)[:20]
    saved = torch.load(tmp_path / "checkpoints" / "step-000005.ckpt", weights_only=True)["state"]
    assert saved["progress"] == {"step": 5, "epoch": 0, "batch_in_epoch": 5, "samples_in_epoch": 20}
    capsys.readouterr()
    assert fit(8, 12, ckpt_path="last") == order(0)[20:] + order(1)[:8]
    out = capsys.readouterr().out
    assert "per-process batch changed from 4 to 8" in out and "accumulate_grad_batches=1 is kept" in out
    assert "this epoch goes on at its sample 20, 4 sample(s) into a batch of 8 of this run" in out, out


def test_worker_processes_resume_with_the_random_streams_of_the_uninterrupted_run(tmp_path: Path) -> None:
    # Each worker draws from its own stream, batch after batch: the resumed run fetches and drops the batches
    # consumed (a sampler begun at the checkpoint's sample would hand the first batch to the wrong worker).
    def fit(name: str, ckpt_path: Path | None = None, **options: Any) -> list[float]:
        trainer = sg.Trainer(
            strategy="single_device",
            accelerator="cpu",
            default_root_dir=tmp_path / name,
            seed=7,
            max_steps=8,
            enable_progress_bar=False,
            loggers=[],
            **options,
        )
        module = wl.Indexed()
        loader = DataLoader(wl.NoisyIndices(), batch_size=4, shuffle=True, num_workers=2)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module.seen

    straight = fit("a", checkpoint_every_n_steps=4)
    resumed = fit("b", ckpt_path=tmp_path / "a" / "checkpoints" / "step-000004.ckpt")
    assert resumed == straight[16:]
    assert len({int(v) for v in straight}) == 32 and straight != [int(v) for v in straight]

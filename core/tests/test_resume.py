"""Exact resume: k+m steps straight equal k steps, a checkpoint, NEW processes, a load and m steps: parameters,
optimizer state and every loss bit for bit, resuming inside an epoch, with RNG draws from python, numpy and
torch in each step, shuffled data, dropout, an LR scheduler and user extras."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKLOADS = Path(__file__).parent / "workloads"
SCRIPT = WORKLOADS / "sg_workloads.py"
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

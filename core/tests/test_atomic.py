"""Atomic publication of checkpoints: crashes at random moments, a full disk, a read-only file system."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem import CheckpointError
from stratagem.checkpoint import _atomic

TESTS = Path(__file__).parent


# -------------------------------------------------------------------------------------------------
# the primitives
# -------------------------------------------------------------------------------------------------


def test_atomic_file_replaces_only_on_success(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("old")
    with pytest.raises(_atomic.WriteError, match="crash"), _atomic.atomic_file(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    with _atomic.atomic_file(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_exchange_swaps_directories(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("A")
    (b / "x").write_text("B")
    if not _atomic.exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here; the two-rename path is tested below")
    assert (a / "x").read_text() == "B" and (b / "x").read_text() == "A"


def test_publish_directory_replaces_and_cleans(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "v").write_text("1")
    new = _atomic.temporary_sibling(target)
    new.mkdir()
    (new / "v").write_text("2")
    _atomic.publish_directory(new, target)
    assert (target / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_recover_after_crash_between_the_two_renames(tmp_path: Path) -> None:
    # The state a crash leaves in the fallback scheme: previous renamed aside, new not yet in place.
    target = tmp_path / "ckpt"
    old = _atomic.old_sibling(target)
    old.mkdir()
    (old / "v").write_text("previous")
    stale = _atomic.temporary_sibling(target)
    stale.mkdir()
    assert _atomic.recover(target) == target
    assert (target / "v").read_text() == "previous"
    assert not old.exists()
    _atomic.remove_stale_temporaries(target)
    assert not stale.exists()


def test_stale_temporaries_with_glob_characters(tmp_path: Path) -> None:
    target = tmp_path / "run[1]*"
    stale = _atomic.temporary_sibling(target)
    stale.write_text("x")
    other = tmp_path / "run1.stratagem-tmp-abc"
    other.write_text("keep")
    _atomic.remove_stale_temporaries(target)
    assert not stale.exists() and other.exists()


def test_save_after_interrupted_swap_keeps_previous(tmp_path: Path) -> None:
    """A save into a path whose swap was interrupted restores the previous checkpoint first, never deletes it."""
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model = torch.nn.Linear(3, 2)
    target = tmp_path / "ckpt"
    engine.save(target, {"model": model, "step": 1}, format="sharded")
    os.replace(target, _atomic.old_sibling(target))  # crash after the first rename
    bad = {"model": model, "step": 2, "oops": object()}
    with pytest.raises(CheckpointError):
        engine.save(target, bad, format="sharded")
    assert engine.load(target, {"model": torch.nn.Linear(3, 2)})["step"] == 1


# -------------------------------------------------------------------------------------------------
# crash safety: SIGKILL at a random moment of a save (see ckpt_workers.crash_trials)
# -------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_sigkill_during_save_leaves_a_whole_checkpoint(tmp_path: Path, fmt: str) -> None:
    command = [sys.executable, str(TESTS / "ckpt_workers.py"), "crash", "--format", fmt, "--trials", "10"]
    command += ["--megabytes", "48", "--directory", str(tmp_path)]
    run = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert result["loaded_previous"] + result["loaded_new"] == 10
    # Kills spread over the whole save: some land while data is being written (a temporary exists).
    assert result["killed_while_writing"] >= 1, result
    assert result["final_version_ok"]
    assert result["leftovers_after_clean_save"] == []


# -------------------------------------------------------------------------------------------------
# a full disk, a read-only file system, a path under a file
# -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(directory: Path, size: str) -> object:
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({mounted.stderr.strip() or 'mount failed'}); a full disk needs "
            "one (needs root or CAP_SYS_ADMIN)"
        )
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def _state(megabytes: float, step: int) -> dict:
    model = torch.nn.Linear(int(megabytes * 2**20 / 4 / 64), 64, bias=False)
    torch.nn.init.constant_(model.weight, float(step))
    return {"model": model, "step": step}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_full_disk_raises_and_keeps_previous(tmp_path: Path, fmt: str) -> None:
    # A real ENOSPC from a 4 MiB tmpfs; RLIMIT_FSIZE would give EFBIG instead (used in the 2-rank test).
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    with tmpfs(tmp_path / "disk", "4M") as disk:
        target = disk / "ckpt"
        engine.save(target, _state(1, step=1), format=fmt)
        with pytest.raises(CheckpointError) as info:
            engine.save(target, _state(3.5, step=2), format=fmt)
        assert str(target) in str(info.value)
        assert "file system is full" in str(info.value) or "No space left" in str(info.value), info.value
        restored = _state(1, step=0)
        assert engine.load(target, restored)["step"] == 1
        assert bool((restored["model"].weight == 1.0).all())
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_read_only_file_system_raises_and_keeps_previous(tmp_path: Path, fmt: str) -> None:
    # Root ignores permission bits, so chmod proves nothing here; a read-only mount refuses root too.
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    with tmpfs(tmp_path / "ro", "8M") as disk:
        target = disk / "ckpt"
        engine.save(target, _state(0.5, step=1), format=fmt)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remount.stderr.strip()}")
        with pytest.raises(CheckpointError) as info:
            engine.save(target, _state(0.5, step=2), format=fmt)
        assert str(target) in str(info.value) and "Read-only" in str(info.value)
        restored = _state(0.5, step=0)
        assert engine.load(target, restored)["step"] == 1
        assert bool((restored["model"].weight == 1.0).all())


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_path_under_a_file_raises(tmp_path: Path, fmt: str) -> None:
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    target = blocker / "ckpt"
    with pytest.raises(CheckpointError) as info:
        engine.save(target, {"model": torch.nn.Linear(2, 2)}, format=fmt)
    assert str(target) in str(info.value) and f"{blocker} is a file, not a directory" in str(info.value)
    assert blocker.read_text() == "x"

"""Atomic publication of checkpoints: crashes at random moments, a full disk, a read-only file system."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def _mounting_prefix() -> list[str]:
    """How to run a process that may mount a tmpfs: as it is (root), or in a user and mount namespace of its
    own, where an unprivileged user is root over its own mounts. Skips, naming what is missing, if neither."""
    probe = ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs"]
    for prefix in ([], ["unshare", "--user", "--map-root-user", "--mount"]):
        if prefix and shutil.which("unshare") is None:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            tried = subprocess.run([*prefix, *probe, scratch], capture_output=True, text=True)
            subprocess.run(["umount", "-l", scratch], capture_output=True)
        if tried.returncode == 0:
            return prefix
    limit = Path("/proc/sys/user/max_user_namespaces")
    namespaces = limit.read_text().strip() if limit.exists() else "unknown"
    pytest.skip(
        "cannot mount a tmpfs: not root (no CAP_SYS_ADMIN), and `unshare --user --map-root-user --mount` failed "
        f"({tried.stderr.strip() or 'no unshare'}; user.max_user_namespaces={namespaces}). A real full disk "
        "needs one of the two."
    )


def _disk_fault(kind: str, fmt: str, directory: Path) -> dict:
    script = Path(__file__).parent / "workloads" / "disk_faults.py"
    done = subprocess.run(
        [*_mounting_prefix(), sys.executable, str(script), kind, fmt, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_full_disk_raises_and_keeps_previous(tmp_path: Path, fmt: str) -> None:
    # A real ENOSPC from a 4 MiB tmpfs; RLIMIT_FSIZE would give EFBIG instead (used in the 2-rank test).
    result = _disk_fault("full", fmt, tmp_path / "disk")
    error = result["error"]
    assert error is not None and str(tmp_path / "disk" / "ckpt") in error
    assert "file system is full" in error or "No space left" in error, error
    assert "needed about" in error and "bytes" in error, error
    assert result["loaded_step"] == 1 and result["weights_intact"]
    assert result["entries"] == ["ckpt"]
    assert result["verified"]  # the previous checkpoint passes `stratagem checkpoint verify`


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_full_scratch_folder_of_an_upload_raises_and_keeps_previous(tmp_path: Path, fmt: str) -> None:
    # The temporary directory (where an upload's scratch file is written) is a full 4 MiB tmpfs.
    result = _disk_fault("scratch", fmt, tmp_path / "tmp")
    error = result["error"]
    assert error is not None and "memory://bucket/ckpt" in error, error
    # (A sharded save uploads its shards directly; its state.pt, holding the large plain tensor, goes through
    # a scratch file.)
    assert f"the local scratch file {tmp_path / 'tmp'}" in error and "did not fit" in error, error
    assert result["loaded_step"] == 1 and result["weights_intact"] and result["verified"]
    assert result["entries"] == []  # no scratch file left behind


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_read_only_file_system_raises_and_keeps_previous(tmp_path: Path, fmt: str) -> None:
    # Root ignores permission bits, so chmod proves nothing here; a read-only mount refuses root too.
    result = _disk_fault("read-only", fmt, tmp_path / "ro")
    error = result["error"]
    assert error is not None and str(tmp_path / "ro" / "ckpt") in error and "Read-only" in error, error
    assert result["loaded_step"] == 1 and result["weights_intact"]


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

"""A checkpoint save that meets a full disk or a read-only file system, on a real tmpfs.

Run as ``python disk_faults.py full|read-only|scratch FORMAT DIRECTORY`` in a process that may mount (root, or
inside ``unshare --user --map-root-user --mount``); prints what the test asserts on, as JSON. ``scratch``: the
temporary directory is the full tmpfs, and the checkpoint goes to a store (fsspec's ``memory://``), whose upload
is written to a local scratch file first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import stratagem as sg
from stratagem.errors import CheckpointError


def _state(megabytes: float, step: int) -> dict:
    model = torch.nn.Linear(int(megabytes * 2**20 / 4 / 64), 64, bias=False)
    torch.nn.init.constant_(model.weight, float(step))
    return {"model": model, "step": step}


def _mount(directory: Path, size: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)


def main(kind: str, fmt: str, directory: Path) -> dict:
    import tempfile

    from stratagem.checkpoint._verify import verify

    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    target: Path | str = directory / "ckpt"
    first, second = (1, 3.5) if kind in ("full", "scratch") else (0.5, 0.5)
    _mount(directory, "8M" if kind == "read-only" else "4M")
    if kind == "scratch":
        tempfile.tempdir = str(directory)
        target = "memory://bucket/ckpt" + (".ckpt" if fmt == "full" else "")
    try:
        engine.save(target, _state(first, step=1), format=fmt)
        if kind == "read-only":
            # A read-only bind remount: per-mount, so a user namespace may make it too.
            subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        try:
            state = _state(second, step=2)
            if (
                kind == "scratch"
            ):  # the same model, and a plain tensor larger than the disk (in state.pt, sharded)
                state = {**_state(first, step=2), "blob": torch.zeros(6 * 2**20 // 4)}
            engine.save(target, state, format=fmt)
            error = None
        except CheckpointError as caught:
            error = str(caught)
        restored = _state(first, step=0)
        step = engine.load(target, restored)["step"]
        report = verify(target)
        return {
            "error": error,
            "loaded_step": step,
            "weights_intact": bool((restored["model"].weight == 1.0).all()),
            "entries": sorted(p.name for p in directory.iterdir()),
            "verified": report.passed and report.checksummed,
        }
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))))

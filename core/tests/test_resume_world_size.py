"""Resuming a checkpoint at another world size ends where the uninterrupted run ends, for both ways scripts set
their batch: (a) the per-process batch fixed, the script unchanged (the Trainer changes the accumulation to
keep the samples per step), and (b) the per-process batch = global batch // devices (nothing to change). From 2
processes (fsdp, sharded checkpoints) to 1 (single_device) and from 1 (full checkpoints) to 2, on a local disk
and on S3 (a real S3 API server, moto). Each backend's runs share three launches (workloads/resume_plan.py).

The same launches resume a shuffled loader of 64 indices from 2 processes to 1 and from 1 to 2, mid-epoch, at a
whole batch of the new run and inside one: each index is trained on exactly once in that epoch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3_server import S3Server

SCRIPT = Path(__file__).parent / "workloads" / "resume_plan.py"
BUCKET = "resume"
STEPS, AT = 15, 5  # 12 steps an epoch (96 samples, 8 per step): resumed mid-epoch, then across its end
TOLERANCE = 1e-5  # relative, every parameter; float32 sums in another order differ by about 1e-7


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    saved = dict(os.environ)
    with S3Server() as server:
        server.create_bucket(BUCKET)
        os.environ.update(server.env())
        try:
            yield server
        finally:
            os.environ.clear()
            os.environ.update(saved)


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)


def _execute(tmp_path: Path, name: str, devices: int, runs: list[dict[str, Any]]) -> str:
    plan = tmp_path / f"{name}.json"
    plan.write_text(json.dumps({"devices": devices, "runs": runs}))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(plan)], capture_output=True, text=True, timeout=200, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_resumed_at_another_world_size_ends_as_the_uninterrupted_run(s3: S3Server, tmp_path: Path) -> None:
    roots = {"local": str(tmp_path / "runs"), "s3": f"s3://{BUCKET}/runs"}

    def spec(backend: str, name: str, strategy: str, batch: int, accumulate: int, **more: Any) -> dict:
        out = str(tmp_path / f"{backend}-{name}.pt")
        root = f"{roots[backend]}/{name}"
        return dict(
            strategy=strategy, batch=batch, accumulate=accumulate, steps=STEPS, root=root, out=out, **more
        )

    def at(backend: str, name: str, last: bool = False) -> str:
        checkpoints = f"{roots[backend]}/{name}/checkpoints"
        if last:
            return f"{checkpoints}/last"  # the pointer file itself, not "last"
        return f"{checkpoints}/step-{AT:06d}" + ("" if name == "two" else ".ckpt")

    every = {"ckpt_every": AT}
    one, two, back = [], [], []
    for b in roots:
        # The uninterrupted runs (each writes checkpoints at 5, 10, 15): 8 samples per step in all three.
        one += [
            spec(b, "one-4x2", "single_device", 4, 2, **every),
            spec(b, "one-8x1", "single_device", 8, 1, **every),
        ]
        two += [spec(b, "two", "fsdp", 4, 1, format="sharded", **every)]
        # 1 -> 2: (a) the script unchanged (batch 4, accumulate 2); (b) batch 8 // 2 devices, accumulate 1.
        two += [spec(b, "a-1to2", "fsdp", 4, 2, ckpt_path=at(b, "one-4x2"))]
        two += [spec(b, "b-1to2", "fsdp", 4, 1, ckpt_path=at(b, "one-8x1"))]
        # 2 -> 1: (a) the script unchanged (batch 4, accumulate 1); (b) batch 8 // 1 device.
        back += [spec(b, "a-2to1", "single_device", 4, 1, ckpt_path=at(b, "two"))]
        back += [spec(b, "b-2to1", "single_device", 8, 1, ckpt_path=at(b, "two"))]
    # What resuming (b) did before the samples per step were recorded: a doubled global batch.
    back += [
        spec("local", "doubled", "single_device", 8, 2, ckpt_path=at("local", "two"), keep_global_batch=False)
    ]
    # ckpt_path given the path of a run's `last` pointer (on S3): resumes from the step-15 checkpoint it names.
    back += [
        dict(spec("s3", "pointer", "single_device", 8, 1, ckpt_path=at("s3", "one-8x1", last=True)), steps=17)
    ]

    # Shuffled, 64 indices (8 samples per step: 8 steps an epoch). 1 -> 2 from 20 samples (batches of 4 on 1
    # process): on 2 processes with batches of 8, 4 samples into a batch of 16; with batches of 2, at a whole one.
    # 2 -> 1 from 24 samples (batches of 4 on 2 processes): with batches of 10, 4 samples into one; with 4, at one.
    def shuffled(name: str, batch: int, steps: int, **more: Any) -> dict:
        return dict(spec("local", name, "single_device", batch, 1, **more), steps=steps, indexed=True)

    one += [shuffled("s-one", 4, 5, ckpt_every=5)]
    two += [dict(shuffled("s-two", 4, 3, ckpt_every=3, format="sharded"), strategy="fsdp")]
    # Each runs to its epoch's last batch: 44 samples in 22 a process, 3 batches of 8 or 11 of 2.
    two += [dict(shuffled("s-1to2", 8, 8, ckpt_path=at("local", "s-one")), strategy="fsdp")]
    two += [dict(shuffled("s-1to2-whole", 2, 16, ckpt_path=at("local", "s-one")), strategy="fsdp")]
    # 40 samples: 4 batches of 10; or 10 batches of 4, 2 a step (the samples per step kept).
    s_two = f"{roots['local']}/s-two/checkpoints/step-{3:06d}"
    back += [shuffled("s-2to1", 10, 7, ckpt_path=s_two), shuffled("s-2to1-whole", 4, 8, ckpt_path=s_two)]

    out_one = _execute(tmp_path, "one", 1, one)
    out_two = _execute(tmp_path, "two", 2, two)
    out_back = _execute(tmp_path, "back", 1, back)

    def result(backend: str, name: str) -> dict[str, Any]:
        return torch.load(tmp_path / f"{backend}-{name}.pt", weights_only=False)

    for b in roots:
        for resumed, reference, accumulate in (
            ("a-1to2", "one-4x2", 1),
            ("b-1to2", "one-8x1", 1),
            ("a-2to1", "two", 2),
            ("b-2to1", "two", 1),
        ):
            got, want = result(b, resumed), result(b, reference)
            assert (got["step"], got["epoch"], got["accumulate"]) == (STEPS, 1, accumulate), (b, resumed)
            error = _relative(got["params"], want["params"])
            assert error < TOLERANCE, (b, resumed, error)
    assert "world size changed from 1 to 2: keeping the checkpoint's 8 samples per optimizer step" in out_two
    assert "accumulate_grad_batches 2 -> 1" in out_two
    assert "world size changed from 2 to 1: keeping the checkpoint's 8 samples" in out_back
    assert "accumulate_grad_batches 1 -> 2" in out_back
    assert "per-process batch changed from 4 to 8: 8 samples per optimizer step as before" in out_back
    assert "per-process batch changed from 8 to 4: 8 samples per optimizer step as before" in out_two
    assert out_one.count("Resumed from") == 0 and out_two.count("Resumed from") == 6

    # The tolerance tells runs apart: the doubled global batch, and the state at the checkpoint, are far off.
    two_ranks = result("local", "two")["params"]
    doubled = result("local", "doubled")
    assert doubled["accumulate"] == 2 and _relative(doubled["params"], two_ranks) > 1e-3
    at_five = torch.load(
        tmp_path / "runs" / "one-8x1" / "checkpoints" / "step-000005.ckpt", weights_only=True
    )
    assert _relative(at_five["model"]["model"], two_ranks) > 1e-3

    pointer = result("s3", "pointer")
    directory = f"s3://{BUCKET}/runs/one-8x1/checkpoints"
    assert f"is the `last` pointer of {directory}, not a checkpoint" in out_back, out_back
    assert f"Resumed from {directory}/step-000015.ckpt at step 15" in out_back
    assert pointer["step"] == 17 and len(pointer["losses"]) == 2

    _each_index_once(result, out_two, out_back)


def _each_index_once(result: Any, out_two: str, out_back: str) -> None:
    """The shuffled runs: one order for the epoch, drawn from the seed, whatever the world size."""
    order = torch.randperm(64, generator=torch.Generator().manual_seed(7)).tolist()

    def seen(name: str) -> list[list[int]]:
        return result("local", name)["seen"]

    assert seen("s-one") == [order[:20]]
    assert seen("s-two") == [order[0:24:2], order[1:24:2]]
    for name in ("s-1to2", "s-1to2-whole"):
        # The ranks are dealt the rest of the epoch in turn, from sample 20 on.
        assert seen(name) == [order[20::2], order[21::2]], name
        assert Counter(seen("s-one")[0] + seen(name)[0] + seen(name)[1]) == Counter(range(64)), name
    for name in ("s-2to1", "s-2to1-whole"):
        assert seen(name) == [order[24:]], name
        assert Counter(seen("s-two")[0] + seen("s-two")[1] + seen(name)[0]) == Counter(range(64)), name
    assert result("local", "s-2to1-whole")["accumulate"] == 2
    assert (
        "this epoch goes on at its sample 20, 4 sample(s) into a batch of 16 of this run: its batches begin there"
        in out_two
    )
    assert "this epoch goes on at its sample 24, 4 sample(s) into a batch of 10 of this run" in out_back
    assert "seen again" not in out_two + out_back

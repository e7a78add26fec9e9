"""Checkpoints in an object store: a real S3 API server (moto's server mode) on 127.0.0.1, reached through
s3fs exactly as a user's run reaches S3 (see s3_server.py for the environment the workers inherit).

Round trips, publication (a prefix without its manifest is no checkpoint), the CLI on s3:// URLs, bad input;
exact resume under ddp (full) and fsdp (sharded) from ``default_root_dir=s3://...`` with ``ckpt_path="last"``;
resharding 2 -> 1; SIGKILL at random moments of a save (10 trials per format).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import stratagem as sg
from stratagem import CheckpointError
from stratagem.checkpoint import _offline, _store

sys.path.insert(0, str(Path(__file__).parent))
import ckpt_workers as W
from s3_server import S3Server

TESTS = Path(__file__).parent

pytest.importorskip("s3fs")
pytest.importorskip("moto")

BUCKET = "bucket"
SCRIPT = TESTS / "workloads" / "sg_workloads.py"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    saved = {
        k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", *S3Server.__init__.__globals__["CREDENTIALS"])
    }
    with S3Server() as server:
        server.create_bucket(BUCKET)
        os.environ.update(server.env())
        try:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()  # none made before this endpoint was set may be reused
            yield server
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _state(seed: int, step: int) -> dict[str, Any]:
    model, optimizer = W.trained(seed=seed)
    return {"model": model, "optimizer": optimizer, "step": step, "rng": sg.PerRank(torch.arange(3))}


def _objects(prefix: str) -> list[str]:
    fs, path = _store.filesystem(prefix)
    fs.invalidate_cache()
    return sorted(p[len(path) + 1 :] for p in fs.find(path))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stratagem", "checkpoint", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_s3_round_trips_publication_cli_and_bad_input(s3: S3Server, tmp_path: Path) -> None:
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    for fmt in ("full", "sharded"):
        url = f"s3://{BUCKET}/run/{fmt}"
        first = _state(seed=0, step=1)
        engine.save(url, first, format=fmt)
        second = _state(seed=1, step=2)
        engine.save(url, second, format=fmt)  # over the first: published whole, the first's data deleted
        model, optimizer = W.fresh()
        rest = engine.load(url, {"model": model, "optimizer": optimizer})
        assert W.same_state((model, optimizer), (second["model"], second["optimizer"])), fmt
        assert not W.same_state((model, optimizer), (first["model"], first["optimizer"]))
        assert rest["step"] == 2 and rest["rng"].tolist() == [0, 1, 2]
        objects = _objects(url)
        if fmt == "full":
            # One object, nothing beside or beneath it.
            assert [o for o in _objects(f"s3://{BUCKET}/run") if o.startswith("full")] == ["full"]
        else:
            data = {o.split("/")[0] for o in objects if o != "stratagem.json"}
            assert len(data) == 1 and next(iter(data)).startswith("data-"), objects
            assert "stratagem.json" in objects and f"{next(iter(data))}/.metadata" in objects

    # A prefix holding shards but no manifest (a save that died before publishing) is not a checkpoint.
    fs, _ = _store.filesystem("s3://x")
    fs.pipe_file(f"{BUCKET}/run/unpublished/data-0123456789ab/__0_0.distcp", b"partial")
    with pytest.raises(
        CheckpointError, match=r"s3://bucket/run/unpublished: holds objects but no stratagem\.json"
    ):
        engine.load(f"s3://{BUCKET}/run/unpublished", _state(0, 0))
    # A manifest-less sharded prefix beside a published one: the published one still loads.
    fs.pipe_file(f"{BUCKET}/run/sharded/data-fedcba987654/__0_0.distcp", b"partial")
    model, optimizer = W.fresh()
    engine.load(f"s3://{BUCKET}/run/sharded", {"model": model, "optimizer": optimizer})
    assert W.same_state((model, optimizer), W.trained(seed=1))

    # The CLI on S3 URLs: inspect both formats; consolidate S3 -> S3 and S3 -> local.
    for fmt in ("full", "sharded"):
        done = _cli("inspect", "--json", f"s3://{BUCKET}/run/{fmt}")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["format"], report["step"], report["world_size"]) == (fmt, 2, 1)
        assert report["path"] == f"s3://{BUCKET}/run/{fmt}" and report["bytes_on_disk"] > 0
    for output in (f"s3://{BUCKET}/run/consolidated.pt", str(tmp_path / "consolidated.pt")):
        done = _cli("consolidate", f"s3://{BUCKET}/run/sharded", output)
        assert done.returncode == 0, done.stderr
        model, optimizer = W.fresh()
        rest = engine.load(output, {"model": model, "optimizer": optimizer})
        assert W.same_state((model, optimizer), W.trained(seed=1)) and rest["step"] == 2, output
    full = _offline.inspect(f"s3://{BUCKET}/run/consolidated.pt")
    assert (
        full["format"] == "full"
        and full["tensor_bytes"] == _offline.inspect(f"s3://{BUCKET}/run/full")["tensor_bytes"]
    )

    # Bad input: an unknown scheme, a missing bucket, a full save over a sharded prefix.
    with pytest.raises(CheckpointError, match=r"'s4'.*Did you mean s3://\?.*stratagem\[s3\]") as info:
        engine.save("s4://bucket/x", _state(0, 0))
    assert "gs://" in str(info.value) and "az://" in str(info.value) and "memory://" in str(info.value)
    with pytest.raises(CheckpointError, match="s4://bucket/x"):
        engine.load("s4://bucket/x", _state(0, 0))
    with pytest.raises(
        CheckpointError, match=r"s3://no-such-bucket/x: the bucket 'no-such-bucket' does not exist"
    ):
        engine.save("s3://no-such-bucket/x", _state(0, 0), format="full")
    with pytest.raises(
        CheckpointError, match=r"s3://no-such-bucket/x: the bucket 'no-such-bucket' does not exist"
    ):
        engine.save("s3://no-such-bucket/x", _state(0, 0), format="sharded")
    with pytest.raises(CheckpointError, match=r"s3://no-such-bucket/x: does not exist"):
        engine.load("s3://no-such-bucket/x", _state(0, 0))
    with pytest.raises(CheckpointError, match="holds a sharded checkpoint"):
        engine.save(f"s3://{BUCKET}/run/sharded", _state(0, 0), format="full")
    model, optimizer = W.fresh()
    engine.load(f"s3://{BUCKET}/run/sharded", {"model": model, "optimizer": optimizer})  # still whole
    assert W.same_state((model, optimizer), W.trained(seed=1))

    # Credentials refused: a server that checks them, reached by the CLI as a user would.
    with S3Server(auth=True) as strict:
        done = _cli("inspect", f"s3://{BUCKET}/run/full", env=strict.env())
    assert done.returncode != 0
    # moto answers the HEAD with 403 and no body, which s3fs reports as PermissionError: Forbidden.
    assert f"s3://{BUCKET}/run/full" in done.stderr and "Forbidden" in done.stderr, done.stderr
    assert "refused the request: check the credentials" in done.stderr, done.stderr

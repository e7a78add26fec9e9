"""Checkpoints in an object store: a real S3 API server (moto's server mode) on 127.0.0.1, reached through
s3fs exactly as a user's run reaches S3 (see s3_server.py for the environment the workers inherit).

Round trips, publication (a prefix without its manifest is no checkpoint), the CLI on s3:// URLs, bad input;
exact resume under ddp (full) and fsdp (sharded) from ``default_root_dir=s3://...`` with ``ckpt_path="last"``;
resharding 2 -> 1; SIGKILL at random moments of a save (10 trials per format).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import time
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
from test_resume import _assert_resumed_exactly, _load

TESTS = Path(__file__).parent

pytest.importorskip("s3fs")
pytest.importorskip("moto")

BUCKET = "bucket"
SCRIPT = TESTS / "workloads" / "sg_workloads.py"


def _regression() -> torch.nn.Module:
    sys.path.insert(0, str(TESTS / "workloads"))
    from sg_workloads import Regression

    module = Regression()
    module.configure_model()
    return module


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


def test_uploads_send_the_crc32c_the_store_verifies(s3: S3Server) -> None:
    # A full checkpoint and a sharded one's state.pt go up in one PUT each, carrying x-amz-checksum-crc32c, which
    # S3 checks against the body on receipt. moto neither checks nor keeps it (it reads only checksums it is told
    # the algorithm of), so the requests themselves are looked at, through botocore's before-send event.
    import base64

    import google_crc32c

    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    engine.save(f"s3://{BUCKET}/crc/warm.ckpt", _state(seed=0, step=1), format="full")  # the client exists
    fs, _ = _store.filesystem(f"s3://{BUCKET}/crc")
    sent: dict[str, str | None] = {}

    def record(request: Any, **_: Any) -> None:
        key = request.url.split(f"/{BUCKET}/", 1)[-1].split("?", 1)[0]
        value = request.headers.get("x-amz-checksum-crc32c")
        sent[key] = value.decode() if isinstance(value, bytes) else value

    fs.s3.meta.events.register("before-send.s3.PutObject", record)
    try:
        for fmt, key in (("full", "crc/full.ckpt"), ("sharded", "crc/sharded")):
            engine.save(f"s3://{BUCKET}/{key}", _state(seed=0, step=1), format=fmt)
            if fmt == "sharded":
                manifest = json.loads(_store.read_bytes(f"s3://{BUCKET}/{key}/stratagem.json"))
                key = f"{key}/{manifest['data']}/state.pt"
            body = _store.read_bytes(f"s3://{BUCKET}/{key}")
            crc = base64.b64encode(google_crc32c.value(body).to_bytes(4, "big")).decode()
            assert sent.get(key) == crc, (fmt, key, sent)
    finally:
        fs.s3.meta.events.unregister("before-send.s3.PutObject", record)


def test_a_flaky_store_is_retried_and_a_dead_one_fails_in_bounded_time(
    s3: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    # A proxy fails requests between the client and moto (503s and connection resets): at 30%, saves and loads
    # succeed and every failed request was retried once, each retry logged once; at 100% a save fails within a
    # bounded time naming the store's error, and publishes nothing.
    import logging

    import s3fs
    from flaky_proxy import FlakyProxy

    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS")}
    with FlakyProxy(s3.endpoint, fraction=0.3, seed=41) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        # botocore's policy as a user sets it (docs/checkpoints.md): 2 attempts a request rather than 5, so that
        # its backoff (up to 1 + 2 + 4 + 8 s a request) does not take minutes of CI; s3fs's retries stay.
        os.environ["AWS_MAX_ATTEMPTS"] = "2"
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            with caplog.at_level(logging.WARNING, logger="stratagem.checkpoint"):
                for fmt in ("full", "sharded"):
                    url = f"s3://{BUCKET}/flaky/{fmt}"
                    state = _state(seed=2, step=5)
                    engine.save(url, state, format=fmt)
                    model, optimizer = W.fresh()
                    assert engine.load(url, {"model": model, "optimizer": optimizer})["step"] == 5
                    assert W.same_state((model, optimizer), (state["model"], state["optimizer"])), fmt
            retries = [r for r in caplog.records if "retrying" in r.getMessage()]
            print(
                f"30%: {proxy.failed} requests failed of {proxy.failed + proxy.forwarded}; {len(retries)} retries"
            )
            assert proxy.failed >= 5, "the proxy failed too few requests: the test proves nothing"
            # Each retry botocore or s3fs makes is logged once; a failure absorbed below them (a reset of a pooled
            # connection that the HTTP layer re-sends, a HEAD that s3fs follows with a listing) is not a retry of
            # theirs, and is not logged: so at most one line per failed request, and some.
            assert 0 < len(retries) <= proxy.failed, (len(retries), proxy.failed)

            proxy.fraction = 1.0
            url = f"s3://{BUCKET}/flaky/dead.ckpt"
            start = time.monotonic()
            with pytest.raises(CheckpointError) as caught:
                engine.save(url, _state(seed=3, step=6), format="full")
            took = time.monotonic() - start
            message = str(caught.value)
            print(f"100%: failed after {took:.1f} s: {message}")
            assert took < 30, took
            # s3fs raises a 503 as OSError(EBUSY, "Service Unavailable"), botocore as ServiceUnavailable
            named = ("ServiceUnavailable", "Service Unavailable", "503", "onnection")
            assert url in message and any(k in message for k in named), message
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            s3fs.S3FileSystem.clear_instance_cache()
    assert not any(o.startswith("dead") for o in _objects(f"s3://{BUCKET}/flaky")), "published after failing"


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
    if importlib.util.find_spec("gcsfs") is None:  # a supported store whose package is missing: the extra
        with pytest.raises(CheckpointError, match=r"gs://b/x: needs the gcsfs package .*stratagem\[gcs\]"):
            engine.save("gs://b/x", _state(0, 0))
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


# -------------------------------------------------------------------------------------------------
# the Trainer on S3: exact resume with ckpt_path="last" under ddp and fsdp, resharding 2 -> 1
# -------------------------------------------------------------------------------------------------

RUN = ["--devices", "2", "--batch", "4", "--shuffle", "--dropout", "0.2", "--optimizer", "adamw"]
RUN += ["--scheduler", "--timeout", "60"]


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    # cwd: a run rooted at a URL keeps its metrics.csv under ./runs/s3/...
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *RUN, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], timeout: float = 150) -> str:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    assert process.returncode == 0, out + err
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("strategy", "fmt"), [("ddp", "full"), ("fsdp", "sharded")])
def test_trainer_resumes_exactly_from_s3_last(s3: S3Server, tmp_path: Path, strategy: str, fmt: str) -> None:
    # Per rank: 48 samples in batches of 4, 12 steps an epoch; the run stops at step 6 (checkpoints at 3 and
    # 6, keep_last_k=1 prunes step 3 on S3), and a new run with ckpt_path="last" carries on from step 6, in
    # the middle of epoch 0, to step 10. It must match a run that never stopped, bit for bit. Under fsdp the
    # checkpoints are asynchronous (Trainer(async_checkpoint=True)): fit returns once the last is published.
    root = f"s3://{BUCKET}/trainer-{strategy}"
    common = ["--strategy", strategy, "--format", fmt, "--ckpt-every", "3", "--keep-last-k", "1"]
    if fmt == "sharded":
        common.append("--async-ckpt")  # fsdp's periodic checkpoints through dcp.async_save
    plain = _start(
        [
            "--strategy",
            strategy,
            "--steps",
            "10",
            "--root",
            str(tmp_path / "plain"),
            "--out",
            str(tmp_path / "plain-out"),
        ],
        tmp_path,
    )
    first = _start([*common, "--steps", "6", "--root", root, "--out", str(tmp_path / "a")], tmp_path)
    _finish(first)
    directory = f"{root}/run0/checkpoints"
    step6 = "step-000006" + (".ckpt" if fmt == "full" else "")
    assert _store.read_bytes(f"{directory}/last").decode().strip() == step6
    assert [n for n in _store.children(directory) if n.startswith("step-")] == [step6]  # step 3 pruned
    if fmt == "sharded":
        _check_reshard_inspect_consolidate(root, f"{directory}/{step6}", _load(tmp_path / "a", 0)["params"])
    resumed = _start(
        [*common, "--steps", "10", "--root", root, "--ckpt-path", "last", "--out", str(tmp_path / "b")],
        tmp_path,
    )
    output = _finish(resumed)
    assert f"Resumed from {directory}/{step6} at step 6" in output, output
    _finish(plain)
    for rank in (0, 1):
        straight, again = (_load(tmp_path / n, rank) for n in ("plain-out", "b"))
        _assert_resumed_exactly(straight, again, resumed_from_batch=6)
    assert len(_load(tmp_path / "b", 0)["losses"]) == 4


def _check_reshard_inspect_consolidate(root: str, checkpoint: str, at_six: dict[str, torch.Tensor]) -> None:
    # Written by 2 ranks, the sharded checkpoint at step 6 loads in one process and equals the state at step 6
    # (the first run's snapshot at its end); inspect and consolidate read it from S3.
    module = _regression()
    optimizer = torch.optim.AdamW(module.parameters())
    single = sg.Engine(strategy="single_device", accelerator="cpu")
    single.load(f"{checkpoint}", {"model": module, "optimizer": optimizer}, strict=False)
    assert module.state_dict().keys() == at_six.keys()
    for name, value in module.state_dict().items():
        assert torch.equal(value, at_six[name]), name
    report = json.loads(_cli("inspect", "--json", f"{checkpoint}").stdout)
    assert (report["format"], report["world_size"], report["strategy"], report["step"]) == (
        "sharded",
        2,
        "fsdp",
        6,
    )
    done = _cli("consolidate", f"{checkpoint}", f"{root}/consolidated.pt")
    assert done.returncode == 0, done.stderr
    payload = torch.load(io.BytesIO(_store.read_bytes(f"{root}/consolidated.pt")), weights_only=True)
    for name, value in at_six.items():
        assert torch.equal(payload["model"]["model"][name], value), name
    # The optimizer state, resharded from 2 ranks into this one, is what offline consolidation reads too.
    single.save(f"{root}/one-process.pt", {"model": module, "optimizer": optimizer}, format="full")
    again = torch.load(io.BytesIO(_store.read_bytes(f"{root}/one-process.pt")), weights_only=True)
    want = payload["optimizers"]["optimizer"]["state"]
    got = again["optimizers"]["optimizer"]["state"]
    assert want and got.keys() == want.keys()
    for key, values in want.items():
        for name, value in values.items():
            assert torch.equal(got[key][name], value), (key, name)


# -------------------------------------------------------------------------------------------------
# SIGKILL during saves to S3
# -------------------------------------------------------------------------------------------------


CRASH = [sys.executable, str(TESTS / "ckpt_workers.py"), "crash", "--trials", "10", "--megabytes", "16"]
CRASH += ["--seed", "1"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigkill_during_s3_saves_leaves_last_loadable(s3: S3Server, temp_dir) -> None:
    # ckpt_workers.store_crash_trials: 10 saves per format, each killed at a random moment of a Trainer-style
    # periodic save (checkpoint, `last`, pruning); after each, the lookup behind ckpt_path="last" must find a
    # checkpoint that loads whole (the previous or the new version), and no other complete-looking one may be
    # partial. Both formats, blocking and asynchronous (blocking=False, as Trainer(async_checkpoint=True) saves),
    # run at once, in their own processes.
    runs = {
        (fmt, mode): subprocess.Popen(
            [*CRASH, "--format", fmt, "--directory", f"s3://{BUCKET}/crash-{fmt}{mode}"]
            + (["--async"] if mode else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for fmt in ("full", "sharded")
        for mode in ("", "-async")
    }
    for fmt, process in runs.items():  # fmt: (format, mode)
        out, err = process.communicate(timeout=280)
        assert process.returncode == 0, (fmt, out + err)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["errors"] == [], result
        assert result["loaded_previous"] + result["loaded_new"] == 10, result
        # The kills landed mid-save, most of them before publication (else the test proves nothing).
        assert result["killed_mid_save"] >= 5 and result["loaded_previous"] >= 3, result
        assert result["asynchronous"] == (fmt[1] == "-async")
    # Each process saved once more after its last kill: the local scratch of the killed saves is gone.
    assert temp_dir.left() == [], "the saves left these in the temporary directory"


KILLED_SAVER = """
import sys
import stratagem as sg
from ckpt_workers import Blob

engine, model = sg.Engine(strategy="single_device", accelerator="cpu"), Blob(16)
while True:
    engine.save(sys.argv[1], {"model": model}, format="full")
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_save_after_one_killed_mid_upload_removes_its_local_scratch(s3: S3Server, temp_dir) -> None:
    url = f"s3://{BUCKET}/killed-upload/model.ckpt"
    saver = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVER, url], cwd=TESTS, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        # A full save to a store writes a local copy of the checkpoint, then uploads it: kill it in between.
        while not any(_upload_scratch(temp_dir.path)):
            assert saver.poll() is None and time.monotonic() < deadline, saver.communicate()
            time.sleep(0.01)
    finally:
        saver.kill()
        saver.wait()
    assert _upload_scratch(temp_dir.path), "the kill left nothing to clean up: the test proves nothing"

    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model = W.Blob(1)
    engine.save(url, {"model": model, "step": 3}, format="full")
    assert temp_dir.left() == [], "the killed save's local copy is still in the temporary directory"
    assert engine.load(url, {"model": W.Blob(1)})["step"] == 3


def _upload_scratch(directory: Path) -> list[int]:
    """The sizes of the local copies of checkpoints being uploaded (files come and go while we look)."""
    sizes = []
    for entry in os.scandir(directory):
        if entry.name.startswith("stratagem-upload-"):
            try:
                sizes.append(entry.stat().st_size)
            except FileNotFoundError:
                continue
    return sizes


# -------------------------------------------------------------------------------------------------
# asynchronous saves
# -------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_async_saves_to_s3_while_training_goes_on(s3: S3Server, tmp_path: Path) -> None:
    # Two ranks; per format: save with blocking=False to S3, keep training while it runs, load and compare
    # with the state at the step the save was taken; then a background write that fails (EFBIG, a real
    # write error) is raised at the next save, on every rank, with the path, and the previous one stays.
    engine = sg.Engine(strategy=W.ShardingTestStrategy(), accelerator="cpu", devices=2, timeout=120)
    ranks = engine.launch(W.async_saves, f"s3://{BUCKET}/async", str(tmp_path))["ranks"]
    assert len(ranks) == 2
    for seen in ranks:
        for fmt in ("full", "sharded"):
            r = seen[fmt]
            assert r["steps_during_save"] >= 1, (fmt, r)  # training went on while the save ran ...
            assert r["training_changed_params"], (fmt, r)  # ... and changed the parameters (copied in the
            assert r["training_changed_buffers"], (fmt, r)  # background) and the buffers (copied at once),
            assert r["loaded_equals_state_at_save"] and r["loaded_moments_equal"], (
                fmt,
                r,
            )  # yet the save holds
            assert r["step"] == 2  # the state of the step it was taken at, bit for bit.
            assert r["returned_s"] < r["written_s"], (fmt, r)
            error = r["next_save_error"]
            assert error is not None and f"fails-{fmt}" in error and "background save failed" in error, error
            assert r["previous_intact_step"] == 1, (fmt, r)
    # Written by 2 ranks: the sharded one is split across them (rank r writes __r_*.distcp).
    shards = [
        n.rsplit("/", 1)[-1] for n in _objects(f"s3://{BUCKET}/async/async-sharded") if n.endswith(".distcp")
    ]
    assert {n[:4] for n in shards} == {"__0_", "__1_"}, shards

"""Checkpoints that detect corruption, in one process: every file's CRC32C recorded as it is written (checked
here against google-crc32c over the file's bytes), a flipped bit in any file refused on load naming the file and
both checksums, ``stratagem checkpoint verify``, checkpoints written before checksums, and ``ckpt_path="last"``
falling back to the newest checkpoint that verifies."""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
import ckpt_workers as W
from test_checkpoint import without_checksums

FORMATS = ["full", "sharded"]
TRAILER = 32  # magic (16), CRC32C in hex (8), length (8)


@pytest.fixture(scope="module")
def engine() -> sg.Engine:
    return sg.Engine(strategy="single_device", accelerator="cpu")


def _save(engine: sg.Engine, path: Path, fmt: str, seed: int = 0) -> tuple[Any, Any]:
    model, optimizer = W.trained(seed=seed)
    engine.save(path, {"model": model, "optimizer": optimizer, "step": 3}, format=fmt)
    return model, optimizer


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def flip(file: Path, bit: int) -> None:
    data = bytearray(file.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    file.write_bytes(bytes(data))


def _load(engine: sg.Engine, path: Path) -> None:
    model, optimizer = W.fresh()
    engine.load(path, {"model": model, "optimizer": optimizer})


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_file_has_its_checksum_recorded(engine: sg.Engine, tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "ckpt"
    _save(engine, path, fmt)
    if fmt == "full":
        data = path.read_bytes()
        body, tail = data[:-TRAILER], data[-TRAILER:]
        assert tail[:16] == b"STRATAGEM-CRC32C"
        assert tail[16:24].decode() == f"{google_crc32c.value(body):08x}"
        assert struct.unpack(">Q", tail[24:])[0] == len(body)
        assert torch.load(path, weights_only=True)["stratagem"]["checksum"] == "crc32c-trailer"
        return
    meta = json.loads((path / "stratagem.json").read_text())
    recorded = meta["checksums"]["files"]
    assert meta["checksums"]["algorithm"] == "crc32c"
    on_disk = {p.name for p in _files(path)} - {"stratagem.json"}
    assert set(recorded) == on_disk and {".metadata", "state.pt", "__0_0.distcp"} <= on_disk
    for name, value in recorded.items():
        assert value == f"{google_crc32c.value((path / name).read_bytes()):08x}", name


@pytest.mark.parametrize("cores", [1, 2])
def test_large_writes_are_summed_as_they_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int
) -> None:
    """A write larger than a piece (a tensor's bytes) is summed as it is written: a piece at a time on one
    core, on a helper thread beside the write on several. The file holds every byte once, in order, and the
    checksum is google-crc32c's over the file."""
    from stratagem.checkpoint import _checksum

    monkeypatch.setattr(_checksum, "_parts", lambda: cores)
    writes = [torch.randn(900_000).numpy(), b"x" * 7, memoryview(torch.randn(3).numpy()), bytearray(3 << 20)]
    writes[-1][-1] = 1
    with open(tmp_path / "f", "wb", buffering=0) as raw, _checksum.Summing(raw) as stream:
        sizes = [stream.write(data) for data in writes]
        value, length = stream.value, stream.length
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(bytes(memoryview(w).cast("B")) for w in writes)
    assert sizes == [len(memoryview(w).cast("B")) for w in writes] and length == len(data)
    assert f"{value:08x}" == f"{google_crc32c.value(data):08x}"


def test_a_write_that_fails_beside_its_sum_raises_once_the_sum_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills during a large write: the error reaches the caller (not the helper summing beside it),
    after the helper is done reading the caller's memory; the stream's checksum is not advanced."""
    import errno
    import io
    import threading

    from stratagem.checkpoint import _checksum

    monkeypatch.setattr(_checksum, "_parts", lambda: 2)
    summing, summed = threading.Event(), threading.Event()
    extend = _checksum.extend

    def slow_extend(value: int, data: object) -> int:
        summing.wait(5)  # still summing when the write fails
        time.sleep(0.2)
        value = extend(value, data)
        summed.set()
        return value

    class Full(io.BytesIO):  # a binary stream whose device is full
        def write(self, data: Any) -> int:
            summing.set()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_checksum, "extend", slow_extend)
    stream = _checksum.Summing(Full())
    with pytest.raises(OSError, match="No space left"):
        stream.write(torch.randn(1 << 20).numpy())
    assert summed.is_set(), "the write returned while the helper was still reading its bytes"
    assert (stream.value, stream.length) == (0, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_flipped_bit_in_any_file_is_refused_naming_it(engine: sg.Engine, tmp_path: Path, fmt: str) -> None:
    good = tmp_path / "good"
    _save(engine, good, fmt)
    for index, original in enumerate(_files(good)):
        path = tmp_path / f"flipped-{index}"
        if fmt == "full":
            path.write_bytes(good.read_bytes())
            file = path
        else:
            path.mkdir()
            for f in _files(good):
                (path / f.name).write_bytes(f.read_bytes())
            file = path / original.name
        # The middle of the file, and its last byte (a trailer, a manifest's closing brace).
        for bit in (file.stat().st_size * 4, file.stat().st_size * 8 - 1):
            before = file.read_bytes()
            flip(file, bit)
            with pytest.raises(CheckpointError) as caught:
                _load(engine, path)
            message = str(caught.value)
            assert file.name in message, message
            if "fails verification" in message:
                assert "expected" in message and "found" in message, message
            else:  # a manifest that no longer parses as JSON
                assert "stratagem.json is unreadable" in message, message
            file.write_bytes(before)
        _load(engine, path)  # restored, it loads


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_summed_in_parts_on_threads_still_refuse_a_flip_in_any_part(
    engine: sg.Engine, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large file is verified in parts summed on threads at once, their checksums combined: the combined
    value is the file's (google-crc32c over its bytes), and a bit flipped in any part, the last one included, is
    refused by a load. (The tiny files here are split as a 500 MB one is, by lowering the threshold.)"""
    from stratagem.checkpoint import _checksum

    monkeypatch.setattr(_checksum, "SPLIT_BYTES", 1024)
    monkeypatch.setattr(_checksum, "_parts", lambda: 3)
    path = tmp_path / "ckpt"
    _save(engine, path, fmt)
    file = path if fmt == "full" else max(_files(path), key=lambda f: f.stat().st_size)
    size = file.stat().st_size
    assert size >= 3 * 1024, size  # three parts of 512 bytes or more
    assert _checksum.crc_of(file) == f"{google_crc32c.value(file.read_bytes()):08x}"
    body = size - TRAILER if fmt == "full" else size
    for part in range(3):
        bit = (body * part // 3 + body // 6) * 8  # the middle of each part
        flip(file, bit)
        with pytest.raises(CheckpointError, match="fails verification") as caught:
            _load(engine, path)
        assert file.name in str(caught.value)
        flip(file, bit)
    _load(engine, path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoints_without_checksums_still_load(engine: sg.Engine, tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "old"
    model, optimizer = _save(engine, path, fmt)
    if fmt == "full":  # what torch.save wrote before: no trailer, no "checksum" in the metadata
        payload = torch.load(path, weights_only=True)
        del payload["stratagem"]["checksum"]
        torch.save(payload, path)
    else:
        without_checksums(path)
    fresh = W.fresh()
    engine.load(path, {"model": fresh[0], "optimizer": fresh[1]})
    assert W.same_state(fresh, (model, optimizer))


def _verify(stratagem_cli: Any, *paths: Path) -> tuple[int, str]:
    """``stratagem checkpoint verify PATH...``, in this process: its status and output."""
    done = stratagem_cli("checkpoint", "verify", *map(str, paths))
    return done.returncode, done.stdout


def test_cli_verify(engine: sg.Engine, tmp_path: Path, stratagem_cli: Any) -> None:
    made = {}
    for fmt in FORMATS:
        for case in ("good", "flipped", "truncated", "old"):
            made[f"{case}-{fmt}"] = path = tmp_path / f"{case}-{fmt}"
            _save(engine, path, fmt)
        made[f"missing-shard-{fmt}"] = tmp_path / f"missing-shard-{fmt}"
    _save(engine, made["missing-shard-sharded"], "sharded")
    full, sharded = made["flipped-full"], made["flipped-sharded"]
    flip(full, 8 * 1000 + 3)
    flip(sharded / "__0_0.distcp", 8 * 100)
    truncated = made["truncated-full"].read_bytes()
    made["truncated-full"].write_bytes(truncated[: len(truncated) // 2])
    shard = made["truncated-sharded"] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    (made["missing-shard-sharded"] / "__0_0.distcp").unlink()
    payload = torch.load(made["old-full"], weights_only=True)
    del payload["stratagem"]["checksum"]
    torch.save(payload, made["old-full"])
    without_checksums(made["old-sharded"])
    del made["missing-shard-full"]

    code, out = _verify(
        stratagem_cli, made["good-full"], made["good-sharded"], made["old-full"], made["old-sharded"]
    )
    assert code == 0, out
    lines = out.splitlines()
    assert f"{made['good-full']}: ok" in lines and f"{made['good-sharded']}: ok" in lines, lines
    for fmt in FORMATS:
        assert any(line.startswith(f"{made[f'old-{fmt}']}: no checksums") for line in lines), lines
    assert "4 of 4 checkpoint(s) passed" in lines

    failing = [made[k] for k in made if not k.startswith(("good", "old"))]
    code, out = _verify(stratagem_cli, *failing)
    assert code == 1, out
    for path in failing:
        assert f"{path}: FAILED" in out, out
    assert "0 of 5 checkpoint(s) passed" in out
    assert "MISMATCH     __0_0.distcp: expected" in out  # flipped, truncated shard
    assert "MISMATCH     flipped-full: expected" in out
    assert "UNREADABLE   truncated-full" in out  # its trailer cut off with the rest: torch cannot read it
    assert "MISSING      __0_0.distcp" in out
    for fmt in FORMATS:  # each alone: the exit code says which failed
        assert _verify(stratagem_cli, made[f"good-{fmt}"])[0] == 0
        assert _verify(stratagem_cli, made[f"flipped-{fmt}"])[0] == 1


class _Net(sg.Module):
    def configure_model(self) -> None:
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _fit(root: Path, fmt: str, max_steps: int, ckpt_path: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    trainer = sg.Trainer(
        max_steps=max_steps,
        enable_progress_bar=False,
        default_root_dir=root,
        checkpoint_every_n_steps=2,
        checkpoint_format=fmt,
        loggers=[],
    )
    module = _Net()
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_last_skips_a_checkpoint_that_fails_verification(
    engine: sg.Engine, tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    straight = _fit(tmp_path / "straight", fmt, max_steps=3)
    root = tmp_path / "run"
    _fit(root, fmt, max_steps=4)  # checkpoints at steps 2 and 4; `last` names step 4
    directory = root / "checkpoints"
    newest = directory / ("step-000004.ckpt" if fmt == "full" else "step-000004")
    previous = directory / ("step-000002.ckpt" if fmt == "full" else "step-000002")
    target = newest if fmt == "full" else newest / "__0_0.distcp"
    flip(target, target.stat().st_size * 4 + 5)
    module = torch.nn.Module()
    module.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with pytest.raises(
        CheckpointError, match=f"newest complete checkpoint beside it that verifies is {previous}"
    ):
        engine.load(newest, {"model": module})
    capsys.readouterr()
    resumed = _fit(root, fmt, max_steps=3, ckpt_path="last")  # no save before the end: step 4 stays
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "fail verification" in line]
    assert len(skipped) == 1 and newest.name in skipped[0] and str(previous) in skipped[0], out
    assert f"Resumed from {previous} at step 2" in out, out
    for name, value in straight.items():  # from step 2 on, bit-identical to the run never interrupted
        assert torch.equal(value, resumed[name]), name
    # Nothing deleted: the corrupt checkpoint is kept, as it was, for whoever looks into it.
    from stratagem.checkpoint._verify import verify

    assert target.exists() and not verify(newest).passed


def test_errors_cross_processes_whole() -> None:
    """DCP gathers every rank's error pickled, and a worker's reaches its launcher so: a ChecksumError could not be
    unpickled (its class was called with the message alone: "missing 3 required positional arguments"), and a
    sharded load under a process group lost the name of the file that failed."""
    import pickle

    from stratagem.checkpoint._checksum import ChecksumError
    from stratagem.errors import CheckpointError, WorkerFailedError

    for error in (
        CheckpointError("/runs/step-2", "could not be read"),
        ChecksumError("/runs/step-2", "__0_1.distcp", "0x1", "0x2", "Load an older one."),
        WorkerFailedError(1, 3, "boom"),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error), (again, error)
        assert again.__dict__ == error.__dict__


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork exists on POSIX systems only, not on Windows")
def test_a_forked_child_sums_large_writes_with_threads_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper's threads are the parent's alone: a child forked after a large write has been summed (as the
    launcher's fork server forks workers) sums its own large writes, and does not wait forever for threads it
    does not have."""
    from stratagem.checkpoint import _checksum

    monkeypatch.setattr(_checksum, "_parts", lambda: 2)
    data = torch.randn(1 << 20).numpy()
    with open(tmp_path / "parent", "wb") as raw:
        _checksum.Summing(raw).write(data)
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its sum is google-crc32c's
        code = 1
        try:
            with open(tmp_path / "child", "wb") as raw:
                stream = _checksum.Summing(raw)
                stream.write(data)
            code = 0 if stream.value == google_crc32c.value(data.tobytes()) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung summing a large write")
    assert os.waitstatus_to_exitcode(status) == 0

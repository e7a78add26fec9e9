"""The one launch of test_checkpoint_bitflips.py: in the same two worker processes, for each strategy, one short
fit with periodic checkpoints in the strategy's own format, then that trainer's state saved in the other format
and on S3 (``Trainer.save_checkpoint``, the code periodic saves go through), then a flipped bit in its newest
checkpoint and a fit with ``ckpt_path="last"``, which must resume from the previous one.

Also, for the test process: the regions of a checkpoint's files that a flipped bit is placed in."""

from __future__ import annotations

import io
import random
import struct
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from seed_models import MICRO, Regression, eval_dataset
from torch.utils.data import DataLoader

import stratagem as sg

STEPS = 2  # checkpoints at steps 1 and 2


def _fit(strategy: str, root: str, fmt: str, ckpt_path: str | None = None) -> tuple[sg.Trainer, Any]:
    trainer = sg.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        enable_progress_bar=False,
        default_root_dir=root,
        checkpoint_every_n_steps=1,
        checkpoint_format=fmt,
        seed=0,
        loggers=[],
    )
    model = Regression(width=16)
    trainer.fit(model, DataLoader(eval_dataset(), batch_size=MICRO, shuffle=True), ckpt_path=ckpt_path)
    params = {k: v.clone() for k, v in trainer.strategy.module_state_dict(trainer.model, full=True).items()}
    return trainer, params


def files_of(checkpoint: str) -> list[str]:
    """Every file (object) of a checkpoint, as paths or URLs, sorted."""
    if "://" in checkpoint:
        from stratagem.checkpoint import _store

        fs, path = _store.filesystem(checkpoint)
        fs.invalidate_cache()
        if fs.isfile(path):
            return [checkpoint]
        scheme = checkpoint.split("://", 1)[0]
        return sorted(f"{scheme}://{p}" for p in fs.find(path))
    root = Path(checkpoint)
    return [str(root)] if root.is_file() else sorted(str(p) for p in root.rglob("*") if p.is_file())


def read(file: str) -> bytes:
    from stratagem.checkpoint import _store

    return _store.read_bytes(file) if "://" in file else Path(file).read_bytes()


def write(file: str, data: bytes) -> None:
    from stratagem.checkpoint import _store

    if "://" in file:
        _store.write_bytes(file, data)
    else:
        Path(file).write_bytes(data)


def flip(file: str, seed: int, region: tuple[int, int] | None = None) -> tuple[bytes, int]:
    """Flip one bit of ``file`` at an offset drawn from ``seed`` (inside the byte range ``region``, if given);
    returns the original bytes and the bit."""
    data = read(file)
    start, end = region or (0, len(data))
    bit = start * 8 + random.Random(seed).randrange((end - start) * 8)
    changed = bytearray(data)
    changed[bit // 8] ^= 1 << (bit % 8)
    write(file, bytes(changed))
    return data, bit


def regions(file: str, data: bytes) -> dict[str, tuple[int, int]]:
    """The byte ranges of one file that a flipped bit must be caught in, by name.

    A full checkpoint (torch's zip, then stratagem's trailer): the first entry's local header, every entry's
    data (the pickle, each tensor's storage, torch's small records), the central directory, the end record,
    and the trailer's three fields (magic, checksum, length), each of which a load reads by another path.
    A manifest: the whole text, its recorded checksums, and a value only its seal covers. Any other file (DCP shards, ``.metadata``,
    ``state.pt``, DeepSpeed's files): the whole file."""
    from stratagem.checkpoint._checksum import TRAILER_SIZE

    name = file.rsplit("/", 1)[-1]
    if name == "stratagem.json":
        text = data.decode()
        start = text.index('"checksums"')
        # A value nothing but the manifest's own checksum covers: only its seal tells that it changed.
        value = text.index('"', text.index(":", text.index('"torch_version"')) + 1)
        return {
            "manifest": (0, len(data)),
            "manifest checksums": (start, text.index("}", start)),
            "manifest torch_version": (value + 1, text.index('"', value + 1)),
        }
    if not name.endswith(".ckpt"):
        return {"file": (0, len(data))}
    body = len(data) - TRAILER_SIZE
    archive = zipfile.ZipFile(io.BytesIO(data[:body]))
    entries = archive.infolist()
    out: dict[str, tuple[int, int]] = {"zip header": (0, 30)}
    for entry in entries:
        # The local header: 30 bytes, then the name and the extra field, whose lengths it records.
        name_length, extra_length = struct.unpack(
            "<HH", data[entry.header_offset + 26 : entry.header_offset + 30]
        )
        start = entry.header_offset + 30 + name_length + extra_length
        if entry.compress_size:
            out[entry.filename] = (start, start + entry.compress_size)
    end_record = data.rindex(b"PK\x05\x06", 0, body)
    directory = struct.unpack("<I", data[end_record + 16 : end_record + 20])[0]
    out["zip central directory"] = (directory, end_record)
    out["zip end record"] = (end_record, body)
    out["trailer magic"] = (body, body + 16)
    out["trailer checksum"] = (body + 16, body + 24)
    out["trailer length"] = (body + 24, len(data))
    return out


def run_all(engine: Any, workdir: str, s3_url: str | None, strategies: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": {}}
    for strategy in strategies:
        start = time.perf_counter()
        own = "full" if strategy == "ddp" else "sharded"
        root = f"{workdir}/{strategy}"
        try:
            trainer, params = _fit(strategy, root, own)
            out[f"{strategy}/{own}/local"] = {
                "newest": f"{trainer.checkpoint_dir}/{_name(STEPS, own)}",
                "previous": f"{trainer.checkpoint_dir}/{_name(STEPS - 1, own)}",
                "params": params,
            }
        except Exception as error:  # one failing case does not hide the others
            out[f"{strategy}/{own}/local"] = {"error": f"{type(error).__name__}: {error}"}
            continue
        for fmt in ("full", "sharded") if strategy != "ddp" else ("full",):
            places = {"local": f"{workdir}/{strategy}-other"} if fmt != own else {}
            if s3_url is not None and not (strategy.startswith("deepspeed") and fmt == "sharded"):
                places["s3"] = f"{s3_url}/{strategy}-{fmt}"  # DeepSpeed's own layout is local only
            for place, directory in places.items():
                newest = f"{directory}/{_name(STEPS, fmt)}"
                try:
                    trainer.save_checkpoint(newest, format=fmt)
                    out[f"{strategy}/{fmt}/{place}"] = {"newest": newest}
                except Exception as error:
                    out[f"{strategy}/{fmt}/{place}"] = {"error": f"{type(error).__name__}: {error}"}
        out[f"{strategy}/resume"] = _resume(strategy, root, out[f"{strategy}/{own}/local"], own)
        out["seconds"][strategy] = round(time.perf_counter() - start, 1)
    return out


def _name(step: int, fmt: str) -> str:
    return f"step-{step:06d}" + (".ckpt" if fmt == "full" else "")


def _resume(strategy: str, root: str, case: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A flipped bit in the newest checkpoint of the strategy's own format; ``ckpt_path="last"`` resumes from
    the previous one, and the run ends bit-identical to the one never interrupted."""
    seed = 1000 + len(strategy)
    if dist.get_rank() == 0:
        files = files_of(case["newest"])
        target = files[random.Random(seed).randrange(len(files))]
        _, bit = flip(target, seed)
    dist.barrier()
    try:
        trainer, params = _fit(strategy, root, fmt, ckpt_path="last")
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    same = all(torch.equal(params[k], case["params"][k]) for k in case["params"])
    result = {"resumed_from": str(trainer.ckpt_path), "identical": same, "seed": seed}
    if dist.get_rank() == 0:
        result.update(file=target, bit=bit)
    return result

"""The one launch of test_checkpoint_bitflips.py: in the same two worker processes, for each strategy, a short
fit with periodic checkpoints (full and sharded, on the local disk and on S3), then once per strategy a flipped
bit in its newest checkpoint and a fit with ``ckpt_path="last"``, which must resume from the previous one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from seed_models import MICRO, Regression, eval_dataset
from torch.utils.data import DataLoader

import stratagem as sg

STEPS = 4  # checkpoints at steps 2 and 4


def _fit(strategy: str, root: str, fmt: str, ckpt_path: str | None = None) -> tuple[sg.Trainer, Any]:
    trainer = sg.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        enable_progress_bar=False,
        default_root_dir=root,
        checkpoint_every_n_steps=2,
        checkpoint_format=fmt,
        seed=0,
        loggers=[],
    )
    model = Regression()
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


def flip(file: str, seed: int) -> tuple[bytes, int]:
    """Flip one bit of ``file`` at an offset drawn from ``seed``; returns the original bytes and the bit."""
    from stratagem.checkpoint import _store

    remote = "://" in file
    data = _store.read_bytes(file) if remote else Path(file).read_bytes()
    bit = random.Random(seed).randrange(len(data) * 8)
    changed = bytearray(data)
    changed[bit // 8] ^= 1 << (bit % 8)
    if remote:
        _store.write_bytes(file, bytes(changed))
    else:
        Path(file).write_bytes(bytes(changed))
    return data, bit


def run_all(engine: Any, workdir: str, s3_url: str | None, strategies: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in strategies:
        for fmt in ("full", "sharded") if strategy != "ddp" else ("full",):
            places = {"local": f"{workdir}/{strategy}-{fmt}"}
            if s3_url is not None and not (strategy.startswith("deepspeed") and fmt == "sharded"):
                places["s3"] = f"{s3_url}/{strategy}-{fmt}"  # DeepSpeed's own layout is local only
            for place, root in places.items():
                try:
                    trainer, params = _fit(strategy, root, fmt)
                    out[f"{strategy}/{fmt}/{place}"] = {
                        "newest": str(trainer.checkpoint_dir) + "/" + _name(4, fmt),
                        "previous": str(trainer.checkpoint_dir) + "/" + _name(2, fmt),
                        "params": params,
                    }
                except Exception as error:  # one failing case does not hide the others
                    out[f"{strategy}/{fmt}/{place}"] = {"error": f"{type(error).__name__}: {error}"}
        out[f"{strategy}/resume"] = _resume(strategy, workdir, out)
    return out


def _name(step: int, fmt: str) -> str:
    return f"step-{step:06d}" + (".ckpt" if fmt == "full" else "")


def _resume(strategy: str, workdir: str, out: dict[str, Any]) -> dict[str, Any]:
    """A flipped bit in the newest checkpoint of the strategy's own format; ``ckpt_path="last"`` resumes from
    the previous one, and the run ends bit-identical to the one never interrupted."""
    fmt = "full" if strategy == "ddp" else "sharded"
    case = out.get(f"{strategy}/{fmt}/local", {})
    if "error" in case:
        return {"error": "no checkpoint to resume from"}
    seed = 1000 + len(strategy)
    if dist.get_rank() == 0:
        files = files_of(case["newest"])
        target = files[random.Random(seed).randrange(len(files))]
        _, bit = flip(target, seed)
    dist.barrier()
    try:
        trainer, params = _fit(strategy, f"{workdir}/{strategy}-{fmt}", fmt, ckpt_path="last")
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    same = all(torch.equal(params[k], case["params"][k]) for k in case["params"])
    result = {"resumed_from": str(trainer.ckpt_path), "identical": same, "seed": seed}
    if dist.get_rank() == 0:
        result.update(file=target, bit=bit)
    return result

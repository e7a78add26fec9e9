"""One flipped bit at a random offset of a random file of a checkpoint is detected (issue 41): under ddp, fsdp,
fsdp_tp and deepspeed_stage_3, full and sharded, on the local disk and on S3 (moto on 127.0.0.1).

One launch (bitflip_runs.run_all) writes every checkpoint and checks, once per strategy, that
``ckpt_path="last"`` skips a corrupted newest checkpoint and resumes from the previous one, ending bit-identical
to the run never interrupted. Then, in this process, 20 trials per checkpoint (seeds 0-19, printed): a bit
flipped, ``stratagem checkpoint verify``'s function and ``Engine.load`` (single_device, which reads every file of
the full and DCP checkpoints: resharding 2 -> 1) must both refuse it naming the file, then the bit restored.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stratagem as sg
from stratagem import CheckpointError

sys.path.insert(0, str(Path(__file__).parent / "seed_examples"))
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "tests"))
from bitflip_runs import files_of, flip, run_all
from seed_models import Regression

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAVE_S3 = all(importlib.util.find_spec(p) is not None for p in ("moto", "s3fs", "boto3"))
STRATEGIES = ["ddp", "fsdp", "fsdp_tp"] + (["deepspeed_stage_3"] if HAVE_DEEPSPEED else [])
TRIALS = 20
CASES = [
    f"{s}/{fmt}/{place}"
    for s in STRATEGIES
    for fmt in ("full", "sharded")
    for place in ("local", "s3")
    if not (s == "ddp" and fmt == "sharded")  # ddp writes full checkpoints only
    and not (place == "s3" and (not HAVE_S3 or (s.startswith("deepspeed") and fmt == "sharded")))
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("bitflips")
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2, timeout=800)
    if not HAVE_S3:
        yield engine.launch(run_all, str(workdir), None, STRATEGIES)
        return
    from s3_server import S3Server

    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    with S3Server() as server:
        server.create_bucket("flips")
        os.environ.update(server.env())  # the workers inherit it
        try:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            yield engine.launch(run_all, str(workdir), "s3://flips/runs", STRATEGIES)
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _load(path: str) -> None:
    """The model and its optimizer's state, so that every shard file is read (on S3 a rank's files are split by
    DCP's four writer threads, some holding only optimizer state)."""
    import torch

    model = Regression()
    model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # its state exists, so the load reads the saved one
    sg.Engine(strategy="single_device", accelerator="cpu").load(
        path, {"model": model, "optimizer": optimizer}
    )


@pytest.mark.parametrize("case", CASES)
def test_a_flipped_bit_is_detected_every_time(runs: dict[str, Any], case: str) -> None:
    from stratagem.checkpoint._verify import verify

    run = runs[case]
    assert "error" not in run, run["error"]
    checkpoint = run["newest"]
    assert verify(checkpoint).passed and verify(checkpoint).checksummed
    files = files_of(checkpoint)
    loadable = not (
        case.startswith("deepspeed") and "/sharded/" in case
    )  # DeepSpeed's own layout: verify only
    import random

    for seed in range(TRIALS):
        target = files[random.Random(seed).randrange(len(files))]
        original, bit = flip(target, seed)
        print(f"{case}: seed {seed}: bit {bit} of {target}")
        try:
            report = verify(checkpoint)
            failure = report.first_failure()
            assert failure is not None, (seed, target, bit)
            assert target.endswith(failure.name), (seed, target, failure)
            if loadable:
                with pytest.raises(CheckpointError) as caught:
                    _load(checkpoint)
                name = target.rsplit("/", 1)[-1]
                assert name in str(caught.value), (seed, target, str(caught.value))
        finally:
            from stratagem.checkpoint import _store

            if "://" in target:
                _store.write_bytes(target, original)
            else:
                Path(target).write_bytes(original)
    assert verify(checkpoint).passed


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_last_skips_the_corrupted_checkpoint_and_resumes_bit_identically(
    runs: dict[str, Any], strategy: str
) -> None:
    resume = runs[f"{strategy}/resume"]
    assert "error" not in resume, resume["error"]
    print(f"{strategy}: seed {resume['seed']}: bit {resume['bit']} of {resume['file']}")
    fmt = "full" if strategy == "ddp" else "sharded"
    assert resume["resumed_from"] == runs[f"{strategy}/{fmt}/local"]["previous"], resume
    assert resume["identical"], resume

"""One flipped bit anywhere in a checkpoint is detected (issue 41): under ddp, fsdp, fsdp_tp and
deepspeed_stage_3, full and sharded, on the local disk and on S3 (moto on 127.0.0.1).

One launch (bitflip_runs.run_all) writes every checkpoint and checks, once per strategy, that
``ckpt_path="last"`` skips a corrupted newest checkpoint and resumes from the previous one, ending bit-identical
to the run never interrupted. Then, in this process, one flipped bit (at a seeded offset, printed) in every region
of every file of each checkpoint (bitflip_runs.regions: a full file's zip header, each entry's data, its central
directory and end record, each field of the trailer; a manifest and its recorded checksums; every DCP shard,
``.metadata`` and ``state.pt``): ``stratagem checkpoint verify``'s function and ``Engine.load`` (single_device,
which reads every file of the full and DCP checkpoints: resharding 2 -> 1) must both refuse it naming the file,
then the bit is restored. On S3 a full file's regions are those a load reads by different paths (one entry's
data and the trailer's three fields) for ddp, one entry's data for the other strategies (rank 0 writes every
strategy's full file by the same code): where in a file the bit is, is proven on the local copies, which are read
by the same checksum code; on S3, DCP's four shard files per rank are each verified, and a load must refuse one
of each rank's (a load takes about a second there). Then the acceptance's 20 trials per checkpoint, each a bit
at a random offset of a random file (seed printed), verified and loaded likewise (on S3 the first 5 loaded).
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
from bitflip_runs import files_of, flip, read, regions, run_all, write
from seed_models import Regression

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAVE_S3 = all(importlib.util.find_spec(p) is not None for p in ("moto", "s3fs", "boto3"))
STRATEGIES = ["ddp", "fsdp", "fsdp_tp"] + (["deepspeed_stage_3"] if HAVE_DEEPSPEED else [])
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
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2, timeout=500)
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

    model = Regression(width=16)
    model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # its state exists, so the load reads the saved one
    sg.Engine(strategy="single_device", accelerator="cpu").load(
        path, {"model": model, "optimizer": optimizer}
    )


def _loaded_on_s3(trials: list[tuple[str, str, Any]]) -> set[str]:
    """The files of a sharded S3 checkpoint whose flipped bit a load must refuse too (every one is verified):
    the manifest, ``.metadata``, ``state.pt``, and one of the four shard files of each rank (another writer
    thread's for each). Each S3 load takes about a second; a local load reads every shard file of its plan."""
    files = sorted({t for t, _, _ in trials})
    shards = [f for f in files if f.endswith(".distcp")]
    ranks = sorted({f.rsplit("/", 1)[-1].split("_")[2] for f in shards})
    chosen = set()
    for i, rank in enumerate(ranks):
        own = [f for f in shards if f.rsplit("/", 1)[-1].startswith(f"__{rank}_")]
        chosen.add(own[(i * 3 + 1) % len(own)])
    return {f for f in files if not f.endswith(".distcp")} | chosen


@pytest.mark.parametrize("case", CASES)
def test_a_flipped_bit_is_detected_in_every_region(runs: dict[str, Any], case: str) -> None:
    from stratagem.checkpoint._verify import verify

    print(f"seconds per strategy in the launch: {runs['seconds']}")
    run = runs[case]
    assert "error" not in run, run["error"]
    checkpoint = run["newest"]
    assert verify(checkpoint).passed and verify(checkpoint).checksummed
    loadable = not (
        case.startswith("deepspeed") and "/sharded/" in case
    )  # DeepSpeed's own layout: verify only
    trials = []
    for target in files_of(checkpoint):
        named = regions(target, read(target))
        if case.endswith("/s3") and target.endswith(".ckpt"):
            kept = [n for n in named if n.startswith("trailer") or n.endswith("/data.pkl")]
            if not case.startswith("ddp/"):  # every strategy's full file is written and read by the same code
                kept = []
            named = {n: named[n] for n in (*kept, next(n for n in named if "/data/" in n))}
        trials += [(target, label, span) for label, span in named.items()]
    assert len(trials) >= (1 if case.endswith("/s3") or "/sharded/" in case else 12), trials
    loaded = _loaded_on_s3(trials) if case.endswith("/sharded/s3") else {t for t, _, _ in trials}
    for seed, (target, label, span) in enumerate(trials):
        original, bit = flip(target, seed, span)
        print(f"{case}: seed {seed}: bit {bit} ({label}) of {target}")
        refused(checkpoint, target, original, loadable and target in loaded, (seed, target, label, bit))
    assert verify(checkpoint).passed


def refused(checkpoint: str, target: str, original: bytes, load: bool, trial: tuple[Any, ...]) -> None:
    """The flipped ``target`` is refused by ``verify`` and, with ``load``, by a load, each naming it; then its
    ``original`` bytes are written back."""
    from stratagem.checkpoint._verify import verify

    try:
        failure = verify(checkpoint).first_failure()
        assert failure is not None, trial
        assert target.endswith(failure.name), (*trial, failure)
        if load:
            with pytest.raises(CheckpointError) as caught:
                _load(checkpoint)
            name = target.rsplit("/", 1)[-1]
            assert name in str(caught.value), (*trial, str(caught.value))
    finally:
        write(target, original)


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


TRIALS = 20
#: On S3 (moto, 1 to 3 s a load) the first this many trials are loaded too; every one is verified. The load's
#: checks are the same code on either side of fsspec, and all 20 are loaded on the local copies.
S3_LOADS = 5


@pytest.mark.parametrize("case", CASES)
def test_twenty_random_flips_are_detected_on_load(runs: dict[str, Any], case: str) -> None:
    """The acceptance's trials: 20 per checkpoint, each a bit flipped at a random offset of a random file (seed
    printed), refused by ``verify`` and by a load at world size 1 (on S3 the first :data:`S3_LOADS`), naming the
    file; then restored. They fall mostly in tensor data, where the per-region cases above place one each."""
    import random

    from stratagem.checkpoint._verify import verify

    run = runs[case]
    assert "error" not in run, run["error"]
    checkpoint = run["newest"]
    loadable = not (case.startswith("deepspeed") and "/sharded/" in case)
    files = files_of(checkpoint)
    for seed in range(TRIALS):
        target = random.Random(f"file {seed}").choice(files)  # apart from the offset's draw
        original, bit = flip(target, seed)
        print(f"{case}: random trial {seed}: bit {bit} of {target}")
        load = loadable and (seed < S3_LOADS or not case.endswith("/s3"))
        refused(checkpoint, target, original, load, (seed, target, bit))
    assert verify(checkpoint).passed

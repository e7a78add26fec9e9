"""Where the time of an ``init_weights`` load goes: each phase's wall and CPU seconds on every rank, under ``fsdp``.

The same Llama as ``hf_io.py`` (``--megabytes``, saved in 200 MB files), loaded ``--repeats`` times after a warm-up
at ``--processes``; the medians per rank of: building it on the meta device (the user's code, ``transformers``),
checking the names against the files, ``fully_shard``, allocating the shards (``to_empty``), the strategy's
``weight_shards``, reading (``read_runs``: the copies from the files) and the whole ``Engine.setup``. The phases
are timed by wrapping the functions that do them, so the table needs no change to the code it measures. CPU
seconds are the rank's own (``thread_time``): what contention for the cores does not change.

    python benchmarks/hf_load_phases.py [--megabytes 600] [--repeats 4] [--processes 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import table
from hf_io import save_random_llama

PHASES = {
    "check the names": ("stratagem.checkpoint._hf_load", "Loader", "__init__"),
    "fully_shard": ("stratagem_fsdp.strategy", "FSDPStrategy", "_shard"),
    "allocate (to_empty)": ("stratagem_fsdp._init", None, "materialize_sharded"),
    "weight_shards": ("stratagem.checkpoint._hf_shards", None, "in_place_shards"),
    "read (read_runs)": ("stratagem.checkpoint._hf_source", "Source", "read_runs"),
}


def _wrap(times: dict[str, list[float]], name: str, module: str, owner: str | None, attribute: str) -> None:
    import importlib

    target: Any = importlib.import_module(module)
    if owner is not None:
        target = getattr(target, owner)
    original = getattr(target, attribute)
    function = getattr(original, "__func__", original)

    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent = times.setdefault(name, [0.0, 0.0])
            spent[0] += time.perf_counter() - wall
            spent[1] += time.thread_time() - cpu

    setattr(target, attribute, timed)


def work(engine: Any, folder: str, repeats: int) -> list[Any]:
    import torch.distributed as dist
    from transformers import AutoConfig, LlamaForCausalLM

    times: dict[str, list[float]] = {}
    for name, where in PHASES.items():
        _wrap(times, name, *where)
    config = AutoConfig.from_pretrained(folder)
    rows = []
    for repeat in range(repeats + 1):  # the first is a warm-up
        times.clear()
        engine.barrier("phases")
        wall, cpu = time.perf_counter(), time.thread_time()
        with engine.init_module(empty_init=True):
            model = LlamaForCausalLM(config)
        times["build on meta (user code)"] = [time.perf_counter() - wall, time.thread_time() - cpu]
        engine.setup(model, init_weights=folder)
        times["whole load (build + setup)"] = [time.perf_counter() - wall, time.thread_time() - cpu]
        if repeat:
            rows.append({k: list(v) for k, v in times.items()})
        del model
        gc.collect()  # FSDP's reference cycles: the model is freed here, and the next load reuses its memory
    every: list[Any] = [None] * engine.world_size
    dist.all_gather_object(every, rows)
    return every


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--megabytes", type=int, default=600)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--processes", type=int, default=4)
    args = p.parse_args()

    import stratagem as sg

    with tempfile.TemporaryDirectory(prefix="hf-phases-", dir=os.environ.get("BENCH_DIR")) as tmp:
        save_random_llama(args.megabytes, Path(tmp) / "hf")
        engine = sg.Engine(strategy="fsdp", accelerator="cpu", devices=args.processes)
        ranks = engine.launch(work, str(Path(tmp) / "hf"), args.repeats)
    names = ["build on meta (user code)", *PHASES, "whole load (build + setup)"]
    rows = []
    for name in names:
        wall = [statistics.median(r[name][0] for r in rank) for rank in ranks]
        cpu = [statistics.median(r[name][1] for r in rank) for rank in ranks]
        rows.append([name, " ".join(f"{w:.3f}" for w in wall), " ".join(f"{c:.3f}" for c in cpu)])
    print(
        f"fsdp at {args.processes} processes, {args.repeats} loads after a warm-up; seconds per rank (median)"
    )
    print(table(rows, ["phase", "wall, rank 0 1 ...", "CPU, rank 0 1 ..."]))
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()

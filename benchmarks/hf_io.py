"""Hugging Face weights in and out, against the ``safetensors`` package reading and writing the same tensors in one
process, measured in the same run, order alternated, medians with the interquartile range of paired ratios.

A Llama of at least ``--megabytes`` (float32; default 600 MB), saved with ``save_pretrained`` in 200 MB files:

- **load**: ``engine.setup(model, init_weights=DIR)`` of a model built on the meta device, under ``fsdp`` at
  ``--processes`` (checking the names, sharding, allocating and reading each rank's quarter), to the last rank
  done; against ``safetensors.torch.load_file`` of every file in one process, each tensor copied into the
  process's memory (``load_file`` maps the file; the copy is the read), the other ranks waiting. Goal: at most
  1.2x the direct read's time per byte (the same bytes, so the ratio of the times).
- **export (live)**: ``save_weights`` of the loaded fsdp model (every rank writing its parts in place, published
  with an fsync); against ``safetensors.torch.save_file`` of the same tensors, split into files as ours are, plus
  an fsync of each file (what a durable write costs; without it, also shown). Goal: at most 1.3x.
- **export (offline)**: ``export_checkpoint`` of a sharded checkpoint of that model, in one process; against
  reading the same checkpoint with ``torch.distributed.checkpoint`` into whole tensors and ``save_file``.

The loaded bytes each rank counted are printed too, and the CPU seconds of the load and the live export against
the direct ones, all processes together: what contention for the cores cannot change (the processes outnumber
the cores of a small machine).

    python benchmarks/hf_io.py [--megabytes 600] [--repeats 5] [--processes 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import table


def llama_config(megabytes: int) -> Any:
    from transformers import LlamaConfig

    # 131 MB of embedding and head, 51.4 MB per layer (float32)
    layers = max(1, math.ceil((megabytes - 131) / 51.4))
    return LlamaConfig(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )


def save_random_llama(megabytes: int, folder: Path) -> tuple[int, int]:
    """A Llama of about ``megabytes`` (float32) with random weights, saved to ``folder`` in safetensors files of
    at most 200 MB; returns its bytes and its largest tensor's."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(megabytes))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.save_pretrained(folder, max_shard_size="200MB")
    sizes = [p.numel() * 4 for p in model.parameters()]
    return sum(sizes), max(sizes)


def _fsync_tree(directory: Path) -> None:
    for file in directory.iterdir():
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


#: This rank's CPU seconds of each timed call, by name (appended by ``_timed``).
CPU: dict[str, list[float]] = {}


def _timed(engine: Any, function: Any, name: str | None = None) -> float:
    """Seconds from every rank starting to the last rank done; this rank's CPU seconds kept under ``name``."""
    engine.barrier("hf-io")
    start, cpu = time.perf_counter(), time.process_time()
    function()
    used = time.process_time() - cpu
    engine.barrier("hf-io")
    if name is not None:
        CPU.setdefault(name, []).append(used)
    return time.perf_counter() - start


# -------------------------------------------------------------------------------------------------
# in the workers
# -------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import safetensors.torch as st
    import torch.distributed as dist
    from transformers import AutoConfig, LlamaForCausalLM

    import stratagem as sg
    from stratagem.checkpoint.hf import save_weights

    engine = sg.Engine(strategy="fsdp", accelerator="cpu", devices=args.processes)
    engine.setup_environment()
    hf, out = Path(args.hf), Path(args.out)
    files = sorted(hf.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(hf)
    state: dict[str, Any] = {
        "loaded": {},
        "model": None,
        "reads": [],
        "reading": [],
        "writing": [],
        "publishing": [],
    }

    def raw_load() -> None:
        # load_file maps the file: the copy into the process's memory is the read (what init_weights does).
        if engine.rank == 0:
            for file in files:
                state["loaded"].update({k: v.clone() for k, v in st.load_file(file).items()})

    def ours_load() -> None:
        with engine.init_module(empty_init=True):
            fresh = LlamaForCausalLM(config)
        state["model"] = engine.setup(fresh, init_weights=str(hf))
        report = fresh.__dict__["_stratagem_hf_report"]
        state["reads"].append(report["bytes_read"])
        state["reading"].append(report["seconds"])

    def raw_export(sync: bool = True) -> None:
        if engine.rank != 0:
            return
        target = out / "raw"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, file in json.loads((out / "ours" / "model.safetensors.index.json").read_text())[
            "weight_map"
        ].items():
            groups.setdefault(file, {})[name] = state["loaded"][name]
        for file, tensors in groups.items():  # the same files as ours
            st.save_file(tensors, str(target / file), metadata={"format": "pt"})
        if sync:
            _fsync_tree(target)

    def ours_export() -> None:
        report = save_weights(engine, state["model"], out / "ours", max_shard_size="200MB", overwrite=True)
        state["writing"].append(report["seconds_writing"])
        state["publishing"].append(report["seconds_publishing"])

    # Warm-up: first touches of the files and the allocator; the export's files are the plan raw writes copy.
    for function in (raw_load, ours_load, ours_export, raw_export):
        _timed(engine, function)
    times: dict[str, list[float]] = {
        k: [] for k in ("load", "load_raw", "export", "export_raw", "export_raw_nosync")
    }
    for repeat in range(args.repeats):
        state["loaded"], state["model"] = {}, None
        # FSDP's modules hold reference cycles: the previous model is freed by the collector, not when dropped.
        # Collected here, outside the timing, so that each load reuses freed memory as the direct read does.
        gc.collect()
        for name, function in [("load_raw", raw_load), ("load", ours_load)][:: 1 if repeat % 2 == 0 else -1]:
            times[name].append(_timed(engine, function, name))
        for name, function in [("export_raw", raw_export), ("export", ours_export)][
            :: 1 if repeat % 2 == 0 else -1
        ]:
            times[name].append(_timed(engine, function, name))
        times["export_raw_nosync"].append(_timed(engine, lambda: raw_export(sync=False)))
    engine.save(out / "ckpt", {"model": state["model"]}, format="sharded")
    reads: list[Any] = [None] * engine.world_size
    dist.all_gather_object(reads, state["reads"][-1])
    cpus: list[Any] = [None] * engine.world_size
    dist.all_gather_object(cpus, CPU)
    if engine.rank == 0:
        split = {k: state[k][-args.repeats :] for k in ("reading", "writing", "publishing")}
        # CPU seconds of each repeat, all ranks together (the other ranks wait in a barrier during the direct runs)
        cpu = {k: [sum(c[k][i] for c in cpus) for i in range(args.repeats)] for k in CPU}
        (out / "times.json").write_text(json.dumps({"times": times, "reads": reads, "cpu": cpu, **split}))
    engine.teardown()


# -------------------------------------------------------------------------------------------------
# in the launching process
# -------------------------------------------------------------------------------------------------


def _ratio(ours: list[float], raw: list[float]) -> str:
    ratios = [o / r for o, r in zip(ours, raw)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return f"{statistics.median(ratios):.2f}x (IQR {q1:.2f}-{q3:.2f})"


def _spread(values: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f"{statistics.median(values):.2f} s ({q1:.2f}-{q3:.2f})"


def offline(work: Path, repeats: int) -> tuple[list[float], list[float]]:
    """``export_checkpoint`` of the sharded checkpoint, against DCP's read of it into whole tensors + save_file."""
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    from stratagem.checkpoint import _dcp
    from stratagem.checkpoint.hf import export_checkpoint

    ckpt = work / "out" / "ckpt"
    meta = _dcp.read_metadata(ckpt)
    ours, raw = [], []
    for repeat in range(repeats):

        def run_ours() -> None:
            export_checkpoint(ckpt, work / "offline", max_shard_size="200MB", overwrite=True)

        def run_raw() -> None:
            flat = {
                k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                for k, v in meta.state_dict_metadata.items()
            }
            dcp.load(flat, storage_reader=_dcp.safe_reader(ckpt), no_dist=True)
            target = work / "offline-raw"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            st.save_file(
                {k.removeprefix("model.model."): v for k, v in flat.items()},
                str(target / "model.safetensors"),
            )
            _fsync_tree(target)

        for function in (run_ours, run_raw) if repeat % 2 == 0 else (run_raw, run_ours):
            start = time.perf_counter()
            function()
            (ours if function is run_ours else raw).append(time.perf_counter() - start)
    return ours, raw


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--megabytes", type=int, default=600)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    with tempfile.TemporaryDirectory(prefix="hf-io-", dir=os.environ.get("BENCH_DIR")) as tmp:
        work = Path(tmp)
        total, largest = save_random_llama(args.megabytes, work / "hf")
        (work / "out").mkdir()
        command = [
            sys.executable,
            "-m",
            "stratagem",
            "run",
            "--devices",
            str(args.processes),
            __file__,
            "--worker",
        ]
        command += ["--hf", str(work / "hf"), "--out", str(work / "out"), "--repeats", str(args.repeats)]
        command += ["--processes", str(args.processes)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        result = json.loads((work / "out" / "times.json").read_text())
        t = result["times"]
        ours_off, raw_off = offline(work, args.repeats)
    print(
        f"model: {total / 1e6:.0f} MB float32 ({total / 2**20:.0f} MiB), largest tensor {largest / 2**20:.1f} MiB; "
        f"fsdp at {args.processes} processes; {args.repeats} pairs, order alternated"
    )
    rows = [
        [
            "load (init_weights)",
            _spread(t["load"]),
            "load_file, 1 process",
            _spread(t["load_raw"]),
            _ratio(t["load"], t["load_raw"]),
            "<= 1.2x",
        ],
        [
            "export (save_weights)",
            _spread(t["export"]),
            "save_file + fsync",
            _spread(t["export_raw"]),
            _ratio(t["export"], t["export_raw"]),
            "<= 1.3x",
        ],
        [
            "",
            "",
            "save_file, no fsync",
            _spread(t["export_raw_nosync"]),
            _ratio(t["export"], t["export_raw_nosync"]),
            "",
        ],
        [
            "export (offline, 1 process)",
            _spread(ours_off),
            "DCP read + save_file + fsync",
            _spread(raw_off),
            _ratio(ours_off, raw_off),
            "<= 1.3x",
        ],
    ]
    print(table(rows, ["stratagem", "median (IQR)", "direct", "median (IQR)", "ratio (paired)", "goal"]))
    cpu = result["cpu"]
    print(
        f"CPU seconds, all {args.processes} processes together: load {_spread(cpu['load'])} against the direct read's "
        f"{_spread(cpu['load_raw'])}, {_ratio(cpu['load'], cpu['load_raw'])}; live export {_spread(cpu['export'])} "
        f"against {_spread(cpu['export_raw'])}, {_ratio(cpu['export'], cpu['export_raw'])} (on C free cores, a load "
        "cannot take less than its CPU seconds / C)"
    )
    per_rank = result["reads"]
    print(
        f"of the load, rank 0 initialising and reading (after the check and the sharding): {_spread(result['reading'])}"
    )
    print(
        f"of the live export, rank 0 planning and writing its parts: {_spread(result['writing'])}; publishing "
        f"(index, config, fsync of every file, rename): {_spread(result['publishing'])}"
    )
    print(
        f"bytes each rank read per load: {', '.join(f'{r / 2**20:.1f} MiB' for r in per_rank)} "
        f"(1/{args.processes} of the model is {total / args.processes / 2**20:.1f} MiB; + the largest tensor "
        f"{(total / args.processes + largest) / 2**20:.1f} MiB)"
    )
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()

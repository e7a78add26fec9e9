"""Checkpoint I/O against raw PyTorch, measured in the same run.

1. Full save (``Engine.save(format="full")``) against ``torch.save`` of the same state dicts, with and without
   an fsync of the raw file (ours always fsyncs: that is part of its atomicity).
2. Sharded save on 2 ranks against a full save of the same model on the same 2 ranks.
3. ``stratagem checkpoint consolidate``: peak memory against the checkpoint's size.

    /work/venv/bin/python benchmarks/checkpoint_io.py [--megabytes 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "tests"))
import ckpt_workers as W
from _common import median, table

import stratagem as sg


class Big(torch.nn.Module):
    def __init__(self, megabytes: int, layers: int = 16) -> None:
        super().__init__()
        width = int((megabytes * 2**20 / 4 / layers) ** 0.5)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _trained(megabytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Big(megabytes)
    optimizer = torch.optim.AdamW(model.parameters())
    width = model.layers[0].in_features
    model.layers(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def full_vs_raw(megabytes: int, repeats: int, directory: Path) -> list[list[object]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model, optimizer = _trained(megabytes)
    state = {"model": model, "optimizer": optimizer, "step": 1}
    times: dict[str, list[float]] = {"raw": [], "raw+fsync": [], "stratagem": []}
    size = 0
    for _ in range(repeats + 1):  # the first round warms the page cache and allocator
        round_times = {}
        start = time.perf_counter()
        raw = {
            "model": {"model": get_model_state_dict(model)},
            "optimizers": {"optimizer": get_optimizer_state_dict(model, optimizer)},
            "state": {"step": 1},
        }
        torch.save(raw, directory / "raw.pt")
        round_times["raw"] = time.perf_counter() - start
        _fsync(directory / "raw.pt")
        round_times["raw+fsync"] = time.perf_counter() - start
        start = time.perf_counter()
        engine.save(directory / "ours.pt", state, format="full")
        round_times["stratagem"] = time.perf_counter() - start
        size = (directory / "ours.pt").stat().st_size
        for key, value in round_times.items():
            times[key].append(value)
    rows = []
    raw, synced = median(times["raw"][1:]), median(times["raw+fsync"][1:])
    for key in times:
        t = median(times[key][1:])
        rows.append(
            [
                f"full save: {key}",
                f"{size / 2**20:.0f} MiB",
                f"{t * 1000:.0f} ms",
                f"{t / raw:.2f}x",
                f"{t / synced:.2f}x",
            ]
        )
    return rows


def _sharded_worker(engine: sg.Engine, directory: str, megabytes: int, repeats: int) -> dict[str, float]:
    model, optimizer = _trained(megabytes)
    state = {"model": model, "optimizer": optimizer, "step": 1}
    times: dict[str, list[float]] = {"full": [], "sharded": []}
    for _ in range(repeats + 1):
        for fmt in ("full", "sharded"):
            engine.barrier()
            start = time.perf_counter()
            engine.save(Path(directory) / f"two-{fmt}", state, format=fmt)
            engine.barrier()
            times[fmt].append(time.perf_counter() - start)
    return {fmt: median(values[1:]) for fmt, values in times.items()}


def sharded_vs_full(megabytes: int, repeats: int, directory: Path) -> list[list[object]]:
    engine = sg.Engine(strategy=W.ShardingTestStrategy(), accelerator="cpu", devices=2, timeout=300)
    result = engine.launch(_sharded_worker, str(directory), megabytes, repeats)
    full = result["full"]
    return [
        [f"2 ranks: {fmt} save", "", f"{t * 1000:.0f} ms", f"{t / full:.2f}x vs full", ""]
        for fmt, t in result.items()
    ]


def _peak(pid: int, stop: threading.Event, peaks: dict[str, int]) -> None:
    while not stop.is_set():
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                peaks[key] = max(peaks.get(key, 0), int(value.split()[0]) * 1024)
        time.sleep(0.002)


def consolidation_memory(megabytes: int, directory: Path) -> list[list[object]]:
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model, optimizer = _trained(megabytes)
    source = directory / "sharded"
    engine.save(source, {"model": model, "optimizer": optimizer, "step": 1}, format="sharded")
    del model, optimizer
    size = sum(f.stat().st_size for f in source.rglob("*") if f.is_file())
    largest = max(f.stat().st_size for f in source.rglob("*.distcp"))
    exe = Path(sys.executable).with_name("stratagem")
    rows = []
    for label, argv in (
        (
            "python -c 'import torch, stratagem' (baseline)",
            [sys.executable, "-c", "import torch, stratagem.cli;import time; time.sleep(0.5)"],
        ),
        (
            "stratagem checkpoint consolidate",
            [str(exe), "checkpoint", "consolidate", str(source), str(directory / "consolidated.pt")],
        ),
    ):
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        peaks: dict[str, int] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_peak, args=(process.pid, stop, peaks))
        watcher.start()
        process.wait()
        stop.set()
        watcher.join()
        rows.append(
            [
                label,
                f"{size / 2**20:.0f} MiB ckpt",
                f"peak RSS {peaks.get('VmRSS', 0) / 2**20:.0f} MiB",
                f"peak anon {peaks.get('RssAnon', 0) / 2**20:.0f} MiB",
                f"peak file-backed {(peaks.get('RssFile', 0) + peaks.get('RssShmem', 0)) / 2**20:.0f} MiB",
            ]
        )
    rows.append(
        [
            "(largest tensor)",
            "",
            f"{megabytes / 16:.0f} MiB",
            f"largest shard file {largest / 2**20:.0f} MiB",
            "",
        ]
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, default=64, help="model size; AdamW adds twice that")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        directory = Path(tmp)
        rows = full_vs_raw(args.megabytes, args.repeats, directory)
        print(table(rows, ["what", "size", "median", "vs raw torch.save", "vs raw + fsync"]))
        print()
        print(
            table(
                sharded_vs_full(args.megabytes, args.repeats, directory), ["what", "", "median", "ratio", ""]
            )
        )
        print()
        print(table(consolidation_memory(args.megabytes, directory), ["what", "size", "RSS", "anon", "file"]))


if __name__ == "__main__":
    main()

"""Checkpoint I/O against raw PyTorch, measured in the same run.

1. Full save (``Engine.save(format="full")``) against ``torch.save`` of the same state dicts, with and without
   an fsync of the raw file (ours always fsyncs: that is part of its atomicity).
2. Sharded save on 2 ranks against a full save of the same model on the same 2 ranks.
3. ``stratagem checkpoint consolidate``: peak memory against the checkpoint's size.
4. Asynchronous against blocking saves (``Engine.save(..., blocking=False)``), as the training stall: the wall
   time of the steps around a save minus that of as many steps without one, same state, order alternated.
   Goal: the async stall is at most 20% of the blocking save's.
5. Object store (S3 API, moto's server on 127.0.0.1): full and sharded save and load against raw ``s3fs``
   ``pipe``/``cat`` of the same bytes (serialised with ``torch.save`` for the raw full save). Goal: <= 1.2x.

    python benchmarks/checkpoint_io.py [--megabytes 64] [--repeats 5] [--only async,s3]
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


def _spread(values: list[float]) -> str:
    """Median and interquartile range, in ms."""
    import statistics

    if len(values) < 2:
        return f"{values[0] * 1000:.0f} ms"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{median(values) * 1000:.0f} ms (IQR {q1 * 1000:.0f}-{q3 * 1000:.0f})"


def async_stall(megabytes: int, repeats: int, directory: Path | str, where: str = "") -> list[list[object]]:
    """Stall of a training loop around a save, blocking against ``blocking=False``, per format."""
    torch.set_num_threads(1)
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model, optimizer = _trained(megabytes)
    width = model.layers[0].in_features
    x = torch.randn(64, width)

    def step() -> None:
        model.layers(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            step()
        return time.perf_counter() - start

    window = 15
    rows = []
    for fmt in ("full", "sharded"):
        target = f"{directory}/stall-{fmt}" if isinstance(directory, str) else directory / f"stall-{fmt}"
        stalls: dict[str, list[float]] = {"blocking": [], "async": []}
        save_times: list[float] = []
        steps_during: list[int] = []
        for repeat in range(repeats + 1):
            order = ("blocking", "async") if repeat % 2 == 0 else ("async", "blocking")
            for mode in order:
                baseline = steps(window)
                state = {"model": model, "optimizer": optimizer, "step": repeat}
                start = time.perf_counter()
                engine.save(target, state, format=fmt, blocking=mode == "blocking")
                saved = time.perf_counter() - start
                done_after = None
                for i in range(window):
                    step()
                    if done_after is None and not engine.checkpoint_in_flight():
                        done_after = i + 1
                engine.wait_for_checkpoint()
                total = time.perf_counter() - start
                if repeat == 0:
                    continue  # warm-up round
                stalls[mode].append(total - baseline)
                if mode == "blocking":
                    save_times.append(saved)
                else:
                    steps_during.append(done_after if done_after is not None else window)
        blocking_save = median(save_times)
        for mode, values in stalls.items():
            extra = f"{median(values) / blocking_save:.2f}x of the blocking save"
            if mode == "async":
                extra += f"; save done after a median {median(steps_during):.0f} of {window} steps"
            rows.append([f"{where}{fmt} save, {mode}: training stall", _spread(values), extra])
        rows.append([f"{where}{fmt} save, blocking: save call alone", _spread(save_times), ""])
    return rows


def s3_throughput(megabytes: int, repeats: int) -> tuple[list[list[object]], list[list[object]]]:
    """Engine.save/load at s3:// against raw s3fs pipe/cat of the same bytes, on a local S3 API server."""
    import io

    from s3_server import S3Server

    rows = []
    with S3Server() as server:
        server.create_bucket("bench")
        os.environ.update(server.env())
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        engine = sg.Engine(strategy="single_device", accelerator="cpu")
        model, optimizer = _trained(megabytes)
        probe, probe_opt = _trained(megabytes)
        state = {"model": model, "optimizer": optimizer, "step": 1}
        engine.save("s3://bench/warm.pt", state, format="full")
        times: dict[str, list[float]] = {}

        def timed(key: str, fn: object) -> None:
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            times.setdefault(key, []).append(time.perf_counter() - start)

        size = {}
        for repeat in range(repeats):
            ours_first = repeat % 2 == 0
            # full: one object
            raw_payload = {
                "model": {"model": model.state_dict()},
                "optimizers": {"optimizer": optimizer.state_dict()},
            }

            def raw_full_save(raw_payload: dict = raw_payload) -> None:
                buffer = io.BytesIO()
                torch.save(raw_payload, buffer)
                fs.pipe_file("bench/raw.pt", buffer.getvalue())

            def ours_full_save() -> None:
                engine.save("s3://bench/ours.pt", state, format="full")

            def raw_full_load() -> None:
                torch.load(io.BytesIO(fs.cat_file("bench/raw.pt")), weights_only=True)

            def ours_full_load() -> None:
                engine.load("s3://bench/ours.pt", {"model": probe, "optimizer": probe_opt})

            pairs = [
                ("full save", ours_full_save, raw_full_save),
                ("full load", ours_full_load, raw_full_load),
            ]
            for what, ours, raw in pairs:
                for name, fn in (
                    (("stratagem", ours), ("raw s3fs", raw))
                    if ours_first
                    else (("raw s3fs", raw), ("stratagem", ours))
                ):
                    timed(f"{what}|{name}", fn)
            size["full"] = fs.size("bench/ours.pt")

            # sharded: the same objects as the checkpoint's, put and got raw
            timed(
                "sharded save|stratagem",
                lambda: engine.save("s3://bench/ours-sharded", state, format="sharded"),
            )
            fs.invalidate_cache()
            manifest = fs.cat_file("bench/ours-sharded/stratagem.json")
            data = "bench/ours-sharded/" + __import__("json").loads(manifest)["data"]
            files = {p: fs.cat_file(p) for p in fs.find(data)}
            size["sharded"] = sum(len(b) for b in files.values()) + len(manifest)
            raw_files = {p.replace("ours-sharded", "raw-sharded"): b for p, b in files.items()}
            timed("sharded save|raw s3fs", lambda raw_files=raw_files: fs.pipe(raw_files))
            pairs = [
                (
                    "sharded load|stratagem",
                    lambda: engine.load("s3://bench/ours-sharded", {"model": probe, "optimizer": probe_opt}),
                ),
                ("sharded load|raw s3fs", lambda raw_files=raw_files: fs.cat(list(raw_files))),
            ]
            for key, fn in pairs if ours_first else pairs[::-1]:
                timed(key, fn)
        stall_rows = async_stall(megabytes, repeats, "s3://bench", where="S3 ")
        for what in ("full save", "full load", "sharded save", "sharded load"):
            ours, raw = times[f"{what}|stratagem"], times[f"{what}|raw s3fs"]
            nbytes = size[what.split()[0]]
            rows.append(
                [
                    f"S3 {what}",
                    f"{nbytes / 2**20:.0f} MiB",
                    _spread(ours),
                    _spread(raw),
                    f"{median(ours) / median(raw):.2f}x",
                    f"{nbytes / 2**20 / median(ours):.0f} MiB/s",
                ]
            )
    return rows, stall_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, default=64, help="model size; AdamW adds twice that")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated: full,sharded,consolidate,async,s3")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        directory = Path(tmp)
        if not only or "async" in only:
            rows = async_stall(args.megabytes, args.repeats, directory)
            print(table(rows, ["what", "median (IQR)", ""]))
            print()
        if not only or "s3" in only:
            header = ["what", "size", "stratagem", "raw s3fs", "ratio", "stratagem throughput"]
            rows, stall_rows = s3_throughput(args.megabytes, args.repeats)
            print(table(rows, header))
            print()
            print(table(stall_rows, ["what", "median (IQR)", ""]))
            print()
        if only and not only & {"full", "sharded", "consolidate"}:
            return
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

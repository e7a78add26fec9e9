"""What checksums cost (issue 41): a save with the CRC32C of every file computed as it is written against the same
save with the summing turned off, and a load that verifies every file against the same load unchecked; for a full
checkpoint in one process and a sharded one of ``fsdp`` on 2 processes, same state, paired runs in alternated order.

Goals: verification adds at most 5% to a load, checksumming at most 3% to a save.

"Off" is the same code with the checksum functions replaced in this process (the bytes written and read are the
same; only the summing and the comparisons are skipped), so the difference is what checksums cost and nothing
else. Each pair's ratio (on / off - 1) is printed as a median with its interquartile range.

    python benchmarks/checkpoint_integrity.py [--megabytes 500] [--repeats 7] [--dir DIR] [--cold]

``--cold`` (root, Linux) empties the kernel's page cache before each load, as a job restarted on another node
(or after the file's pages were evicted) reads its checkpoint: the load then reads the disk, and the verification
pass is the read that brings the file in. Without it a load reads a file just written, from memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import table

import stratagem as sg


class Big(torch.nn.Module):
    def __init__(self, megabytes: int, layers: int = 16) -> None:
        super().__init__()
        width = int((megabytes * 2**20 / 4 / layers) ** 0.5)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    """The same save and load without summing or comparing (this process only)."""
    from stratagem.checkpoint import _checksum, _dcp, _read

    saved = (
        _checksum.extend,
        _checksum.extend_parallel,
        _checksum.full_file_status,
        _dcp.verify_file,
        _dcp._verify_bytes,
        _read._check_state,
        _checksum.Summing.write,
    )
    _checksum.extend = _checksum.extend_parallel = lambda value, data: value
    _checksum.Summing.write = lambda self, data: self.raw.write(data)
    _checksum.full_file_status = lambda location: ("off", "off")
    _dcp.verify_file = _dcp._verify_bytes = _read._check_state = lambda *args: None
    try:
        yield
    finally:
        (
            _checksum.extend,
            _checksum.extend_parallel,
            _checksum.full_file_status,
            _dcp.verify_file,
            _dcp._verify_bytes,
            _read._check_state,
            _checksum.Summing.write,
        ) = saved


def drop_page_cache(engine: sg.Engine) -> None:
    """Write the machine's dirty pages out and empty its page cache (root only), on rank 0, the others waiting."""
    if engine.global_rank == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    engine.barrier()


def _pairs(
    engine: sg.Engine, path: Path, fmt: str, megabytes: int, repeats: int, cold: bool = False
) -> dict[str, list[float]]:
    """Per pair, on/off - 1 for a save and for a load, in wall time and in CPU time (every thread of every
    rank: what the checks cost, which a loaded machine distorts less), first pair a warm-up, dropped."""
    torch.manual_seed(0)
    model, target = Big(megabytes), Big(megabytes)
    if fmt == "sharded":  # each rank's own shards (fsdp): the load reads them straight into the sharded model
        model, target = engine.setup(model), engine.setup(target)
    out: dict[str, list[float]] = {
        k: []
        for k in ("save", "load", "save_s", "load_s", "save_cpu", "load_cpu", "save_cpu_s", "load_cpu_s")
    }
    for i in range(repeats + 1):
        times: dict[tuple[str, bool], float] = {}
        cpu: dict[tuple[str, bool], float] = {}
        for on in (True, False) if i % 2 == 0 else (False, True):
            with contextlib.nullcontext() if on else checks_off():
                engine.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                engine.save(path, {"model": model}, format=fmt)
                cpu["save", on] = time.process_time() - cpu_start
                engine.barrier()
                times["save", on] = time.perf_counter() - start
                if cold:
                    drop_page_cache(engine)
                start, cpu_start = time.perf_counter(), time.process_time()
                engine.load(path, {"model": target})
                cpu["load", on] = time.process_time() - cpu_start
                engine.barrier()
                times["load", on] = time.perf_counter() - start
        keys = sorted(cpu)
        mine = torch.tensor([cpu[k] for k in keys], dtype=torch.float64)
        summed = dict(zip(keys, torch.stack(engine.all_gather(mine)).sum(0).tolist()))
        if i == 0:
            continue
        for op in ("save", "load"):
            out[op].append(times[op, True] / times[op, False] - 1)
            out[f"{op}_s"].append(times[op, False])
            out[f"{op}_cpu"].append(summed[op, True] / summed[op, False] - 1)
            out[f"{op}_cpu_s"].append(summed[op, False])
    return out


def _sharded_worker(
    engine: sg.Engine, directory: str, megabytes: int, repeats: int, cold: bool, parts: int | None
) -> dict[str, list[float]]:
    _set_parts(parts)
    return _pairs(engine, Path(directory) / "two-sharded", "sharded", megabytes, repeats, cold)


def _set_parts(parts: int | None) -> None:
    """How many threads verify one large file (``--parts``; by default as many as the process may run on)."""
    from stratagem.checkpoint import _checksum

    if parts is not None:
        _checksum._parts = lambda: parts


def _spread(ratios: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return f"{statistics.median(ratios) * 100:+.1f}% (IQR {q1 * 100:+.1f} to {q3 * 100:+.1f})"


def _row(name: str, out: dict[str, list[float]], op: str, goal: float) -> list[object]:
    verdicts = ["met" if statistics.median(out[key]) <= goal else "NOT met" for key in (op, f"{op}_cpu")]
    return [
        name,
        f"{statistics.median(out[f'{op}_s']) * 1000:.0f} ms",
        _spread(out[op]),
        f"{statistics.median(out[f'{op}_cpu_s']) * 1000:.0f} ms",
        _spread(out[f"{op}_cpu"]),
        f"<= {goal * 100:.0f}%: {verdicts[0]} / {verdicts[1]}",
    ]


def _summing_cost(file: Path, data: bytes, rounds: int = 9) -> str:
    """Wall and CPU time to write 256 MiB in 32 MiB writes (as torch.save writes a tensor): unsummed, summed a
    write at a time before writing it, summed a piece at a time as it is written (the stream on one core), and
    summed on another core while it is written (the stream on several); rounds alternated, medians."""
    from stratagem.checkpoint import _checksum

    class Whole(_checksum.Summing):
        def write(self, block: Any) -> int:
            self.value = _checksum.extend(self.value, block)
            return self.raw.write(block)

    parts = _checksum._parts
    # name: (the stream around the file, the cores the stream may use; None: as many as the process has)
    kinds: dict[str, tuple[Any, int | None]] = {
        "unsummed": (lambda raw: raw, None),
        "summed whole first": (Whole, None),
        "summed by pieces (one core)": (_checksum.Summing, 1),
        "summed beside the write": (_checksum.Summing, None),
    }
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    blocks = [memoryview(data)[i : i + (32 << 20)] for i in range(0, len(data), 32 << 20)]
    for i in range(rounds):
        for kind in kinds if i % 2 == 0 else reversed(list(kinds)):
            make, cores = kinds[kind]
            _checksum._parts = parts if cores is None else (lambda n=cores: n)
            with open(file, "wb") as raw:
                start, cpu_start, stream = time.perf_counter(), time.process_time(), make(raw)
                for block in blocks:
                    stream.write(block)
                wall[kind].append(time.perf_counter() - start)
                cpu[kind].append(time.process_time() - cpu_start)
    _checksum._parts = parts
    base = {k: statistics.median(v["unsummed"]) for k, v in (("wall", wall), ("cpu", cpu))}
    extra = [
        f"{(statistics.median(wall[k]) - base['wall']) * 1000:+.0f} / "
        f"{(statistics.median(cpu[k]) - base['cpu']) * 1000:+.0f} ms {k}"
        for k in kinds
        if k != "unsummed"
    ]
    return (
        f"writing 256 MiB in 32 MiB writes: {base['wall'] * 1000:.0f} ms wall, {base['cpu'] * 1000:.0f} ms CPU "
        f"unsummed; summing adds (wall / CPU) " + ", ".join(extra) + f" (medians of {rounds})"
    )


def _verify_wall(file: Path, data: bytes, rounds: int = 9) -> str:
    """Wall time to verify a 256 MiB file from the page cache in one part and in as many as the process may
    run on, rounds alternated, medians."""
    from stratagem.checkpoint import _checksum

    file.write_bytes(data)
    parts, spent = _checksum._parts, {1: [], 0: []}
    for i in range(rounds):
        for n in (1, 0) if i % 2 == 0 else (0, 1):
            _checksum._parts = (lambda: 1) if n == 1 else parts
            start = time.perf_counter()
            _checksum.crc_of(file)
            spent[n].append(time.perf_counter() - start)
    _checksum._parts = parts
    one, many = (statistics.median(spent[n]) * 1000 for n in (1, 0))
    return (
        f"verifying 256 MiB from the page cache: {one:.0f} ms in one part, {many:.0f} ms in {parts()} "
        f"(medians of {rounds})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--dir", default=None, help="where the checkpoints go (default: a temporary directory)"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="empty the page cache before each load (root): a load that reads the disk",
    )
    parser.add_argument(
        "--parts",
        type=int,
        default=None,
        help="threads that verify one large file (1: one pass on one core, as before issue 41's second round)",
    )
    parser.add_argument(
        "--sharded",
        default="fsdp",
        help="the strategy of the sharded case (default fsdp: its load reads each rank's shards into the model "
        "and does nothing else, so what verifying costs is not hidden behind other work)",
    )
    args = parser.parse_args()
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(
            f"--dir {args.dir}: no such directory (make it first, or leave --dir out for a temporary one)"
        )
    print(f"uptime at the start: {os.getloadavg()}")
    _set_parts(args.parts)
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("--cold empties the page cache through /proc/sys/vm/drop_caches: run it as root (Linux)")
    from stratagem.checkpoint import _checksum

    data = torch.randn(64 * 2**20).numpy().tobytes()  # 256 MiB
    start = time.perf_counter()
    _checksum.extend(0, data)
    rate = len(data) / (time.perf_counter() - start) / 1e9
    native = "bundled crc32c_extend via ctypes" if _checksum._EXTEND is not None else "Python API (copies)"
    print(
        f"CRC32C on one core: {rate:.1f} GB/s ({native}); a large file verified in {_checksum._parts()} part(s)"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        print(_summing_cost(Path(scratch) / "sums", data))
        print(_verify_wall(Path(scratch) / "sums", data))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        single = sg.Engine(strategy="single_device", accelerator="cpu")
        full = _pairs(single, Path(scratch) / "one.ckpt", "full", args.megabytes, args.repeats, args.cold)
        rows.append(_row(f"full {args.megabytes} MB, 1 process: save", full, "save", 0.03))
        rows.append(_row(f"full {args.megabytes} MB, 1 process: load", full, "load", 0.05))
        engine = sg.Engine(strategy=args.sharded, accelerator="cpu", devices=2, timeout=1200)
        two = engine.launch(_sharded_worker, scratch, args.megabytes, args.repeats, args.cold, args.parts)
        rows.append(_row(f"sharded {args.megabytes} MB, {args.sharded} at 2: save", two, "save", 0.03))
        rows.append(_row(f"sharded {args.megabytes} MB, {args.sharded} at 2: load", two, "load", 0.05))
    header = [
        "case",
        "wall, off",
        "wall: on vs off (median, IQR)",
        "CPU, off",
        "CPU: on vs off",
        "goal: wall / CPU",
    ]
    print(table(rows, header))
    print(f"page cache: {'emptied before each load' if args.cold else 'warm (files just written)'}")
    print(f"uptime: {os.getloadavg()}")


if __name__ == "__main__":
    main()

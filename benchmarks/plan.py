"""`stratagem plan`: its time and resident memory, and its numbers against counts made independently.

    python benchmarks/plan.py scale [--strategies fsdp,...]   # the 1T acceptance: 2048 simulated ranks
    python benchmarks/plan.py growth [--plot growth.png]       # time and memory against model and world size
    python benchmarks/plan.py activations                      # the estimate against torch's tracker on real steps

Each plan runs as its own process (`python -m stratagem plan --json`), timed from start to exit, its peak
resident memory read from the kernel (``os.wait4``: the largest of the plan's process and the children it forks
to simulate ranks meanwhile, one per core; "RSS bound" is that peak times the cores, a bound of their sum).

- ``scale``: benchmarks/configs/llama-1t.json (1.02e12 parameters, 144 layers) at 2048 ranks (256 nodes x 8)
  under fsdp, fsdp_tp (tensor parallel 8) and pp_fsdp_tp (pipeline 16, tensor parallel 8, data parallel 16);
  the largest rank's parameter bytes against a count made here from each tensor's shape and the sharding rule
  (FSDP2 gives ``ceil(dim 0 / shards)`` rows per rank, rank 0 the most; tensor parallel splits the output
  features of colwise layers and the head, the input features of rowwise ones, the embedding's vocabulary:
  Hugging Face Llama's plan; a pipeline stage holds its 9 layers, the first the embedding too, the last the
  final norm and the head).
- ``growth``: Llama-shaped models of 2 layers (hidden size for 1B ... 1T parameters) at 64 ranks, and one model
  at 8 ... 8192 ranks, under fsdp: time and memory should follow the parameters per rank and the modules, not
  the world size.
- ``activations``: the demo's model and a tiny Llama, one step on this process, the plan's activation estimate
  against ``torch.distributed._tools.mem_tracker.MemTracker`` over a real step (also tested in
  core/tests/test_planning.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import python, table

CONFIG = Path(__file__).parent / "configs" / "llama-1t.json"
SCALE = {
    "fsdp": "fsdp",
    "fsdp_tp": "fsdp_tp[tensor_parallel_size=8]",
    "pp_fsdp_tp": "pp_fsdp_tp[pipeline_parallel_size=16,tensor_parallel_size=8]",
}


LAST_CPU_SECONDS = [0.0]
#: A plan simulates ranks in as many processes at once as this process may use cores (stratagem.planning's
#: default ``workers``). The kernel gives the largest one's peak RSS; these many times it bounds their sum.
PROCESSES = len(os.sched_getaffinity(0))


def run_plan(args: list[str]) -> tuple[dict[str, Any], float, int]:
    """``stratagem plan ... --json`` in a process of its own: the plan, seconds, peak resident bytes."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(
            [python(), "-m", "stratagem", "plan", *args, "--json", "--quiet"],
            stdout=out,
            stderr=err,
            text=True,
        )
        _, status, usage = os.wait4(process.pid, 0)  # this child's own peak, which Popen.wait would not give
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if process.returncode:
            raise SystemExit(f"stratagem plan {' '.join(args)} failed:\n{err.read()[-3000:]}")
        # CPU seconds beside the wall clock: on a shared machine the wall clock counts other processes' turns.
        LAST_CPU_SECONDS[0] = usage.ru_utime + usage.ru_stime
        return json.loads(out.read()), seconds, usage.ru_maxrss * 1024


# -------------------------------------------------------------------------------------------------
# counts by hand
# -------------------------------------------------------------------------------------------------


def llama_tensors(
    c: dict[str, Any], layers: range, embed: bool, head: bool
) -> list[tuple[str, tuple[int, int]]]:
    """``(tensor-parallel style, shape)`` of each parameter of the given layers (and embedding, head)."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    per_layer = [
        ("colwise", (h, h)),  # q_proj
        ("colwise", (kv, h)),  # k_proj
        ("colwise", (kv, h)),  # v_proj
        ("rowwise", (h, h)),  # o_proj
        ("colwise", (i, h)),  # gate_proj
        ("colwise", (i, h)),  # up_proj
        ("rowwise", (h, i)),  # down_proj
        ("replicate", (h, 1)),  # input_layernorm
        ("replicate", (h, 1)),  # post_attention_layernorm
    ]
    out = [t for _ in layers for t in per_layer]
    if embed:
        out.append(("colwise", (v, h)))  # embed_tokens, "embedding_rowwise": its rows (the vocabulary) split
    if head:
        out += [("replicate", (h, 1)), ("colwise", (v, h))]  # final norm, lm_head (colwise_gather_output)
    return out


def hand_count(tensors: list[tuple[str, tuple[int, int]]], tp: int, dp: int) -> int:
    """Bytes rank 0 holds: tensor parallel's split (rank 0 gets the ceil), then FSDP2's ceil rows."""
    total = 0
    for style, (rows, cols) in tensors:
        if style == "colwise":
            rows = math.ceil(rows / tp)
        elif style == "rowwise":
            cols = math.ceil(cols / tp)
        total += math.ceil(rows / dp) * cols * 4
    return total


def expected_bytes(name: str, c: dict[str, Any]) -> int:
    layers = c["num_hidden_layers"]
    if name == "fsdp":
        return hand_count(llama_tensors(c, range(layers), True, True), 1, 2048)
    if name == "fsdp_tp":
        return hand_count(llama_tensors(c, range(layers), True, True), 8, 256)
    # pp_fsdp_tp: 16 stages of layers // 16 blocks; the last stage holds the final norm and the head besides (the
    # head as large as the first stage's embedding): its first rank, 15 x 128, holds the most.
    return hand_count(llama_tensors(c, range(layers // 16), False, True), 8, 16)


# -------------------------------------------------------------------------------------------------
# the three measurements
# -------------------------------------------------------------------------------------------------


def scale(names: list[str], seq: int) -> None:
    config = json.loads(CONFIG.read_text())
    rows = []
    for name in names:
        plan, seconds, rss = run_plan(
            [
                "--model",
                str(CONFIG),
                "--devices",
                "8",
                "--nodes",
                "256",
                "--strategies",
                SCALE[name],
                "--seq",
                str(seq),
                "--memory",
                "80GiB",
            ]
        )
        s = plan["strategies"][0]
        if s["parameters"] is None:
            raise SystemExit(f"{name}: not planned: {s['note']}")
        want = expected_bytes(name, config)
        rows.append(
            (
                SCALE[name],
                s["rank"],
                s["parameters"],
                want,
                f"{(s['parameters'] - want) / want:+.2e}",
                f"{seconds:.0f}",
                f"{LAST_CPU_SECONDS[0]:.0f}",
                f"{rss / 2**30:.2f}",
                f"{PROCESSES * rss / 2**30:.2f}",
                s["status"],
            )
        )
        print(table(rows[-1:], HEADER), flush=True)
    print(f"\n{plan['parameter_count']:.4g} parameters at 2048 ranks, --seq {seq}; load {os.getloadavg()}")
    print(table(rows, HEADER))


HEADER = (
    "strategy",
    "rank",
    "planned bytes",
    "by hand",
    "difference",
    "seconds",
    "cpu seconds",
    "peak RSS GiB",
    "RSS bound GiB",
    "status",
)


def llama_config(parameters: float, layers: int = 2) -> dict[str, Any]:
    """A Llama shape of about ``parameters`` with ``layers`` layers: hidden h, intermediate 2.6 h, 8 kv heads."""
    vocab = 32000
    # per layer: 2 h^2 (q, o) + 2 h kv + 3 h (2.6 h) ~ 9.8 h^2; plus 2 vocab h.
    h = (parameters / (layers * 9.8)) ** 0.5
    # Heads of 128 in a multiple of the 8 kv heads (grouped attention needs one of the other): h by 1024.
    h = max(1024, int(h // 1024) * 1024)
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": int(2.6 * h) // 128 * 128,
        "num_hidden_layers": layers,
        "num_attention_heads": h // 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }


def growth(plot: str | None) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for size in (1e9, 1e10, 1e11, 1e12):
            path = Path(work) / f"llama-{size:.0e}.json"
            path.write_text(json.dumps(llama_config(size)))
            plan, seconds, rss = run_plan(
                [
                    "--model",
                    str(path),
                    "--devices",
                    "8",
                    "--nodes",
                    "8",
                    "--strategies",
                    "fsdp",
                    "--seq",
                    "512",
                ]
            )
            rows.append(("size", plan["parameter_count"], 64, seconds, LAST_CPU_SECONDS[0], rss))
            print(table([_row(rows[-1])], GROWTH), flush=True)
        path = Path(work) / f"llama-{1e11:.0e}.json"  # written by the loop above
        for world in (8, 64, 512, 8192):
            plan, seconds, rss = run_plan(
                [
                    "--model",
                    str(path),
                    "--devices",
                    "8",
                    "--nodes",
                    str(world // 8),
                    "--strategies",
                    "fsdp",
                    "--seq",
                    "512",
                ]
            )
            rows.append(("world", plan["parameter_count"], world, seconds, LAST_CPU_SECONDS[0], rss))
            print(table([_row(rows[-1])], GROWTH), flush=True)
    print(table([_row(r) for r in rows], GROWTH))
    if plot:
        _plot(rows, plot)


GROWTH = ("varying", "parameters", "ranks", "seconds", "cpu seconds", "peak RSS MiB")


def _row(r: tuple[Any, ...]) -> tuple[Any, ...]:
    return (r[0], f"{r[1]:.3g}", r[2], f"{r[3]:.1f}", f"{r[4]:.1f}", f"{r[5] / 2**20:.0f}")


def _plot(rows: list[tuple[Any, ...]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind, x, label in (
        (axes[0], "size", 1, "parameters (2 layers, 64 ranks)"),
        (axes[1], "world", 2, "simulated ranks (1e11 parameters)"),
    ):
        picked = [r for r in rows if r[0] == kind]
        # CPU seconds: on a shared machine the wall clock counts other processes' turns.
        ax.plot([r[x] for r in picked], [r[4] for r in picked], "o-", label="cpu seconds")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("cpu seconds")
        ax.set_ylim(bottom=0)  # from zero: a flat line should look flat, not its noise magnified
        twin = ax.twinx()
        twin.plot([r[x] for r in picked], [r[5] / 2**20 for r in picked], "s--", color="tab:orange")
        twin.set_ylabel("peak RSS (MiB)", color="tab:orange")
        twin.set_ylim(bottom=0)
    fig.suptitle("stratagem plan under fsdp: time and memory")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def activations() -> None:
    from stratagem.cli.plan import _plan_models
    from stratagem.planning import World, plan

    rows = []
    with tempfile.TemporaryDirectory() as work:
        tiny = Path(work) / "config.json"
        tiny.write_text(
            json.dumps(
                {
                    "model_type": "llama",
                    "vocab_size": 64,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 4,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 64,
                    "tie_word_embeddings": False,
                }
            )
        )
        for spec, batch, seq in (("demo", 4, 32), ("demo", 16, 256), (str(tiny), 4, 32), (str(tiny), 8, 64)):
            workload = _plan_models.workload(spec)
            real = _real(workload, batch, seq)
            planned = (
                plan(
                    workload,
                    World(devices=1, batch_size=batch, sequence_length=seq),
                    strategies=["single_device"],
                )
                .strategies[0]
                .largest.activations
            )
            name = "demo" if spec == "demo" else "tiny llama"
            rows.append((name, f"{batch} x {seq}", planned, real, f"{(planned - real) / real:+.1%}"))
    print(table(rows, ("model", "micro-batch", "plan (bytes)", "MemTracker, real step", "difference")))


def _real(workload: Any, batch_size: int, seq: int) -> int:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = workload.build()
    batch = workload.batch(model, batch_size, seq)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        workload.step(model, model, batch).backward()
    peak = tracker.get_tracker_snapshot("peak")
    return sum(
        v for per in peak.values() for k, v in per.items() if getattr(k, "value", k) in ("Activation", "Temp")
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scale")
    s.add_argument("--strategies", default=",".join(SCALE))
    s.add_argument("--seq", type=int, default=4096)
    g = sub.add_parser("growth")
    g.add_argument("--plot", default=None)
    sub.add_parser("activations")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    if args.what == "scale":
        scale(args.strategies.split(","), args.seq)
    elif args.what == "growth":
        growth(args.plot)
    else:
        activations()
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()

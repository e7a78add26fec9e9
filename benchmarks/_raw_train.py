"""A worker of raw PyTorch training (DistributedDataParallel or fully_shard), for the memory benchmarks.

Runs under ``python -m torch.distributed.run``; trains the same model on the same batches as
``stratagem compare`` (stratagem's bench models, AdamW, one batch generator per rank) without stratagem in the
training path, and writes this rank's figures (measured with the same functions as ``stratagem compare``) to
``OUT/rank<R>.json``. Started by benchmarks/compare.py and benchmarks/allocator.py (see :func:`launch`).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/_raw_train.py \
        --kind fsdp --model medium --steps 10 --out /tmp/raw
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stratagem.cli.compare import (
    _bench_models,
    current_rss_bytes,
    gradient_bytes,
    optimizer_bytes,
    parameter_bytes,
    peak_rss_bytes,
)

KINDS = ("ddp", "fsdp")


def build(kind: str, model_name: str) -> torch.nn.Module:
    model = _bench_models.MODELS[model_name]()
    if kind == "ddp":
        model.configure_model()
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    # Built on the meta device and sharded before any memory is allocated: no full replica ever exists.
    with torch.device("meta"):
        model.configure_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--model", default="medium", choices=sorted(_bench_models.MODELS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    baseline = current_rss_bytes()
    torch.manual_seed(args.seed)
    model = build(args.kind, args.model)
    inner = model.module if args.kind == "ddp" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    times, grads = [], 0
    usage = None
    for step in range(args.steps):
        if step == args.warmup:
            usage = resource.getrusage(resource.RUSAGE_SELF)
        x, y = inner.example_batch(args.batch_size, generator)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step == args.steps - 1:
            grads = gradient_bytes(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    end = resource.getrusage(resource.RUSAGE_SELF)
    timed = max(1, args.steps - args.warmup)
    usage = usage or end
    dist.barrier()
    params, state = parameter_bytes(model), optimizer_bytes(model, [optimizer])
    peak = peak_rss_bytes()
    result = {
        "rank": rank,
        "parameter_bytes": params,
        "gradient_bytes": grads,
        "optimizer_bytes": state,
        "state_bytes": params + grads + state,
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "peak_rss_above_baseline_bytes": max(0, peak - baseline),
        "step_times_s": times,
        "timed_steps_s": times[args.warmup :] or times,
        # CPU time and page faults per timed step: what an allocator setting costs, less exposed to other jobs
        # on the machine than wall time.
        "cpu_s_per_step": (end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime) / timed,
        "sys_s_per_step": (end.ru_stime - usage.ru_stime) / timed,
        "minor_faults_per_step": (end.ru_minflt - usage.ru_minflt) / timed,
        "allocator_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def launch(
    kind: str,
    *,
    allocator_env: dict[str, str],
    model: str = "medium",
    steps: int = 10,
    warmup: int = 2,
    batch_size: int = 16,
    nproc: int = 2,
    timeout: float = 900,
) -> list[dict[str, Any]]:
    """Run this worker in ``nproc`` processes with exactly ``allocator_env`` as the MALLOC_* and GLIBC_TUNABLES settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    env.update(allocator_env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    with tempfile.TemporaryDirectory(prefix="raw-train-") as out:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            __file__,
            f"--kind={kind}",
            f"--model={model}",
            f"--steps={steps}",
            f"--warmup={warmup}",
            f"--batch-size={batch_size}",
            f"--out={out}",
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"raw {kind} run failed:\n{done.stderr[-3000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


if __name__ == "__main__":
    main()

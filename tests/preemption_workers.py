"""What ``test_preemption.py``'s short-step test runs in its two workers: fits of short steps under ddp, counting
the all-reduces they issue with torch's profiler, with the default preemption signals and without them; then two
fits in which rank 1 alone catches SIGTERM, during training and three steps before its end. Returned from rank 0:
plain numbers and the preemption records."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import sg_workloads as wl
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

import stratagem as sg


def _fit(root: Path, steps: int, sleep_s: float, signal_at: int | None = None, **options: Any) -> Any:
    trainer = sg.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        default_root_dir=root,
        enable_progress_bar=False,
        seed=7,
        **options,
    )
    module = wl.Regression()
    step = module.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        time.sleep(sleep_s)  # a short step, but one that load slows down little
        if trainer.global_step == signal_at and trainer.engine.rank == 1:
            signal.raise_signal(signal.SIGTERM)
        return step(batch, batch_idx)

    module.training_step = training_step  # type: ignore[method-assign]
    # 4 samples per rank and step, one epoch: the loader's end is no boundary of its own.
    trainer.fit(module, DataLoader(wl.dataset(n=8 * steps), batch_size=4))


def short_steps(engine: Any, root: str, steps: int, sleep_s: float, signal_at: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, options in (("armed", {}), ("off", {"preemption_signals": ()})):
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            start = time.perf_counter()
            _fit(Path(root, name), steps, sleep_s, **options)
            out[f"{name} seconds"] = time.perf_counter() - start
        averages = profiled.key_averages()
        out[f"{name} all-reduces"] = sum(e.count for e in averages if e.key == "c10d::allreduce_")
    for name, at in (("", signal_at), (" late", steps - 3)):
        try:
            _fit(Path(root, f"preempted{name}"), steps, sleep_s, signal_at=at)
        except sg.Preempted as preempted:
            saved = torch.load(preempted.checkpoint, weights_only=True)["state"]
            out[f"record{name}"] = {**saved["preempted"], "saved step": saved["progress"]["step"]}
            stopped = preempted.step
        else:
            stopped = -1
        out[f"stopped{name}, every rank"] = [int(t) for t in engine.all_gather(torch.tensor(stopped))]
    return out

"""The demo: a character-level GPT-style model, trained with a checkpoint half-way and a resume from it, and a
report of what each rank held (so that a strategy's sharding shows)."""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem.cli.compare import gradient_bytes, optimizer_bytes, parameter_bytes
from stratagem.cli.demo.model import CharLM, CharWindows, load_text, replica_bytes
from stratagem.engine._strategy_optimizer import _clean_name
from stratagem.strategies.precision import param_dtype

__all__ = ["CharLM", "CharWindows", "load_text", "run"]


class _Losses:
    """Each batch's loss as the Trainer reports it to callbacks (under every strategy, pipelines included)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        self.losses.append(outputs.detach())


class _GradientBytes:
    """Counts this rank's gradients while they exist: after backward, before the optimizer applies them."""

    state_key = "demo-gradient-bytes"

    def __init__(self) -> None:
        self.bytes = 0

    @sg.hookimpl
    def on_before_optimizer_step(self, trainer: Any, optimizer: Any, step: int) -> None:
        self.bytes = gradient_bytes(trainer.model, [optimizer])


def peak_memory(trainer: sg.Trainer) -> float:
    """Peak memory of this rank in bytes: CUDA allocations on a GPU, else the process's peak RSS."""
    device = trainer.engine.device
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _megabytes(value: float) -> str:
    # Two decimals: the demo's model is small (a replica's parameters are under half a megabyte).
    return f"{value / 2**20:8.2f} MB"


def _root_dir(given: str | None) -> tuple[Path, bool]:
    if given:
        return Path(given), False
    # Every worker of one launch shares the agent's run id, so they agree on the directory.
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    run = run if run and run != "none" else str(os.getpid())
    return Path(tempfile.gettempdir()) / f"stratagem-demo-{run}", True


def run(
    *,
    strategy: str = "auto",
    devices: int = 1,
    steps: int = 200,
    accelerator: str = "cpu",
    precision: str = "32-true",
    batch_size: int = 16,
    root_dir: str | None = None,
    seed: int = 0,
    progress_bar: bool = True,
    launcher: str = "auto",
    compile: Any = False,
) -> dict[str, Any]:
    """Train for ``steps`` steps: the first half, a checkpoint, then a new model and Trainer resuming from it
    for the second half. Returns the report (on rank 0; the other ranks return theirs)."""
    if steps < 2:
        raise sg.ConfigurationError(
            f"--steps {steps}: give at least 2 (half before the checkpoint, half after)."
        )
    if accelerator != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        # This model's operations are too small to split across threads; on a busy machine the threads
        # mostly wait for each other.
        torch.set_num_threads(1)
    root, temporary = _root_dir(root_dir)
    text = load_text()
    data = CharWindows(text, block=64, stride=37)
    torch.manual_seed(seed)
    half = steps // 2
    common = dict(
        strategy=strategy,
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        default_root_dir=root,
        checkpoint_every_n_steps=half,
        keep_last_k=2,
        seed=seed,
        log_every_n_steps=10,
        enable_progress_bar=progress_bar,
        launcher=launcher,
        compile=compile,
    )
    recorded = _Losses()
    first = sg.Trainer(max_steps=half, callbacks=[recorded], **common)
    model = CharLM(len(data.vocab))
    model.__dict__["total_steps"] = steps
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True)
    first.print(
        f"stratagem demo: {len(text) // 1024} KB of text, {len(data.vocab)} characters; strategy "
        f"{strategy if '[' in strategy else first.engine.strategy_name}, {first.engine.world_size_requested} "
        f"process(es) on {first.engine.device.type}; "
        f"{steps} steps, checkpoint and resume at step {half}."
    )
    first.fit(model, loader)
    if first.engine.compiled_regions:
        regions = first.engine.compiled_regions
        first.print(f"compiled with torch.compile: {', '.join(r or 'the model' for r in regions)}")

    # A fresh model and Trainer, as a new run would make them: everything comes back from the checkpoint.
    gradients = _GradientBytes()
    second = sg.Trainer(max_steps=steps, callbacks=[gradients, recorded], **common)
    resumed = CharLM(len(data.vocab))
    resumed.__dict__["total_steps"] = steps
    second.fit(resumed, loader, ckpt_path="last")
    losses = recorded.losses
    dtype = param_dtype(precision) or torch.float32
    replica = replica_bytes(len(data.vocab), torch.empty((), dtype=dtype).element_size())
    return _report(second, losses, gradients.bytes, replica, root, temporary)


def _report(
    trainer: sg.Trainer,
    losses: list[torch.Tensor],
    gradients: int,
    replica: dict[str, int],
    root: Path,
    temporary: bool,
) -> dict[str, Any]:
    engine = trainer.engine
    assert trainer.model is not None
    held = [
        parameter_bytes(trainer.model),
        gradients,
        optimizer_bytes(trainer.model, trainer.optimizers),
    ]
    mine = torch.tensor(
        [losses[0].item(), losses[-1].item(), peak_memory(trainer), *held, sum(held)],
        dtype=torch.float64,
        device=engine.device,
    )
    rows = [row.cpu().tolist() for row in engine.all_gather(mine)]
    first = sum(r[0] for r in rows) / len(rows)
    last = sum(r[1] for r in rows) / len(rows)
    whole = sum(replica.values())
    trainer.print(f"loss: first {first:.3f} -> last {last:.3f} (mean over ranks)")
    mesh = engine.device_mesh
    layout = None if mesh is None else {"shape": tuple(mesh.shape), "names": tuple(mesh.mesh_dim_names or ())}
    if layout is not None:
        names = layout["names"] or ("",) * len(layout["shape"])
        shown = " x ".join(f"{n} {s}".strip() for n, s in zip(names, layout["shape"]))
        trainer.print(f"device mesh: {shown}")
    held_modules = [engine.broadcast(_modules_held(trainer.model), src) for src in range(engine.world_size)]
    if any(modules != held_modules[0] for modules in held_modules):
        # A pipeline keeps each rank's stages only: say which.
        trainer.print(
            "modules per rank: " + "; ".join(f"{r}: {', '.join(m)}" for r, m in enumerate(held_modules))
        )
    trainer.print(
        f"held per rank (one whole replica: parameters {_megabytes(replica['parameters']).strip()}, with "
        f"gradients and AdamW state {_megabytes(whole).strip()}):"
    )
    memory_kind = "peak CUDA" if engine.device.type == "cuda" else "peak RSS"
    columns = ["rank", memory_kind, "parameters", "gradients", "optimizer", "total", "of replica"]
    trainer.print("  ".join(f"{c:>11}" if i else c for i, c in enumerate(columns)))
    for rank, row in enumerate(rows):
        cells = [f"{rank:>4}", *(_megabytes(v) for v in row[2:7]), f"{row[6] / whole:10.2f}x"]
        trainer.print("  ".join(cells))
    engine.barrier("demo-report")
    if temporary and engine.is_global_zero:
        shutil.rmtree(root, ignore_errors=True)
    elif engine.is_global_zero:
        trainer.print(f"checkpoints and metrics.csv: {root}")
    keys = ("first_loss", "last_loss", "peak_memory", "parameters", "gradients", "optimizer", "total")
    return {
        "first_loss": first,
        "last_loss": last,
        "ranks": [dict(zip(keys, row)) for row in rows],
        "replica": replica,
        "losses": [float(loss) for loss in losses],
        "mesh": layout,
        "steps": trainer.global_step,
        "modules": held_modules,
    }


def _modules_held(model: torch.nn.Module) -> list[str]:
    """The model's pieces this rank holds parameters of: top-level modules, and each block of a list."""
    found: list[str] = []
    for name, _ in model.named_parameters():
        parts = _clean_name(name).split(".")
        cut = next((i + 1 for i, part in enumerate(parts[:-1]) if part.isdigit()), 1)
        piece = ".".join(parts[:cut])
        if piece not in found:
            found.append(piece)
    return found

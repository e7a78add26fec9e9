"""The demo: a character-level GPT-style model, trained with a checkpoint half-way and a resume from it."""

from __future__ import annotations

import math
import os
import resource
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import stratagem as sg


def load_text() -> str:
    return resources.files("stratagem.cli.demo").joinpath("corpus.txt").read_text(encoding="utf-8")


class CharWindows(Dataset):
    """Overlapping windows of ``block + 1`` characters: input and next-character target."""

    def __init__(self, text: str, block: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.vocab)}
        self.ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        self.block, self.stride = block, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.block - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.stride : i * self.stride + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class CharLM(sg.Module):
    """A small transformer LM. Layers are built in ``configure_model`` so that sharding strategies can build
    them on the meta device and shard each block (``sg.wrap``)."""

    def __init__(
        self, vocab: int, block: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, lr: float = 3e-3
    ):
        super().__init__()
        self.config = dict(vocab=vocab, block=block, dim=dim, layers=layers, heads=heads)
        self.lr = lr
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        c = self.config
        self.tok = torch.nn.Embedding(c["vocab"], c["dim"])
        self.pos = torch.nn.Embedding(c["block"], c["dim"])
        self.blocks = torch.nn.ModuleList(sg.wrap(Block(c["dim"], c["heads"])) for _ in range(c["layers"]))
        self.ln = torch.nn.LayerNorm(c["dim"])
        self.head = torch.nn.Linear(c["dim"], c["vocab"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of every position, as ``(batch * time, vocab)``."""
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        # Flattened before the head, so the result is not a view: FSDP warns about returning one, since an
        # in-place op on it would skip its pre-backward hook.
        return self.head(self.ln(x).flatten(0, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y.reshape(-1))
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y.reshape(-1)))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        total = self.__dict__.get("total_steps", 1000)
        warmup = max(1, total // 20)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (
                1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))
            )

        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        }


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def training_bytes(trainer: sg.Trainer) -> int:
    """This rank's parameters, their gradients (same size, alive during the step) and optimizer state."""
    assert trainer.model is not None
    params = sum(_local_bytes(p) for p in trainer.model.parameters())
    grads = sum(_local_bytes(p) for p in trainer.model.parameters() if p.requires_grad)
    state = 0
    for optimizer in trainer.optimizers:
        for per_param in optimizer.state.values():
            state += sum(_local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return params + grads + state


def peak_memory(trainer: sg.Trainer) -> float:
    """Peak memory of this rank in bytes: CUDA allocations on a GPU, else the process's peak RSS."""
    device = trainer.engine.device
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _megabytes(value: float) -> str:
    return f"{value / 2**20:8.1f} MB"


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
    )
    first = sg.Trainer(max_steps=half, **common)
    model = CharLM(len(data.vocab))
    model.__dict__["total_steps"] = steps
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True)
    first.print(
        f"stratagem demo: {len(text) // 1024} KB of text, {len(data.vocab)} characters; strategy "
        f"{first.engine.strategy_name}, {first.engine.world_size_requested} process(es) on {first.engine.device.type}; "
        f"{steps} steps, checkpoint and resume at step {half}."
    )
    first.fit(model, loader)
    first_losses = list(model.losses)

    # A fresh model and Trainer, as a new run would make them: everything comes back from the checkpoint.
    second = sg.Trainer(max_steps=steps, **common)
    resumed = CharLM(len(data.vocab))
    resumed.__dict__["total_steps"] = steps
    second.fit(resumed, loader, ckpt_path="last")
    losses = first_losses + list(resumed.losses)
    return _report(second, losses, root, temporary)


def _report(trainer: sg.Trainer, losses: list[torch.Tensor], root: Path, temporary: bool) -> dict[str, Any]:
    engine = trainer.engine
    mine = torch.tensor(
        [losses[0].item(), losses[-1].item(), peak_memory(trainer), float(training_bytes(trainer))],
        dtype=torch.float64,
        device=engine.device,
    )
    rows = [row.cpu().tolist() for row in engine.all_gather(mine)]
    first = sum(r[0] for r in rows) / len(rows)
    last = sum(r[1] for r in rows) / len(rows)
    memory_kind = "peak CUDA allocated" if engine.device.type == "cuda" else "peak RSS"
    trainer.print(f"loss: first {first:.3f} -> last {last:.3f} (mean over ranks)")
    trainer.print(f"rank  {memory_kind:>12}  params+grads+optimizer")
    for rank, row in enumerate(rows):
        trainer.print(f"{rank:>4}  {_megabytes(row[2]):>12}  {_megabytes(row[3]):>21}")
    engine.barrier("demo-report")
    if temporary and engine.is_global_zero:
        shutil.rmtree(root, ignore_errors=True)
    elif engine.is_global_zero:
        trainer.print(f"checkpoints and metrics.csv: {root}")
    return {"first_loss": first, "last_loss": last, "ranks": rows, "steps": trainer.global_step}

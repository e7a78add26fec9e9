"""The models, data and one-process references of seed 004's DeepSpeed examples (Lightning's model-parallel
page); ds_seed_runs.py runs the examples with ``Trainer.fit`` in the workers of one 2-process launch.

Adapted only where the seed cannot run here: CPU processes with gloo instead of 4 GPUs, ``32-true`` instead of
``precision=16`` (fp16 is CUDA only), ``torch.optim.AdamW`` instead of ``FusedAdam`` (a CUDA kernel that
DeepSpeed would compile a C++ stand-in for), and in the config file ``AdamW`` (run by torch) instead of
``OneBitAdam`` (which needs CUDA for its compressed communication).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import stratagem as sg

FEATURES, OUTPUTS = 32, 2
#: Per-process batch, processes, optimizer steps, learning rate of the modules' own AdamW.
MICRO, WORLD, STEPS, LR = 4, 2, 6, 1e-2
#: The parameters' width in the NVMe example: its first weight's partition (32 x 16384 / 2 processes, fp32)
#: is 1 MiB, the smallest tensor DeepSpeed's asynchronous I/O swaps (MIN_AIO_BYTES); smaller ones stay in memory.
NVME_WIDTH = 16384

#: The seed's config file, adapted: AdamW run by torch (``torch_adam``) instead of OneBitAdam, whose compressed
#: communication needs CUDA; ``cuda_aware`` (OneBitAdam's) dropped. Everything else as in the seed.
SEED_CONFIG: dict[str, Any] = {
    "zero_allow_untested_optimizer": True,
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 3e-5,
            "betas": [0.998, 0.999],
            "eps": 1e-5,
            "weight_decay": 1e-9,
            "torch_adam": True,
        },
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "last_batch_iteration": -1,
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-5,
            "warmup_num_steps": 100,
        },
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "contiguous_gradients": True,
        "overlap_comm": True,
        "allgather_bucket_size": 2e8,
        "reduce_bucket_size": 2e8,
    },
}
CONFIG_STEPS, CONFIG_RESUME_AT = 8, 4


def dataset() -> torch.utils.data.TensorDataset:
    """Enough samples for the longest run (the config file's); shorter runs stop at max_steps."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(CONFIG_STEPS * MICRO * WORLD, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, torch.randn(len(x), OUTPUTS, generator=g))


def _checkpoint(kind: str, function: Any, x: torch.Tensor) -> torch.Tensor:
    import deepspeed

    if kind == "reentrant":  # the seed's call
        return deepspeed.checkpointing.checkpoint(function, x)
    return deepspeed.checkpointing.non_reentrant_checkpoint(function, x)


class MyModel(sg.Module):
    """The seed's model: layers built in ``configure_model`` (its "Shard Model Instantly" example), ``block_1``
    run through ``deepspeed.checkpointing.checkpoint`` (its activation-checkpointing example) when
    ``checkpointing="reentrant"``, through DeepSpeed's ``non_reentrant_checkpoint`` when ``"non_reentrant"``, or
    called directly (``None``, the examples that are not about checkpointing).

    The seed's call is DeepSpeed's reentrant checkpoint on the first block, whose input (the batch) needs no
    gradient: that block's parameters then get no gradient at all (as with torch's reentrant checkpoint), which
    the test shows. DeepSpeed's non-reentrant checkpoint gives them their gradients.

    What DeepSpeed did is recorded on the side: the partitions in ``configure_model``, and in the first forward
    what became of the input the checkpoint saved for backward, and the learning rate of each step.
    """

    def __init__(self, width: int = 32, checkpointing: str | None = None) -> None:
        super().__init__()
        self.width, self.checkpointing = width, checkpointing
        self.built: list[dict[str, Any]] = []
        self.seen: dict[str, Any] | None = None
        self.lrs: list[float] = []

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.block_1 = nn.Sequential(nn.Linear(FEATURES, self.width), nn.ReLU())
        self.block_2 = torch.nn.Linear(self.width, OUTPUTS)
        self.built = [
            {"ds_id": hasattr(p, "ds_id"), "numel": p.numel(), "partition": _partition_numel(p)}
            for p in self.block_1.parameters()
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None:
            return self.block_2(self.block_1(x))
        # Use the DeepSpeed checkpointing function instead of calling the module directly.
        synchronized = _sync_calls()
        out = _checkpoint(self.checkpointing, self.block_1, x)
        if self.seen is None and torch.is_grad_enabled():
            self.seen = _what_was_saved(x, _sync_calls() - synchronized)
        return self.block_2(out)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)


class ConfigOptimizerModel(MyModel):
    """The seed's config-file example: the optimizer and scheduler come from the DeepSpeed config."""

    configure_optimizers = sg.Module.configure_optimizers


class BothOptimizersModel(MyModel):
    """A config with an optimizer section, and configure_optimizers returning one too."""


class TorchSchedulerModel(MyModel):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        }


def _partition_numel(p: torch.Tensor) -> int | None:
    tensor = getattr(p, "ds_tensor", None)
    return None if tensor is None else int(tensor.numel())


def _sync_calls() -> int:
    from deepspeed.accelerator import get_accelerator

    return getattr(get_accelerator(), "sync_calls", 0)


def count_synchronize() -> None:
    """Count DeepSpeed's device synchronisations (the real call still runs): what
    synchronize_checkpoint_boundary adds around each checkpoint."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if hasattr(accelerator, "sync_calls"):
        return
    original = accelerator.synchronize

    def synchronize(*args: Any, **kwargs: Any) -> Any:
        accelerator.sync_calls += 1
        return original(*args, **kwargs)

    accelerator.sync_calls = 0
    accelerator.synchronize = synchronize


def _what_was_saved(x: torch.Tensor, sync_calls: int) -> dict[str, Any]:
    """DeepSpeed's checkpoint replaces the data of an input it keeps aside (partitioned, or moved to the CPU) by
    an empty tensor and keeps the copy in ``saved_data``; an input it keeps as is stays whole."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ckpt

    saved = getattr(x, "saved_data", None)
    in_buffer = False
    if saved is not None and ckpt.contiguous_data_buffers:
        pointer = saved.untyped_storage().data_ptr()
        in_buffer = any(b.untyped_storage().data_ptr() == pointer for b in ckpt.contiguous_data_buffers[0])
    return {
        "input_emptied": x.data.dim() == 0,
        "saved_shape": None if saved is None else list(saved.shape),
        "saved_device": None if saved is None else str(saved.device),
        "in_contiguous_buffer": in_buffer,
        "sync_calls": sync_calls,
        "settings": {
            "PARTITION_ACTIVATIONS": ckpt.PARTITION_ACTIVATIONS,
            "CPU_CHECKPOINT": ckpt.CPU_CHECKPOINT,
            "CONTIGUOUS_CHECKPOINTING": ckpt.CONTIGUOUS_CHECKPOINTING,
            "SYNCHRONIZE": ckpt.SYNCHRONIZE,
            "num_layers": ckpt.num_layers,
        },
    }


def reference(
    width: int = 32, steps: int = STEPS, lr_at: Any = None, no_gradient: str | None = None, **adamw: Any
) -> dict[str, torch.Tensor]:
    """One process, plain torch (no checkpointing), the global batch of each step; ``lr_at(step)`` sets the
    learning rate of each step. The ``no_gradient`` block gets a zero gradient, which is what ZeRO steps a
    parameter that backward gave none with (so AdamW's weight decay still moves it)."""
    model = MyModel(width)
    model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters(), **({"lr": LR} | adamw))
    x, y = dataset().tensors
    size = MICRO * WORLD
    for step in range(steps):
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
        F.mse_loss(
            model.block_2(model.block_1(x[step * size : (step + 1) * size])),
            y[step * size : (step + 1) * size],
        ).backward()
        if no_gradient is not None:
            for p in getattr(model, no_gradient).parameters():
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def warmup_lr(step: int) -> float:
    """The learning rate of optimizer step ``step`` under the seed's WarmupLR: the scheduler starts at the
    minimum and moves after each step (iteration ``step - 1``), on a log scale up to ``warmup_num_steps``."""
    params = SEED_CONFIG["scheduler"]["params"]
    low, high, n = params["warmup_min_lr"], params["warmup_max_lr"], params["warmup_num_steps"]
    iteration = step - 1
    if iteration < 0:
        return low
    return low + (high - low) * (math.log(iteration + 1) / math.log(n) if iteration < n else 1.0)

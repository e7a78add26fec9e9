"""Worker of test_hf_load.py: a model with a tied weight, an unevenly sharded one and a buffer made on the CPU
inside the meta build, loaded from safetensors under fsdp."""

from __future__ import annotations

from typing import Any

import torch

import stratagem as sg


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.down = torch.nn.Linear(8, 5)  # 5 rows at 2 ranks: FSDP pads this shard
        self.up = torch.nn.Linear(5, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        # Made on the CPU even under the meta device, and in no checkpoint: the load must keep its values.
        self.register_buffer("scale", torch.arange(1.0, 9.0, device="cpu"), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(self.down(self.embed(tokens))) * self.scale)


def tokens() -> torch.Tensor:
    return torch.arange(12).reshape(3, 4) % 16


def load(engine: sg.Engine, weights: str) -> dict[str, Any]:
    with engine.init_module(empty_init=True):
        module = Tied()
    built_on_cpu = module.scale.device.type == "cpu" and module.embed.weight.is_meta
    model = engine.setup(module, init_weights=weights)
    with torch.no_grad():
        logits = model(tokens())
    return {
        "built_on_cpu": built_on_cpu,
        "logits": logits.detach().clone(),
        "scale": module.scale.clone(),
        "tied": module.head.weight is module.embed.weight,
    }

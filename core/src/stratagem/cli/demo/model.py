"""The demo's data and model: windows of the shipped text, and a character-level GPT-style transformer."""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

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


class Attention(torch.nn.Module):
    """Causal self-attention with one fused q/k/v projection whose output features are grouped by head
    (head 0's q, k, v, then head 1's, ...): a split of those features into equal parts, as tensor parallelism
    makes, hands each rank the q, k and v of whole heads. (Grouped as all q, then all k, then all v, one rank
    would get all of q and part of k.)"""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        # ``num_heads`` is the name tensor-parallel strategies check for divisibility by their size.
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds num_heads / tp of them.
        q, k, v = self.qkv(x).view(b, t, -1, 3, self.head_dim).unbind(dim=3)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(sg.Module):
    """A small transformer LM. Layers are built in ``configure_model`` so that sharding strategies can build
    them on the meta device and shard each block (``sg.wrap``). It says how its loss is computed
    (:meth:`compute_loss`) rather than writing a training step, so that it trains under every strategy."""

    #: How tensor-parallel strategies split it (module-name globs to styles; plain data, read by strategies
    #: that split layers and ignored by the others): attention and MLP column- then row-wise (one all-reduce
    #: each); the embeddings and the head by columns, gathered. The embeddings are split on their features, not
    #: their rows: under torch 2.13 a row-split embedding's gradient comes back whole on every rank. Only the
    #: LayerNorms and the row-split layers' biases stay whole on every rank.
    tp_plan = {
        "tok": "colwise_gather_output",
        "pos": "colwise_gather_output",
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.out": "rowwise",
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise",
        "head": "colwise_gather_output",
    }

    def pp_plan(self, num_stages: int) -> list[str]:
        """Where pipeline strategies split it (plain data too, ignored by the others): the block where each
        stage after the first begins, blocks spread evenly; the embeddings go with the first stage, the final
        norm and the head with the last."""
        layers = self.config["layers"]
        if not 1 < num_stages <= layers:
            raise sg.ConfigurationError(
                f"the demo's model has {layers} blocks: it splits into 2 to {layers} pipeline stages, not "
                f"{num_stages}."
            )
        return [f"blocks.{stage * layers // num_stages}" for stage in range(1, num_stages)]

    def __init__(
        self, vocab: int, block: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, lr: float = 3e-3
    ):
        super().__init__()
        self.config = dict(vocab=vocab, block=block, dim=dim, layers=layers, heads=heads)
        self.lr = lr

    def configure_model(self) -> None:
        c = self.config
        self.tok = torch.nn.Embedding(c["vocab"], c["dim"])
        self.pos = torch.nn.Embedding(c["block"], c["dim"])
        self.blocks = torch.nn.ModuleList(sg.wrap(Block(c["dim"], c["heads"])) for _ in range(c["layers"]))
        self.ln = torch.nn.LayerNorm(c["dim"])
        self.head = torch.nn.Linear(c["dim"], c["vocab"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of every position, as ``(batch * time, vocab)``."""
        x = self.tok(ids)
        # On a later pipeline stage the embeddings are another stage's (falsy stand-ins that pass their input
        # on): what arrives is the previous stage's hidden states.
        if self.pos:
            x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        # Flattened before the head, so the result is not a view: FSDP warns about returning one, since an
        # in-place op on it would skip its pre-backward hook. A tensor-parallel head hands back a view of its
        # gathered output all the same; that one is copied (the logits of one batch: a few hundred KB).
        x = self.ln(x)
        if not self.head:
            # An earlier pipeline stage: its hidden states go on to the next stage unflattened.
            return x
        logits = self.head(x.flatten(0, 1))
        return logits if logits._base is None else logits.clone()

    def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of a batch of ``(inputs, targets)`` windows: with it, the default training step (and
        ``val_loss`` in validation) need no code here, and pipeline strategies, which run the step
        themselves, train it too."""
        return F.cross_entropy(logits, targets.reshape(-1))

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


def replica_bytes(vocab: int, element_size: int = 4) -> dict[str, int]:
    """What one whole replica of ``CharLM(vocab)`` holds in training: parameters, their gradients, and AdamW's
    two moments per parameter plus its float32 step counter per parameter tensor. Built on the meta device:
    nothing is allocated."""
    with torch.device("meta"):
        model = CharLM(vocab)
        model.configure_model()
    params = list(model.parameters())
    weights = sum(p.numel() for p in params) * element_size
    return {"parameters": weights, "gradients": weights, "optimizer": 2 * weights + 4 * len(params)}

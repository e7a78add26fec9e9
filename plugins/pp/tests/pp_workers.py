"""The models, data and one-process references of the pipeline tests, and what the workers report (module-level,
so that spawned workers import it; ``pp_runs`` holds the runs and launches).

The references are plain torch in one process on the global batch, computed in the pytest process.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import stratagem as sg

VOCAB, WIDTH, HEADS, BLOCKS = 32, 16, 4, 8
SEQUENCE, GLOBAL_BATCH, STEPS = 6, 8, 10
LR, MAX_NORM = 1e-2, 1.0

#: Megatron-style tensor-parallel plan (stratagem-tp's string forms) for pp_fsdp_tp.
TP_PLAN = {
    "embed": "rowwise",
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",
    "blocks.*.mlp.fc1": "colwise",
    "blocks.*.mlp.fc2": "rowwise",
    "head": "colwise_gather_output",
}


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        # No key bias: its true gradient is zero, and AdamW would turn rounding noise there into lr-sized steps.
        self.k = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = torch.nn.LayerNorm(WIDTH), Attention()
        self.norm2, self.mlp = torch.nn.LayerNorm(WIDTH), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """Embedding, eight blocks, a final norm and an untied head: a chain, as most language models are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LM(TinyLM, sg.Module):
    """TinyLM as a Trainer trains it: the loss and the optimizer, no training step (a pipeline runs the step)."""

    def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def make_module(seed: int = 0) -> LM:
    return make_model(seed, LM)  # type: ignore[return-value]


def make_model(seed: int = 0, cls: type = TinyLM) -> TinyLM:
    """In float64: microbatches sum the loss in another order than one batch does, and AdamW turns float32
    rounding of a near-zero gradient into a step of up to the learning rate; float64 keeps that far below the
    tolerance, while a wrong gradient (scaling, a missed micro-batch) is still far above it. Built with float64
    as the default type, so that a meta-device build draws the same numbers as an eager one."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return cls()
    finally:
        torch.set_default_dtype(previous)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, SEQUENCE), generator=g)
    return [(t, (t * 3 + 1) % VOCAB) for t in tokens]


def uneven_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Epochs of 12 samples in batches of 8, as a loader without drop_last gives them: 8, then a shorter 4."""
    first, second = batches()[:2]
    tokens, targets = torch.cat([first[0], second[0]])[:12], torch.cat([first[1], second[1]])[:12]
    return [(tokens[:8], targets[:8]), (tokens[8:], targets[8:])] * (STEPS // 2)


def loader(data: list | None = None, per_process: int = GLOBAL_BATCH) -> torch.utils.data.DataLoader:
    """The steps' batches as a loader (no shuffling: with a sampler over dp replicas, step s still takes the
    global batch s, which the reference trains on)."""
    data = data if data is not None else batches()
    inputs, targets = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=per_process
    )


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference(model: torch.nn.Module | None = None, data: list | None = None, loss=loss_fn) -> dict[str, Any]:
    """One process, plain torch, the global batch of each step: parameters, pre-clip norms, losses."""
    model = model if model is not None else make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms, losses = [], []
    for inputs, targets in data if data is not None else batches():
        value = loss(model(inputs), targets)
        value.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(value.detach()))
    inputs, targets = (data if data is not None else batches())[0]
    with torch.no_grad():
        eval_loss = float(loss(model(inputs), targets))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "losses": losses, "eval_loss": eval_loss}


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of any parameter, relative to that parameter's largest magnitude."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()) for k in a)


def clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "_checkpoint_wrapped_module")


def gathered_params(holder: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's parameters made whole (``full_tensor`` over dp and tp), merged over the pipeline."""
    mine = {
        clean(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for n, p in holder.named_parameters()
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        merged.update(part)
    return merged


def gathered_optimizer(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's per-parameter state keyed by name, whole, merged over every rank's parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)
    mine = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
    mine = {clean(k): {n: v.detach().cpu().clone() for n, v in s.items()} for k, s in mine.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict[str, Any] = {}
    for part in every:
        merged.update(part)
    return merged


def bit_equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose values differ in any bit (nested dicts of tensors), and keys only one side has."""
    problems = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        if isinstance(x, dict):
            problems += [f"{key}.{k}" for k in bit_equal(x, y)]
        elif not (torch.equal(x, y) and x.dtype == y.dtype):
            problems.append(key)
    return problems


def local_shapes(holder: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {
        clean(n): (tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape), tuple(p.shape))
        for n, p in holder.named_parameters()
    }


# -------------------------------------------------------------------------------------------------
# Hugging Face Llama, tiny, with its own base_model_pp_plan
# -------------------------------------------------------------------------------------------------


def make_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def llama_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(64, (4, 9), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def make_llama_module(seed: int = 0) -> Any:
    """The same Llama as a stratagem Module: Hugging Face's model class with the loss and the optimizer."""
    from transformers import LlamaForCausalLM

    class LlamaLM(LlamaForCausalLM, sg.Module):
        def compute_loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return llama_loss(outputs, targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    plain = make_llama(seed)
    torch.manual_seed(seed)
    module = LlamaLM(plain.config)
    module.load_state_dict(plain.state_dict())
    return module


def llama_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


#: (name, stages_per_rank) at two processes: one stage per rank for gpipe and 1f1b, two for the others.
TWO_PROCESS_SCHEDULES = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 1),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("zero_bubble", 2),
    ("zbv_zero_bubble", 2),
    ("dual_pipe_v", 2),
)


def guard(out: dict[str, Any], key: str, function: Any) -> None:
    """Record ``function()`` under ``key``, or its traceback under ``errors``: one failure fails one check."""
    try:
        out[key] = function()
    except Exception:
        out.setdefault("errors", {})[key] = traceback.format_exc()

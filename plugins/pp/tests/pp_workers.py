"""Worker functions for the pipeline tests: module-level, so that spawned workers can import them.

Each launch runs in every process of a real gloo group and batches many checks; it returns plain data from
rank 0. The driver is the raw pipeline step (``strategy.train_step``), AdamW and the strategy's clipping; the
references are plain torch in one process on the global batch, computed in the pytest process.
"""

from __future__ import annotations

import os
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


def make_model(seed: int = 0) -> TinyLM:
    """In float64: microbatches sum the loss in another order than one batch does, and AdamW turns float32
    rounding of a near-zero gradient into a step of up to the learning rate; float64 keeps that far below the
    tolerance, while a wrong gradient (scaling, a missed micro-batch) is still far above it. Built with float64
    as the default type, so that a meta-device build draws the same numbers as an eager one."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return TinyLM()
    finally:
        torch.set_default_dtype(previous)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, SEQUENCE), generator=g)
    return [(t, (t * 3 + 1) % VOCAB) for t in tokens]


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


def local_shapes(holder: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {
        clean(n): (tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape), tuple(p.shape))
        for n, p in holder.named_parameters()
    }


def train(
    strategy: Any,
    devices: int,
    *,
    model_fn: Any = make_model,
    data: list | None = None,
    loss=loss_fn,
    empty_init: bool = False,
    die_at: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Train through the raw pipeline step; ``die_at=(rank, step)`` makes that rank exit mid-schedule."""
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=devices)
    if empty_init:
        torch.manual_seed(0)
        with engine.init_module(empty_init=True):
            model = model_fn()
    else:
        model = model_fn()
    holder = engine.setup_module(model)
    opt = torch.optim.AdamW(holder.parameters(), lr=LR)
    s = engine.strategy
    dp = s.sizes.dp
    dp_rank = engine.strategy.distributed_sampler_kwargs()["rank"]
    norms, losses = [], []
    for step, (inputs, targets) in enumerate(data if data is not None else batches()):
        per = inputs.shape[0] // dp
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        if die_at is not None and step == die_at[1] and engine.rank == die_at[0]:
            _die_in_the_middle(s)
        result = s.train_step((inputs[mine],), targets[mine], loss)
        norms.append(float(engine.clip_gradients(holder, opt, MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(engine.all_reduce(result.loss, "mean")))
    first_inputs, first_targets = (data if data is not None else batches())[0]
    per = first_inputs.shape[0] // dp
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    evaluated = s.eval_step((first_inputs[mine],), first_targets[mine], loss)
    out = {
        "params": gathered_params(holder),
        "norms": norms,
        "losses": losses,
        "eval_loss": float(engine.all_reduce(evaluated.loss, "mean")),
        "local_shapes": local_shapes(holder),
        "stages": [list(stage) for stage in s.applied["split"].stages],
        "source": s.applied["split"].source,
        "local_stages": s.applied["local_stages"],
        "units": s.applied["units"],
        "tp_styles": s.applied["tp_styles"],
        "mesh": (tuple(s.device_mesh.shape), tuple(s.device_mesh.mesh_dim_names)),
        "sampler": s.distributed_sampler_kwargs(),
        "microbatches": s.microbatches,
        "checkpointed": s.applied["checkpointed"],
    }
    engine.teardown()
    return out


def _die_in_the_middle(strategy: Any) -> None:
    """The second micro-batch's forward on this rank's first stage ends the process, as a crash would."""
    view = strategy.applied["views"][0]
    seen = []

    def hook(module: Any, args: Any) -> None:
        seen.append(1)
        if len(seen) == 2:
            os._exit(7)

    view.register_forward_pre_hook(hook)


def guard(out: dict[str, Any], key: str, function: Any) -> None:
    try:
        out[key] = function()
    except Exception:
        out.setdefault("errors", {})[key] = traceback.format_exc()


def error_of(function: Any) -> str | None:
    try:
        function()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


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


def llama_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# -------------------------------------------------------------------------------------------------
# launches
# -------------------------------------------------------------------------------------------------

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


def two_process_checks(engine: sg.Engine) -> dict[str, Any]:
    from stratagem_pp import PPStrategy

    out: dict[str, Any] = {"registered": engine.strategy.registered_name, "world": engine.world_size}
    for schedule, spr in TWO_PROCESS_SCHEDULES:
        key = f"{schedule}/{spr}"
        guard(out, key, lambda s=schedule, r=spr: train(PPStrategy(schedule=s, stages_per_rank=r), 2))
    guard(out, "meta_init", lambda: train(PPStrategy(), 2, empty_init=True))
    guard(
        out, "llama", lambda: train(PPStrategy(), 2, model_fn=make_llama, data=llama_data(), loss=llama_loss)
    )

    def bad_batch() -> str | None:
        e = sg.Engine(strategy=PPStrategy(microbatches=3), accelerator="cpu", devices=2)
        e.setup_module(make_model())
        inputs, targets = batches()[0]
        holder = e.strategy.applied["holder"]
        messages = {
            "batch": error_of(lambda: e.strategy.train_step((inputs,), targets, loss_fn)),
            "call": error_of(lambda: holder(inputs)),
            "backward": error_of(lambda: e.backward(torch.zeros((), requires_grad=True), holder)),
        }
        e.teardown()
        return messages

    guard(out, "bad_batch", bad_batch)
    out["too_many_stages"] = error_of(
        lambda: sg.Engine(
            strategy=PPStrategy(schedule="interleaved_1f1b", stages_per_rank=8), accelerator="cpu", devices=2
        ).setup_module(make_model())
    )
    return out if engine.rank == 0 else {}


def four_process_checks(engine: sg.Engine) -> dict[str, Any]:
    from stratagem_pp import PPFSDPStrategy, PPFSDPTPStrategy, PPStrategy

    out: dict[str, Any] = {"registered": engine.strategy.registered_name, "world": engine.world_size}
    guard(out, "pp4/1f1b", lambda: train(PPStrategy(schedule="1f1b"), 4))
    guard(out, "pp4/interleaved_1f1b", lambda: train(PPStrategy(schedule="interleaved_1f1b"), 4))
    guard(out, "pp_fsdp", lambda: train(PPFSDPStrategy(pipeline_parallel_size=2), 4))
    guard(out, "pp_fsdp_meta", lambda: train(PPFSDPStrategy(pipeline_parallel_size=2), 4, empty_init=True))
    guard(
        out,
        "pp_fsdp_checkpointing",
        lambda: train(PPFSDPStrategy(schedule="zero_bubble", activation_checkpointing_policy={Block}), 4),
    )
    guard(out, "pp_fsdp_resharding", lambda: train(PPFSDPStrategy(reshard_after_forward=True), 4))
    guard(
        out,
        "pp_fsdp_tp",
        lambda: train(PPFSDPTPStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, tp_plan=TP_PLAN), 4),
    )
    out["bad_size"] = error_of(
        lambda: sg.Engine(
            strategy=PPFSDPStrategy(pipeline_parallel_size=3), accelerator="cpu", devices=4
        ).setup_environment()
    )
    return out if engine.rank == 0 else {}


def dying_rank(engine: sg.Engine) -> dict[str, Any]:
    from stratagem_pp import PPStrategy

    return train(PPStrategy(schedule="1f1b"), 2, die_at=(1, 3))

"""Worker functions for the DeepSpeed tests: module-level, so that spawned workers import them.

Each runs in every process of a real 2-process gloo group with the real deepspeed package and returns plain
data for the test to check.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

STEPS = 3
LR = 1e-2
#: Per-rank micro-batch, micro-batches per step.
MICRO, ACCUMULATE = 4, 2


class Odd(torch.nn.Module):
    """Sizes that do not divide by the world size (7 * 5 = 35 weights, 5 and 3 biases): stage 3 pads them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(7, 5)
        self.fc2 = torch.nn.Linear(5, 3)
        self.register_buffer("offset", torch.full((3,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.offset


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = STEPS * ACCUMULATE * MICRO * world
    return torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)


def reference(world: int, max_norm: float) -> dict[str, Any]:
    """One process, plain torch, the global batch of each step: what the strategies must reproduce."""
    torch.manual_seed(0)
    model = Odd()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = data(world)
    size = ACCUMULATE * MICRO * world
    norms = []
    for step in range(STEPS):
        loss = F.mse_loss(model(x[step * size : (step + 1) * size]), y[step * size : (step + 1) * size])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms}


def _batches(engine: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Rank r's micro-batch j of step s: the same samples a DistributedSampler without shuffling gives it.
    x, y = data(engine.world_size)
    size = ACCUMULATE * MICRO * engine.world_size
    out = []
    for step in range(STEPS):
        xs, ys = x[step * size : (step + 1) * size], y[step * size : (step + 1) * size]
        mine = list(range(engine.rank, size, engine.world_size))
        for j in range(ACCUMULATE):
            idx = mine[j * MICRO : (j + 1) * MICRO]
            out.append((xs[idx], ys[idx]))
    return out


def train_save_consolidate(engine: Any, workdir: str, max_norm: float) -> dict[str, Any]:
    """Train with accumulation and clipping, save both formats, reload the full one into a fresh model."""
    torch.use_deterministic_algorithms(True)
    with engine.init_module():
        torch.manual_seed(0)
        model = Odd()
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    batches = _batches(engine)
    norms = []
    strategy = engine.strategy
    held: dict[str, int] = {}
    for step in range(STEPS):
        for j in range(ACCUMULATE):
            x, y = batches[step * ACCUMULATE + j]
            with engine.no_sync(model, enabled=j < ACCUMULATE - 1):
                engine.backward(F.mse_loss(model(x), y) / ACCUMULATE, model)
        # What the rank holds in the first step, as the contract counts it for the plan: gradients after
        # backward, the rest after the step.
        gradients = strategy.memory_held(model, getattr(opt, "optimizer", opt))["gradients"]
        norms.append(float(engine.clip_gradients(model, opt, max_norm)))
        opt.step()
        if step == 0:
            held = {**strategy.memory_held(model, getattr(opt, "optimizer", opt)), "gradients": gradients}
        opt.zero_grad()
    params = strategy.module_state_dict(model, full=True)
    optim = strategy.optimizer_state_dict(model, opt, full=True)
    state = {"model": model, "optimizer": opt, "step": STEPS}
    engine.save(f"{workdir}/full.ckpt", state, format="full")
    engine.save(f"{workdir}/sharded", state, format="sharded")
    with engine.init_module():
        torch.manual_seed(123)
        fresh = Odd()
    fresh, fresh_opt = engine.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR))
    rest = engine.load(f"{workdir}/full.ckpt", {"model": fresh, "optimizer": fresh_opt})
    loaded = {
        "params": strategy.module_state_dict(fresh, full=True),
        "optim": strategy.optimizer_state_dict(fresh, fresh_opt, full=True),
    }
    result = {"params": params, "optim": optim, "norms": norms, "loaded": loaded, "rest": rest, "held": held}
    return result if engine.rank == 0 else {}


def load_full(engine: Any, path: str) -> dict[str, Any]:
    """Load a full checkpoint under this (non-DeepSpeed) strategy; return what the model and optimizer hold."""
    torch.manual_seed(99)
    model = Odd()
    model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    rest = engine.load(path, {"model": model, "optimizer": opt})
    strategy = engine.strategy
    return {
        "params": strategy.module_state_dict(model, full=True),
        "optim": strategy.optimizer_state_dict(model, getattr(opt, "optimizer", opt), full=True),
        "rest": rest,
    }


# -------------------------------------------------------------------------------------------------
# a small pre-norm transformer under plain AdamW, no clipping: stages 1, 2 and 3 against one process
# -------------------------------------------------------------------------------------------------

VOCAB, WIDTH, SEQ = 32, 32, 16
TRANSFORMER_STEPS, GLOBAL_BATCH = 10, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.attn = torch.nn.MultiheadAttention(WIDTH, 2, bias=True, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(torch.nn.Module):
    """Embedding, two pre-norm blocks (attention and MLP, with biases), a final LayerNorm, an untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.ln_f = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (TRANSFORMER_STEPS * GLOBAL_BATCH, SEQ + 1), generator=g)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Summed over the positions of a sequence, averaged over sequences: gradient norms well above 1."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1), reduction="sum") / len(batch)


def transformer_reference() -> dict[str, torch.Tensor]:
    return _transformer_reference()[0]


def transformer_reference_norms() -> list[float]:
    return _transformer_reference()[1]


def _transformer_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = adamw(model.parameters())
    data = tokens()
    norms = []
    for step in range(TRANSFORMER_STEPS):
        lm_loss(model, data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def transformer_runs(engine: Any, names: list[str], workdir: str) -> dict[str, Any]:
    """Train the transformer under each named strategy in these processes; each run's parameters come back
    through a full checkpoint (the strategy's own save hook), read by rank 0."""
    import stratagem as sg

    rank, world = engine.rank, engine.world_size
    per_rank = GLOBAL_BATCH // world
    data = tokens()
    out: dict[str, Any] = {}
    for name in names:
        run = sg.Engine(strategy=name, accelerator="cpu", devices=world)
        torch.manual_seed(0)
        model = TinyTransformer()
        model, opt = run.setup(model, adamw(model.parameters()))
        for step in range(TRANSFORMER_STEPS):
            batch = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH][
                rank * per_rank : (rank + 1) * per_rank
            ]
            run.backward(lm_loss(model, batch), model)
            opt.step()
            opt.zero_grad()
        path = f"{workdir}/{name}.ckpt"
        run.save(path, {"model": model, "optimizer": opt}, format="full")
        run.barrier("saved")
        if rank == 0:
            out[name] = torch.load(path, weights_only=True)["model"]["model"]
    return out

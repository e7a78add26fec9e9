"""Worker functions for the tp tests: module-level, so that spawned workers can import them.

Each launch runs in every process of a real gloo group and batches many checks; it returns plain data from
rank 0. References are computed in the pytest process with plain torch, one process, on the global batch.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import stratagem as sg

VOCAB = 32
WIDTH = 16
HEADS = 4
SEQUENCE = 6
GLOBAL_BATCH = 8
STEPS = 10
LR = 1e-2
MAX_NORM = 1.0
#: Steps of `stratagem demo` in the 4-process launch (2 before its checkpoint, 2 after).
DEMO_STEPS = 4

#: A string plan: attention and MLP split Megatron-style, the embedding split on the vocabulary, the untied
#: head split on its outputs and gathered for the loss. LayerNorms match nothing and stay replicated.
PLAN = {
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
    def __init__(self, width: int = WIDTH, heads: int = HEADS) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q = torch.nn.Linear(width, width)
        # No key bias: softmax is invariant to it, so its true gradient is zero and AdamW would amplify the
        # rounding noise left in its place into lr-sized steps (no two summation orders agree on noise).
        self.k = torch.nn.Linear(width, width, bias=False)
        self.v = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them.
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(torch.nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(torch.nn.Module):
    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(WIDTH)
        self.attn = Attention(heads=heads)
        self.norm2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """Embedding, two attention + MLP blocks (biases, LayerNorms), a final norm and an untied head."""

    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(heads), Block(heads)])
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0, heads: int = HEADS) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(heads)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH * STEPS, SEQUENCE), generator=g)
    return torch.utils.data.TensorDataset(tokens, (tokens * 3 + 1) % VOCAB)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference(steps: int = STEPS) -> dict[str, Any]:
    """One process, plain torch, the global batch of each step: parameters and pre-clip norms."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data, norms, losses = dataset(), [], []
    for step in range(steps):
        tokens, targets = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "norms": norms,
        "losses": losses,
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def clean(name: str) -> str:
    # Wrappers' own components (activation checkpointing; DDP's "module"): this model has no module named so.
    return ".".join(p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "module"))


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters through the public API (``full_tensor`` of a DTensor): a collective."""
    return {
        clean(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for n, p in model.named_parameters()
    }


def full_optimizer(model: torch.nn.Module, opt: Any) -> dict[str, dict[str, torch.Tensor]]:
    inner = getattr(opt, "optimizer", opt)
    names = {id(p): clean(n) for n, p in model.named_parameters()}
    return {
        names[id(p)]: {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in sorted(state.items())
        }
        for p, state in inner.state.items()
    }


def train(engine: sg.Engine, model: torch.nn.Module, opt: Any, steps: int = STEPS) -> dict[str, Any]:
    mesh = engine.device_mesh
    dp = mesh["dp"].size() if "dp" in (mesh.mesh_dim_names or ()) else 1
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp, shuffle=False)
    loader = engine.setup_dataloaders(loader)
    norms, losses = [], []
    for step, (tokens, targets) in enumerate(loader):
        if step == steps:
            break
        with engine.forward_context():
            logits = model(tokens)
            loss = loss_fn(logits.float(), targets)
        engine.backward(loss, model)
        norms.append(float(engine.clip_gradients(model, opt, MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(engine.all_reduce(loss.detach(), "mean")))
    return {
        "norms": norms,
        "losses": losses,
        "sampler_replicas": getattr(loader.sampler, "num_replicas", 1),
        "output_dtype": str(logits.dtype),
        "param_dtype": str(next(iter(model.parameters())).dtype),
    }


def local_shapes(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {
        clean(n): (tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape), tuple(p.shape))
        for n, p in model.named_parameters()
    }


def run_strategy(
    strategy: Any, devices: int, *, empty_init: bool = False, precision: str = "32-true", steps: int = STEPS
) -> tuple[sg.Engine, Any, Any, dict]:
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=devices, precision=precision)
    if empty_init:
        torch.manual_seed(0)
        with engine.init_module(empty_init=True):
            model = TinyLM()
    else:
        model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = engine.setup(model, opt)
    out: dict[str, Any] = {"local_shapes": local_shapes(model), "applied": dict(engine.strategy.applied_plan)}
    out.update(train(engine, model, opt, steps))
    out["params"] = full_params(model)
    return engine, model, opt, out


def low_precision(strategy: Any, devices: int, precision: str) -> dict[str, Any]:
    run_engine, _, _, result = run_strategy(strategy, devices, precision=precision, steps=3)
    run_engine.teardown()
    return result


def error_of(function: Any) -> str | None:
    try:
        function()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def manual_parallelize(model: torch.nn.Module, mesh: Any) -> None:
    """A hand-written plan: the same split as PLAN, with torch's styles applied by the user."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        for name in ("q", "k", "v"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.out"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _guard(out: dict[str, Any], key: str, function: Any) -> None:
    try:
        out[key] = function()
    except Exception:
        out.setdefault("errors", {})[key] = traceback.format_exc()


# -------------------------------------------------------------------------------------------------
# launch A: fsdp_tp on 4 processes (2 x 2)
# -------------------------------------------------------------------------------------------------


def four_process_checks(engine: sg.Engine, workdir: str) -> dict[str, Any]:
    from stratagem.cli.demo.lm import run as demo
    from stratagem_tp import FSDPTPStrategy

    out: dict[str, Any] = {"registered": engine.strategy.registered_name, "world": engine.world_size}

    def string_plan() -> dict[str, Any]:
        strategy = FSDPTPStrategy(plan=PLAN, tensor_parallel_size=2, state_dict_type="sharded")
        run_engine, model, opt, result = run_strategy(strategy, 4)
        mesh = run_engine.device_mesh
        result["mesh"] = (tuple(mesh.shape), tuple(mesh.mesh_dim_names))
        result["placements"] = {
            clean(n): [str(p) for p in param.placements] for n, param in model.named_parameters()
        }
        path = str(Path(workdir) / "fsdp_tp_2x2")
        run_engine.save(path, {"model": model, "optimizer": opt, "step": STEPS})
        run_engine.save(path + ".pt", {"model": model, "optimizer": opt, "step": STEPS}, format="full")
        result["saved_optimizer"] = full_optimizer(model, opt)
        # What the trained 2 x 2 model predicts (every rank the same tokens): Module.load_from_checkpoint of
        # the sharded checkpoint must give it back in one process.
        with torch.no_grad():
            logits = model(dataset()[:GLOBAL_BATCH][0])
        result["probe_logits"] = (
            (logits.full_tensor() if isinstance(logits, DTensor) else logits).detach().clone()
        )
        run_engine.teardown()
        return result

    def callable_plan() -> dict[str, Any]:
        strategy = FSDPTPStrategy(parallelize=manual_parallelize, tensor_parallel_size=2)
        run_engine, _, _, result = run_strategy(strategy, 4)
        run_engine.teardown()
        return result

    def default_size() -> Any:
        strategy = FSDPTPStrategy(plan=PLAN)
        e = sg.Engine(strategy=strategy, accelerator="cpu", devices=4)
        shape = tuple(e.device_mesh.shape)
        e.teardown()
        return shape

    def meta_init_with_options() -> dict[str, Any]:
        # Deferred init, one FSDP unit per block, activation checkpointing of each block: same numbers.
        strategy = FSDPTPStrategy(
            plan=PLAN,
            tensor_parallel_size=2,
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block},
        )
        run_engine, model, _, result = run_strategy(strategy, 4, empty_init=True)
        from torch.distributed.fsdp import FSDPModule

        result["units"] = sorted(
            clean(n) or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)
        )
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        result["checkpointed"] = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
        run_engine.teardown()
        return result

    _guard(out, "string", string_plan)
    _guard(out, "callable", callable_plan)
    _guard(out, "meta_options", meta_init_with_options)
    for precision in ("bf16-mixed", "bf16-true"):
        _guard(
            out,
            precision,
            lambda p=precision: low_precision(FSDPTPStrategy(plan=PLAN, tensor_parallel_size=2), 4, p),
        )
    _guard(out, "default_mesh", default_size)
    # The demo as `stratagem demo --strategy fsdp_tp --devices 4` runs it: its model's tp_plan, the 1 x 4 mesh.
    _guard(
        out,
        "demo",
        lambda: demo(
            strategy="fsdp_tp", devices=4, steps=DEMO_STEPS, root_dir=workdir + "/demo", progress_bar=False
        ),
    )
    # `stratagem demo --strategy "fsdp_tp[tp_size=2]" --devices 4`: the name with options, a 2 x 2 mesh.
    _guard(
        out,
        "demo_2x2",
        lambda: demo(
            strategy="fsdp_tp[tp_size=2]",
            devices=4,
            steps=DEMO_STEPS,
            root_dir=workdir + "/demo-2x2",
            progress_bar=False,
        ),
    )
    out["bad_size"] = error_of(
        lambda: sg.Engine(
            strategy=FSDPTPStrategy(plan=PLAN, tensor_parallel_size=3), accelerator="cpu", devices=4
        ).setup_environment()
    )
    _guard(out, "llama", llama_checks)
    return out if engine.rank == 0 else {}


# -------------------------------------------------------------------------------------------------
# Hugging Face Llama under fsdp_tp, with its own tp plan
# -------------------------------------------------------------------------------------------------


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def make_llama(seed: int = 0) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def llama_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(64, (GLOBAL_BATCH, 8), generator=g) for _ in range(steps)]


def llama_reference(steps: int = 4) -> dict[str, Any]:
    model = make_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens in llama_batches(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses}


def llama_checks(steps: int = 4) -> dict[str, Any]:
    from stratagem_tp import FSDPTPStrategy

    engine = sg.Engine(strategy=FSDPTPStrategy(tensor_parallel_size=2), accelerator="cpu", devices=4)
    model = make_llama()
    plan = dict(model.tp_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = engine.setup(model, opt)
    dp_rank = engine.rank // 2
    losses = []
    for tokens in llama_batches(steps):
        mine = tokens[dp_rank * 4 : (dp_rank + 1) * 4]
        loss = model(input_ids=mine, labels=mine).loss
        engine.backward(loss, model)
        opt.step()
        opt.zero_grad()
        losses.append(float(engine.all_reduce(loss.detach(), "mean")))
    out = {
        "model_plan": plan,
        "applied": dict(engine.strategy.applied_plan),
        "local_shapes": local_shapes(model),
        "params": full_params(model),
        "losses": losses,
    }
    engine.teardown()
    return out


# -------------------------------------------------------------------------------------------------
# launch B: tp on 2 processes; loading the 2 x 2 checkpoint at 1 x 2 and under fsdp
# -------------------------------------------------------------------------------------------------


def two_process_checks(engine: sg.Engine, workdir: str) -> dict[str, Any]:
    from stratagem_tp import FSDPTPStrategy, TPStrategy

    out: dict[str, Any] = {"registered": engine.strategy.registered_name, "world": engine.world_size}

    def string_plan() -> dict[str, Any]:
        run_engine, _, _, result = run_strategy(TPStrategy(plan=PLAN), 2)
        mesh = run_engine.device_mesh
        result["mesh"] = (tuple(mesh.shape), tuple(mesh.mesh_dim_names))
        run_engine.teardown()
        return result

    def callable_plan() -> dict[str, Any]:
        run_engine, _, _, result = run_strategy(TPStrategy(parallelize=manual_parallelize), 2)
        run_engine.teardown()
        return result

    def meta_init() -> dict[str, Any]:
        run_engine, _, _, result = run_strategy(TPStrategy(plan=PLAN), 2, empty_init=True)
        run_engine.teardown()
        return result

    def fsdp_tp_one_by_two() -> dict[str, Any]:
        # The default size on one node of 2: a 1 x 2 mesh (FSDP over one rank, tensor parallel over two).
        run_engine, model, _, result = run_strategy(FSDPTPStrategy(plan=PLAN), 2)
        mesh = run_engine.device_mesh
        result["mesh"] = (tuple(mesh.shape), tuple(mesh.mesh_dim_names))
        result["placements"] = {
            clean(n): [str(p) for p in param.placements] for n, param in model.named_parameters()
        }
        run_engine.teardown()
        return result

    _guard(out, "string", string_plan)
    _guard(out, "callable", callable_plan)
    _guard(out, "meta_init", meta_init)
    _guard(out, "fsdp_tp_1x2", fsdp_tp_one_by_two)
    for precision in ("bf16-mixed", "bf16-true"):
        _guard(out, precision, lambda p=precision: low_precision(TPStrategy(plan=PLAN), 2, p))
    _guard(out, "errors_bad_input", bad_input_checks)
    _guard(out, "trainer", lambda: trainer_checks(workdir))
    _guard(out, "load_tp", lambda: load_checks(TPStrategy(plan=PLAN), workdir))
    _guard(out, "load_fsdp", lambda: load_checks("fsdp", workdir))
    _guard(out, "load_ddp_full", lambda: load_checks("ddp", workdir, suffix=".pt"))
    return out if engine.rank == 0 else {}


def bad_input_checks() -> dict[str, str | None]:
    from stratagem_tp import TPStrategy

    def setup(plan: Any, heads: int = HEADS) -> None:
        e = sg.Engine(strategy=TPStrategy(plan=plan), accelerator="cpu", devices=2)
        e.setup(make_model(heads=heads))

    return {
        "unknown_style": error_of(lambda: setup({**PLAN, "blocks.*.mlp.fc1": "colwize"})),
        "no_match": error_of(lambda: setup({**PLAN, "layers.*.mlp.fc1": "colwise"})),
        "heads": error_of(lambda: setup(PLAN, heads=1)),
        "not_linear": error_of(lambda: setup({"blocks.*.norm1": "colwise"})),
        "tp_size": error_of(
            lambda: sg.Engine(
                strategy=TPStrategy(plan=PLAN, tensor_parallel_size=4), accelerator="cpu", devices=2
            ).setup_environment()
        ),
    }


def load_checks(strategy: Any, workdir: str, suffix: str = "") -> dict[str, Any]:
    """Load the 2 x 2 checkpoint (sharded; ``.pt``: full) into a differently seeded model under another layout."""
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=2)
    model = make_model(seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = engine.setup(model, opt)
    rest = engine.load(str(Path(workdir) / "fsdp_tp_2x2") + suffix, {"model": model, "optimizer": opt})
    out = {"params": full_params(model), "optimizer": full_optimizer(model, opt), "rest": rest}
    engine.teardown()
    return out


class MeshAwareLM(sg.Module):
    """A Trainer module that reads the mesh in configure_model, as one that splits heads by hand would."""

    def configure_model(self) -> None:
        mesh = self.trainer.engine.device_mesh
        self.seen_mesh = (tuple(mesh.shape), tuple(mesh.mesh_dim_names))
        self.heads_per_rank = HEADS // mesh["tp"].size()
        torch.manual_seed(0)
        self.lm = TinyLM()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return loss_fn(self.lm(tokens), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def trainer_checks(workdir: str) -> dict[str, Any]:
    """``Trainer.fit`` under tp, with the plan given for the module's names and the mesh read in configure_model."""
    from stratagem.trainer import Trainer
    from stratagem_tp import TPStrategy

    plan = {f"lm.{k}": v for k, v in PLAN.items()}
    trainer = Trainer(
        strategy=TPStrategy(plan=plan),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        gradient_clip_val=MAX_NORM,
        enable_progress_bar=False,
        default_root_dir=str(Path(workdir) / "trainer"),
    )
    module = MeshAwareLM()
    trainer.fit(module, torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH))
    params = {k[len("lm.") :]: v for k, v in full_params(trainer.model).items()}
    return {"mesh": module.seen_mesh, "heads_per_rank": module.heads_per_rank, "params": params}

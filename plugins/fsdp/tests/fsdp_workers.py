"""Worker functions for the fsdp tests: module-level, so that spawned workers can import them.

Each launch runs in every process of a real gloo group and batches many checks; it returns plain data (from
rank 0) for the tests to assert on. References are computed in the pytest process in plain torch, in one
process, on the global batch, with no stratagem involved (see :func:`reference`).
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import stratagem as sg

GLOBAL_BATCH = 8
LR = 1e-2
STEPS = 4
MAX_NORM = 0.5


class Block(torch.nn.Module):
    """A residual MLP block that counts its forward calls (recomputation shows as extra calls)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, blocks: int = 3, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.blocks = torch.nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def global_batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def local_batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, micro)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def reference(steps: int = STEPS, accumulate: int = 1, clip: float | None = None) -> dict[str, Any]:
    """One process, the global batch, plain torch: parameters after ``steps`` and the pre-clip norms."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(steps):
        for micro in range(accumulate):
            x, y = global_batch(step, micro)
            (F.mse_loss(model(x), y) / accumulate).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def reference_bf16_mixed(steps: int = STEPS, world: int = 2) -> dict[str, Any]:
    """bf16-mixed as the fsdp strategy computes it, in one process: each rank's half of the batch runs forward
    (under the strategy's bfloat16 autocast) and backward on a bfloat16 copy of the float32 parameters (FSDP2's
    param_dtype); the gradients are cast to float32 and averaged (the reduce dtype); AdamW steps the float32
    parameters."""
    import copy

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            low = copy.deepcopy(model).to(torch.bfloat16)
            x, y = local_batch(step, 0, rank, world)
            # The strategy's forward context: autocast to bfloat16 around forward and loss.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(low(x.to(torch.bfloat16)).float(), y)
            loss.backward()
            for total, p in zip(grads, low.parameters()):
                total += p.grad.float()
        for p, total in zip(model.parameters(), grads):
            p.grad = total / world
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a)


def full_params(engine: sg.Engine, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gathered parameters (collective; meaningful on rank 0)."""
    state = engine.strategy.module_state_dict(model, full=True)
    names = {clean(n) for n, _ in model.named_parameters()}
    return {clean(k): v.detach().clone() for k, v in state.items() if clean(k) in names}


def units(model: torch.nn.Module) -> list[str]:
    return sorted(clean(n) or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule))


# -------------------------------------------------------------------------------------------------
# training under one strategy
# -------------------------------------------------------------------------------------------------


def train(
    strategy: Any,
    *,
    steps: int = STEPS,
    accumulate: int = 1,
    clip: float | None = None,
    precision: str = "32-true",
    probe_after_forward: bool = False,
) -> dict[str, Any]:
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=2, precision=precision)
    rank, world = engine.rank, engine.world_size
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = engine.setup(model, opt)
    out: dict[str, Any] = {"units": units(model), "norms": [], "sharded_after_forward": None}
    mesh = getattr(engine.strategy, "device_mesh", None)
    if mesh is not None:
        out["mesh"] = (tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()))
        out["placements"] = [str(p) for p in next(iter(model.parameters())).placements]
        # Each parameter's local shape against its global one: equal when replicated, split when sharded.
        out["local_vs_global"] = {
            clean(n): (tuple(p.to_local().shape), tuple(p.shape)) for n, p in model.named_parameters()
        }
    for step in range(steps):
        for micro in range(accumulate):
            x, y = local_batch(step, micro, rank, world)
            with engine.no_sync(model, enabled=micro < accumulate - 1):
                with engine.forward_context():
                    output = model(x)
                    loss = F.mse_loss(output.float(), y) / accumulate
                if probe_after_forward and step == 0:
                    # FSDP2 registers the gathered (plain) parameter while a unit is unsharded.
                    block = model.blocks[0]
                    inner = getattr(block, "_checkpoint_wrapped_module", block)
                    out["sharded_after_forward"] = isinstance(inner.fc1.weight, DTensor)
                    out["output_dtype"] = str(output.dtype)
                engine.backward(loss, model)
        if clip is not None:
            out["norms"].append(float(engine.clip_gradients(model, opt, clip)))
        opt.step()
        opt.zero_grad()
    out["params"] = full_params(engine, model)
    out["local_dtype"] = str(next(iter(model.parameters())).dtype)
    out["local_devices"] = sorted({str(p.device) for p in model.parameters()})
    out["calls"] = [b.calls for b in _blocks(model)]
    engine.teardown()
    return out


def _blocks(model: torch.nn.Module) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "stratagem-fsdp" in str(w.message)]


# -------------------------------------------------------------------------------------------------
# launch A (2 processes): sharding strategies, options, precision, init, checkpoints
# -------------------------------------------------------------------------------------------------


def two_process_checks(engine: sg.Engine, workdir: str) -> dict[str, Any]:
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    from stratagem_fsdp import FSDPStrategy

    out: dict[str, Any] = {"registered": engine.strategy.registered_name, "world": engine.world_size}
    blocks = {Block}
    out["full_shard"] = train(FSDPStrategy(auto_wrap_policy=blocks), clip=MAX_NORM, probe_after_forward=True)
    from stratagem_fsdp import _wrap as strategy_module

    out["hsdp"] = train("hsdp", clip=MAX_NORM)
    out["hsdp"]["messages"] = sorted(strategy_module._warned)
    out["shard_grad_op"] = train(
        FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="SHARD_GRAD_OP"), probe_after_forward=True
    )
    out["no_shard"] = train(FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="NO_SHARD"))
    out["root_only"] = train("fsdp")
    out["size_policy"] = train(
        FSDPStrategy(auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=500))
    )
    out["module_wrap_policy"] = train(FSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({Block})))
    out["callable_policy"] = train(FSDPStrategy(auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear)))
    out["accumulate"] = train(FSDPStrategy(auto_wrap_policy=blocks), accumulate=2)
    out["no_ac"] = train(FSDPStrategy(auto_wrap_policy=blocks), steps=2)
    out["ac"] = train(FSDPStrategy(auto_wrap_policy=blocks, activation_checkpointing_policy=blocks), steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["cpu_offload"] = train("fsdp_cpu_offload")
        out["cpu_offload_again"] = train("fsdp_cpu_offload", steps=1)
    out["cpu_offload_messages"] = _messages(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        legacy = FSDPStrategy(
            auto_wrap_policy=blocks,
            limit_all_gathers=True,
            use_orig_params=True,
            forward_prefetch=True,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        )
        out["legacy"] = train(legacy)
    out["legacy_messages"] = _messages(caught)
    out["prefetch"] = prefetch_lists(
        FSDPStrategy(auto_wrap_policy=blocks, forward_prefetch=True, backward_prefetch="BACKWARD_PRE")
    )
    out["bf16_mixed"] = train(
        FSDPStrategy(auto_wrap_policy=blocks), precision="bf16-mixed", probe_after_forward=True
    )
    out["bf16_true"] = train(FSDPStrategy(auto_wrap_policy=blocks), precision="bf16-true", steps=1)
    out["deferred_init"] = deferred_init_checks()
    out["manual_wrap"] = manual_wrap_checks()
    out["checkpoints"] = checkpoint_checks(workdir)
    return out if engine.rank == 0 else {}


def prefetch_lists(strategy: Any) -> list[tuple[int, int]]:
    """(forward, backward) prefetch targets set on each top-level unit, in module order."""
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=2)
    model = engine.setup(make_model())
    found = []
    for block in model.blocks:
        state = block._get_fsdp_state()
        found.append((len(state._states_to_forward_prefetch), len(state._states_to_backward_prefetch)))
    engine.teardown()
    return found


# -------------------------------------------------------------------------------------------------
# deferred initialisation on the meta device
# -------------------------------------------------------------------------------------------------


class Big(torch.nn.Module):
    """8 x 2048 x 2048 float32 weights: 134 MB, far above measurement noise."""

    def __init__(self, layers: int = 8, width: int = 2048) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width, bias=False) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _memory_kb() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM")}


def _peak_delta_bytes(build: Any) -> tuple[int, Any]:
    """Bytes by which the resident-set peak rises above the current size while ``build()`` runs."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _memory_kb()["VmRSS"]
    result = build()
    return (_memory_kb()["VmHWM"] - before) * 1024, result


def deferred_init_checks() -> dict[str, Any]:
    from stratagem_fsdp import FSDPStrategy

    out: dict[str, Any] = {}
    strategy = FSDPStrategy(auto_wrap_policy={torch.nn.Linear})
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=2)
    rank = engine.rank

    def meta_build() -> torch.nn.Module:
        torch.manual_seed(5)
        with engine.init_module(empty_init=True):
            big = Big()
        return engine.setup(big)

    def eager_build() -> torch.nn.Module:
        torch.manual_seed(5)
        big = Big()
        return engine.setup(big)

    out["full_bytes"] = sum(p.numel() * p.element_size() for p in Big(layers=8).to("meta").parameters())
    out["meta_peak_delta"], big = _peak_delta_bytes(meta_build)
    out["local_bytes"] = sum(p.to_local().numel() * p.element_size() for p in big.parameters())
    out["local_rows"] = sorted({p.to_local().shape[0] for p in big.parameters()})
    # Shards of one weight differ between ranks (not the same draw on every rank).
    first = big.layers[0].weight.to_local()
    sums = engine.all_gather(first.reshape(-1)[:64].clone())
    out["shards_differ"] = not torch.equal(sums[0], sums[1])
    del big
    out["eager_peak_delta"], big = _peak_delta_bytes(eager_build)
    del big
    # Values: the meta build equals an eager one-process build from the same seed (checked in the test).
    torch.manual_seed(3)
    with engine.init_module(empty_init=True):
        small = Net()
    small = engine.setup(small)
    out["small_is_meta_free"] = not any(p.is_meta for p in small.parameters())
    out["small_params"] = full_params(engine, small)
    # A model whose module has meta tensors but nothing to initialise them: a clear error, no garbage.
    with engine.init_module(empty_init=True):
        bad = torch.nn.Sequential(torch.nn.Linear(4, 4), _NoReset())
    try:
        engine.setup(bad)
        out["no_reset_error"] = None
    except Exception as error:
        out["no_reset_error"] = f"{type(error).__name__}: {error}"
    out["rank"] = rank
    engine.teardown()
    return out


class _NoReset(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


# -------------------------------------------------------------------------------------------------
# manual wrapping (stratagem.wrap in configure_model)
# -------------------------------------------------------------------------------------------------


class ManualModel(sg.Module):
    """The Lightning docs' manual-wrapping example, in stratagem."""

    def configure_model(self) -> None:
        self.linear_layer = torch.nn.Linear(32, 32)
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        linear_layer = sg.wrap(self.linear_layer)
        for i, layer in enumerate(self.block):
            self.block[i] = sg.wrap(layer)
        self.model = torch.nn.Sequential(linear_layer, torch.nn.ReLU(), self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def manual_wrap_checks() -> dict[str, Any]:
    from stratagem_fsdp import FSDPStrategy

    engine = sg.Engine(
        strategy=FSDPStrategy(auto_wrap_policy={torch.nn.Linear}), accelerator="cpu", devices=2
    )
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    model = ManualModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with engine.init_module(empty_init=True):
            model.configure_model()
            again = sg.wrap(model.linear_layer)
        out["wrap_again_same_object"] = again is model.linear_layer
        out["units_before_setup"] = units(model)
        wrapped = engine.setup(model)
        out["setup_again_same_object"] = engine.setup_module(wrapped) is wrapped
    out["units"] = units(wrapped)
    out["messages"] = _messages(caught)
    out["all_dtensor"] = all(isinstance(p, DTensor) for p in wrapped.parameters())
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    opt = engine.setup_optimizers(wrapped, opt)[0]
    losses = []
    g = torch.Generator().manual_seed(engine.rank)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    for _ in range(8):
        loss = F.mse_loss(wrapped(x), y)
        engine.backward(loss, wrapped)
        opt.step()
        opt.zero_grad()
        losses.append(float(engine.all_reduce(loss.detach(), "mean")))
    out["losses"] = losses
    engine.teardown()
    return out


# -------------------------------------------------------------------------------------------------
# checkpoints
# -------------------------------------------------------------------------------------------------


def _optimizer_full(engine: sg.Engine, model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    state = engine.strategy.optimizer_state_dict(model, getattr(opt, "optimizer", opt), full=True)
    return {clean(k): {n: t.clone() for n, t in v.items()} for k, v in (state.get("state") or {}).items()}


def checkpoint_checks(workdir: str) -> dict[str, Any]:
    """Train 2 steps, save full and sharded, train 2 more (the straight run); resume each in a fresh model."""
    from stratagem_fsdp import FSDPStrategy

    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    engine = sg.Engine(strategy=strategy, accelerator="cpu", devices=2)
    rank, world = engine.rank, engine.world_size
    out: dict[str, Any] = {"default_format": strategy.checkpoint_format}

    def build(seed: int) -> tuple[torch.nn.Module, Any]:
        model = make_model(seed)
        return engine.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))

    def steps(model: torch.nn.Module, opt: Any, start: int, count: int) -> None:
        for step in range(start, start + count):
            x, y = local_batch(step, 0, rank, world)
            engine.backward(F.mse_loss(model(x), y), model)
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    steps(model, opt, 0, 2)
    full, sharded = str(Path(workdir) / "fsdp_full.ckpt"), str(Path(workdir) / "fsdp_sharded")
    engine.save(sharded, {"model": model, "optimizer": opt, "step": 2})  # the strategy's default: sharded
    engine.save(full, {"model": model, "optimizer": opt, "step": 2}, format="full")
    out["saved_params"] = full_params(engine, model)
    out["saved_optimizer"] = _optimizer_full(engine, model, opt)
    steps(model, opt, 2, 2)
    straight = full_params(engine, model)
    for name, path in (("sharded", sharded), ("full", full)):
        fresh, fresh_opt = build(99)
        rest = engine.load(path, {"model": fresh, "optimizer": fresh_opt})
        loaded = full_params(engine, fresh)
        steps(fresh, fresh_opt, 2, 2)
        resumed = full_params(engine, fresh)
        if rank == 0:
            out[f"{name}_rest"] = rest
            out[f"{name}_loaded_diff"] = max_diff(loaded, out["saved_params"])
            out[f"{name}_resume_diff"] = max_diff(resumed, straight)
    engine.teardown()
    return out


# -------------------------------------------------------------------------------------------------
# launch B (4 processes): HYBRID_SHARD, resharding 2 -> 4
# -------------------------------------------------------------------------------------------------


def four_process_checks(engine: sg.Engine, workdir: str) -> dict[str, Any]:
    from stratagem_fsdp import FSDPStrategy

    rank, world = engine.rank, engine.world_size
    out: dict[str, Any] = {"registered": engine.strategy.registered_name, "world": world}
    strategy = engine.strategy
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = engine.setup(model, opt)
    from stratagem_fsdp import _wrap as strategy_module

    # setup_environment ran before this function: read what it warned about from the once-only record.
    out["messages"] = _messages(caught) + sorted(strategy_module._warned)
    mesh = strategy.device_mesh
    out["mesh"] = (tuple(mesh.shape), tuple(mesh.mesh_dim_names))
    out["placements"] = [str(p) for p in next(iter(model.parameters())).placements]
    norms = []
    for step in range(STEPS):
        x, y = _batch_of(step, rank, world)
        engine.backward(F.mse_loss(model(x), y), model)
        norms.append(float(engine.clip_gradients(model, opt, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    out["hsdp_params"] = full_params(engine, model)
    out["hsdp_norms"] = norms
    # Replicas agree: ranks with the same shard coordinate hold equal local shards.
    local = next(iter(model.parameters())).to_local().reshape(-1).detach()
    gathered = engine.all_gather(local.clone())
    shards = mesh.shape[1]
    out["replicas_equal"] = all(torch.equal(gathered[r], gathered[r % shards]) for r in range(world))
    hsdp_dir = str(Path(workdir) / "hsdp_sharded")
    engine.save(hsdp_dir, {"model": model, "optimizer": opt}, format="sharded")
    with torch.no_grad():  # the trained model's outputs, which Module.load_from_checkpoint must reproduce
        out["hsdp_probe"] = model(global_batch(STEPS)[0]).detach().clone()
    fresh = make_model(99)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    fresh, fresh_opt = engine.setup(fresh, fresh_opt)
    engine.load(hsdp_dir, {"model": fresh, "optimizer": fresh_opt})
    reloaded = full_params(engine, fresh)  # collective: every rank gathers
    out["hsdp_reload_diff"] = max_diff(reloaded, out["hsdp_params"]) if rank == 0 else None
    # The 2-process fsdp checkpoint, resharded to 4 processes (fsdp over all 4).
    fsdp = sg.Engine(strategy=FSDPStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=world)
    model4 = make_model(99)
    opt4 = torch.optim.AdamW(model4.parameters(), lr=LR)
    model4, opt4 = fsdp.setup(model4, opt4)
    rest = fsdp.load(str(Path(workdir) / "fsdp_sharded"), {"model": model4, "optimizer": opt4})
    out["resharded_rest"] = rest
    out["resharded_params"] = full_params(fsdp, model4)
    out["resharded_optimizer"] = _optimizer_full(fsdp, model4, opt4)
    out["resharded_local_rows"] = model4.head.weight.to_local().shape[0]
    fsdp.teardown()
    return out if rank == 0 else {}


def _batch_of(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return local_batch(step, 0, rank, world)

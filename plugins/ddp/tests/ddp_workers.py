"""Worker functions for the ddp tests: module-level, so that spawned workers can import them.

Each function runs in every process of a real 2-process gloo group and batches many checks; it returns plain
data (from rank 0) for the test to assert on. References are computed in plain torch, in one process, on the
global batch, with no stratagem involved.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import stratagem as sg

GLOBAL_BATCH = 8
LR = 0.1


class Net(torch.nn.Module):
    """A small MLP; ``unused`` adds a layer the forward never touches; ``tag`` is a buffer added to the output."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)
        self.spare = torch.nn.Linear(16, 3) if unused else None
        self.register_buffer("tag", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.tag


def make_model(unused: bool = False, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(unused=unused)


def global_batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def local_batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, micro)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)
    return {n: p.detach().float().cpu().clone() for n, p in inner.named_parameters()}


def reference(steps: int, accumulate: int = 1, unused: bool = False) -> dict[str, torch.Tensor]:
    """One process, the global batch, plain torch."""
    model = make_model(unused)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = global_batch(step, micro)
            (F.mse_loss(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return named_params(model)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def replicas_equal(engine: sg.Engine, model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = engine.all_gather(flat)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def train(
    engine: sg.Engine,
    steps: int,
    accumulate: int = 1,
    unused: bool = False,
    probe: dict[str, Any] | None = None,
) -> tuple[torch.nn.Module, Any]:
    """The stratagem loop: each rank its half of every global batch, ``no_sync`` on all but the last micro-batch."""
    model = make_model(unused)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = engine.setup(model, opt)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = local_batch(step, micro, engine.rank, engine.world_size)
            dtype = next(model.parameters()).dtype  # bf16-true trains on bf16 inputs
            x, y = x.to(dtype), y.to(dtype)
            last = micro == accumulate - 1
            with engine.no_sync(model, enabled=not last):
                with engine.forward_context():
                    loss = F.mse_loss(model(x), y) / accumulate
                engine.backward(loss, model)
            if probe is not None and step == 0:
                grad = model.module.fc1.weight.grad.clone()
                probe.setdefault("grads_equal_across_ranks", []).append(
                    all(torch.equal(grad, g) for g in engine.all_gather(grad))
                )
        opt.step()
        opt.zero_grad()
    return model, opt


def engine_with(**options: Any) -> sg.Engine:
    """An Engine over the process group that already exists, with a DDPStrategy built here."""
    from stratagem_ddp import DDPStrategy

    precision = options.pop("precision", "32-true")
    return sg.Engine(strategy=DDPStrategy(**options), accelerator="cpu", devices=2, precision=precision)


# -------------------------------------------------------------------------------------------------
# launch 1: equivalence, options, precision, checkpoints
# -------------------------------------------------------------------------------------------------


def equivalence_and_options(engine: sg.Engine, ckpt_dir: str, single_ckpt: str, expected: dict) -> dict:
    out: dict[str, Any] = {"strategy": type(engine.strategy).__name__, "registered": engine.strategy.name}

    # Training equivalence with a one-process reference on the global batch, with and without accumulation.
    model, _ = train(engine, steps=4)
    out["diff_plain"] = max_diff(named_params(model), reference(4))
    probe: dict[str, Any] = {}
    model, _ = train(engine, steps=3, accumulate=3, probe=probe)
    out["diff_accumulate"] = max_diff(named_params(model), reference(3, accumulate=3))
    out["no_sync_probe"] = probe["grads_equal_across_ranks"]

    out.update(_static_graph(engine))
    out.update(_bucket_view())
    out.update(_pass_through())
    out.update(_compression())
    out.update(_precision())
    out.update(_checkpoints(engine, ckpt_dir, single_ckpt, expected))
    return out


def _static_graph(engine: sg.Engine) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A model with a parameter it never uses: plain DDP waits for that gradient forever and refuses the next
    # step; static_graph learns the set of used parameters in the first step and trains on.
    static = engine_with(static_graph=True)
    model, _ = train(static, steps=3, unused=True)
    out["static_graph_flag"] = bool(model.static_graph)
    out["diff_static_graph"] = max_diff(named_params(model), reference(3, unused=True))
    try:
        train(engine, steps=2, unused=True)
        out["plain_unused_error"] = None
    except RuntimeError as error:
        out["plain_unused_error"] = str(error)
    return out


def _bucket_view() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag in (False, True):
        model, _ = train(engine_with(gradient_as_bucket_view=flag), steps=3)
        out[f"diff_bucket_view_{flag}"] = max_diff(named_params(model), reference(3))
        x, y = local_batch(5, 0, dist.get_rank(), 2)
        F.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        # As bucket views, the gradients of one bucket share one storage; otherwise each has its own.
        out[f"bucket_view_{flag}_storages"] = len({g.untyped_storage().data_ptr() for g in grads})
        out["n_params"] = len(grads)
    return out


def _pass_through() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # bucket_cap_mb reaches DDP: after the rebuild at step 2, a tiny cap puts every parameter in its own bucket.
    model, _ = train(engine_with(bucket_cap_mb=1e-5), steps=3)
    out["bucket_cap_bytes"] = model._get_ddp_logging_data()["bucket_cap_bytes"]
    out["n_buckets_tiny_cap"] = len(model.reducer._get_zeros_like_grad_buckets())
    out["diff_tiny_cap"] = max_diff(named_params(model), reference(3))
    # forward_sync_buffers: by default rank 0's buffers overwrite the others' before each forward.
    for flag in (True, False):
        engine = engine_with(forward_sync_buffers=flag)
        model = engine.setup(make_model())
        model.module.tag.fill_(float(dist.get_rank() + 1))
        model(torch.zeros(1, 6))
        tags = engine.all_gather(model.module.tag.clone())
        out[f"tags_broadcast_{flag}"] = [float(t[0]) for t in tags]
    return out


def _expected_fp16_average(grads: list[torch.Tensor]) -> torch.Tensor:
    # fp16 compression: each rank casts its gradient to float16 and divides by the world size; the sum is
    # taken in float16 and cast back.
    total = torch.zeros_like(grads[0], dtype=torch.float16)
    for g in grads:
        total = total + g.to(torch.float16).div_(len(grads))
    return total.to(torch.float32)


def _compression() -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank = dist.get_rank()
    x, y = local_batch(0, 0, rank, 2)
    plain = make_model()
    F.mse_loss(plain(x), y).backward()
    local = {n: p.grad.clone() for n, p in plain.named_parameters()}
    variants = {
        "fp16_hook": {"ddp_comm_hook": "default.fp16_compress_hook"},
        "fp16_wrapper": {
            "ddp_comm_hook": "default.allreduce_hook",
            "ddp_comm_wrapper": "default.fp16_compress_wrapper",
        },
        "fp32": {},
    }
    for label, options in variants.items():
        engine = engine_with(**options)
        model = engine.setup(make_model())
        F.mse_loss(model(x), y).backward()
        vs_fp16, vs_fp32 = 0.0, 0.0
        for name, p in model.module.named_parameters():
            gathered = engine.all_gather(local[name])
            fp32_mean = torch.stack(gathered).mean(0)
            vs_fp16 = max(vs_fp16, float((p.grad - _expected_fp16_average(gathered)).abs().max()))
            vs_fp32 = max(vs_fp32, float((p.grad - fp32_mean).abs().max()))
        out[f"{label}_vs_fp16"] = vs_fp16
        out[f"{label}_vs_fp32"] = vs_fp32
    return out


def _precision() -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine = engine_with(precision="bf16-mixed")
    model, _ = train(engine, steps=2)
    with engine.forward_context():
        out["bf16_mixed_output"] = str(model.module.fc1(torch.zeros(1, 6)).dtype)
    out["bf16_mixed_param"] = str(next(model.parameters()).dtype)
    out["bf16_mixed_replicas_equal"] = replicas_equal(engine, model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference(2)
    out["bf16_mixed_diff"] = max_diff(named_params(model), ref)

    engine = engine_with(precision="bf16-true")
    model, _ = train(engine, steps=2)
    out["bf16_true_param"] = str(next(model.parameters()).dtype)
    out["bf16_true_replicas_equal"] = replicas_equal(engine, model)
    return out


def _checkpoints(engine: sg.Engine, ckpt_dir: str, single_ckpt: str, expected: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, opt = train(engine, steps=2)
    path = f"{ckpt_dir}/ddp.ckpt"
    engine.save(path, {"model": model, "optimizer": opt, "step": 2})
    out["saved_params"] = named_params(model)
    momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.module.named_parameters()}

    # ddp -> ddp: a fresh replica gets the parameters and the optimizer state on every rank.
    fresh = make_model(seed=7)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.9)
    fresh, fresh_opt = engine.setup(fresh, fresh_opt)
    rest = engine.load(path, {"model": fresh, "optimizer": fresh_opt})
    same = max_diff(named_params(fresh), out["saved_params"]) == 0.0 and all(
        torch.equal(fresh_opt.state[p]["momentum_buffer"], momentum[n])
        for n, p in fresh.module.named_parameters()
    )
    out["ddp_roundtrip_all_ranks"] = [bool(v) for v in engine.all_gather(torch.tensor(same))]
    out["ddp_roundtrip_rest"] = rest

    # single_device -> ddp: every rank loads the file written by one process.
    other = engine.setup(make_model(seed=9))
    engine.load(single_ckpt, {"model": other})
    ok = max_diff(named_params(other), expected) == 0.0
    out["single_to_ddp_all_ranks"] = [bool(v) for v in engine.all_gather(torch.tensor(ok))]
    return out


# -------------------------------------------------------------------------------------------------
# launch 2: a strategy instance with backend and timeout, the registered alias, post-local SGD
# -------------------------------------------------------------------------------------------------


def group_alias_post_local(engine: sg.Engine, ckpt_dir: str) -> dict:
    out: dict[str, Any] = {"registered": engine.strategy.name}
    out["backend"] = dist.get_backend()
    out["timeout_s"] = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    alias = sg.Engine(strategy="ddp_find_unused_parameters_true", accelerator="cpu", devices=2)
    out["alias_name"] = alias.strategy.name
    model, _ = train(alias, steps=3, unused=True)
    out["alias_find_unused"] = bool(model.find_unused_parameters)
    out["alias_diff"] = max_diff(named_params(model), reference(3, unused=True))

    out.update(_post_local_sgd(ckpt_dir))
    out.update(_post_local_default_subgroup())
    return out


def _post_local_engine(start: int, period: int, **state_options: Any) -> sg.Engine:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local

    state = post_local.PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=start, **state_options
    )
    return engine_with(
        ddp_comm_hook=post_local.post_localSGD_hook, ddp_comm_state=state, model_averaging_period=period
    )


def _post_local_sgd(ckpt_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # No gradient all-reduce after the warm-up: between averages, each replica follows its own data.
    engine = _post_local_engine(start=2, period=3, post_local_gradient_allreduce=False)
    rank = engine.rank
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = engine.setup(model, opt)
    out["optimizer_type"] = type(opt.optimizer).__name__
    equal, averaged_ok = [], []
    for step in range(9):
        x, y = local_batch(step, 0, rank, 2)
        F.mse_loss(model(x), y).backward()
        # What a purely local SGD step would give on this rank, and the mean of that over ranks.
        local = torch.cat([(p - LR * p.grad).detach().reshape(-1) for p in model.parameters()])
        mean_local = torch.stack(engine.all_gather(local)).mean(0)
        opt.step()
        opt.zero_grad()
        now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        equal.append(replicas_equal(engine, model))
        averaged_ok.append(bool(torch.allclose(now, mean_local, atol=1e-6, rtol=0)))
    out["post_local_equal"] = equal
    out["post_local_is_mean_of_local_steps"] = averaged_ok
    out["averager_step"] = opt.optimizer.averager.step

    path = f"{ckpt_dir}/post_local.ckpt"
    engine.save(path, {"model": model, "optimizer": opt})
    resumed_engine = _post_local_engine(start=2, period=3, post_local_gradient_allreduce=False)
    fresh = make_model(seed=3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=LR)
    fresh, fresh_opt = resumed_engine.setup(fresh, fresh_opt)
    resumed_engine.load(path, {"model": fresh, "optimizer": fresh_opt})
    out["resumed_averager_step"] = fresh_opt.optimizer.averager.step
    out["resumed_params_equal"] = max_diff(named_params(fresh), named_params(model)) == 0.0
    out["post_local_params"] = named_params(model) if rank == 0 else None
    return out


def _post_local_default_subgroup() -> dict[str, Any]:
    # With subgroup=None, gradients keep being all-reduced within the node after the warm-up (on CPU the
    # node's processes); with both ranks on one node the replicas never part.
    engine = _post_local_engine(start=1, period=2)
    model, _ = train(engine, steps=4)
    return {
        "default_subgroup_size": dist.get_world_size(engine.strategy.config.ddp_comm_state.subgroup),
        "default_subgroup_replicas_equal": replicas_equal(engine, model),
    }

"""Worker functions for the checkpoint tests and benchmarks: importable by name, so that the elastic agent's
workers (and forked save processes) can run them.

``python ckpt_workers.py crash --format full --trials 10 --directory D`` runs the crash-safety trials and
prints their summary as JSON (benchmarks/checkpoint_crash.py runs 100).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import stratagem as sg
from stratagem import CheckpointError
from stratagem.strategies import TorchDistributedStrategy

# -------------------------------------------------------------------------------------------------
# a strategy that really shards its checkpoint state (each rank holds dim-0 shards as DTensors)
# -------------------------------------------------------------------------------------------------


def _mesh(world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def _shard(value: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    if isinstance(value, dict):
        return {k: _shard(v, mesh) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        # src_data_rank=None: every rank holds the same tensor and keeps its own chunk, no communication.
        return distribute_tensor(value.detach(), mesh, [Shard(0)], src_data_rank=None)
    return value


def _unshard(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: _unshard(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshard(v) for v in value]
    return value.full_tensor() if isinstance(value, DTensor) else value


class ShardingTestStrategy(TorchDistributedStrategy):
    """Replicated training (same data on every rank), checkpoints sharded along dim 0 across ranks."""

    checkpoint_format = "sharded"

    def module_state_dict(self, module: torch.nn.Module, *, full: bool) -> dict[str, Any]:
        sd = super().module_state_dict(module, full=full)
        return sd if full else _shard(sd, _mesh(self.world_size))

    def optimizer_state_dict(self, module: Any, optimizer: Any, *, full: bool) -> dict[str, Any]:
        osd = super().optimizer_state_dict(module, optimizer, full=full)
        if full:
            return osd
        return {**osd, "state": _shard(osd["state"], _mesh(self.world_size))}

    def load_module_state_dict(self, module: Any, state_dict: Any, *, full: bool, strict: bool) -> Any:
        return super().load_module_state_dict(module, _unshard(state_dict), full=full, strict=strict)

    def load_optimizer_state_dict(self, module: Any, optimizer: Any, state_dict: Any, *, full: bool) -> None:
        super().load_optimizer_state_dict(module, optimizer, _unshard(state_dict), full=full)


# -------------------------------------------------------------------------------------------------
# models
# -------------------------------------------------------------------------------------------------


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(steps):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fresh(seed: int = 123) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = small_model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def same_state(a: tuple[torch.nn.Module, Any], b: tuple[torch.nn.Module, Any]) -> bool:
    ma, oa = a
    mb, ob = b
    if any(not torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values())):
        return False
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k] if isinstance(sa[k][n], torch.Tensor)
    )


@contextlib.contextmanager
def file_size_limit(limit: int) -> Any:
    """Make this process's file writes past ``limit`` bytes fail with EFBIG (a real write error)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


# -------------------------------------------------------------------------------------------------
# two-process worker: failures agreed by every rank; a sharded checkpoint for resharding
# -------------------------------------------------------------------------------------------------


def _expect_failure(engine: sg.Engine, path: Path, state: dict[str, Any], fmt: str) -> str | None:
    try:
        engine.save(path, state, format=fmt)
    except CheckpointError as error:
        return str(error)
    return None


def failures_and_reshard(engine: sg.Engine, directory: str) -> dict[str, Any]:
    root = Path(directory)
    model, optimizer = trained(seed=0)  # identical on every rank
    reference = trained(seed=0)
    good = {"model": model, "optimizer": optimizer, "step": 3, "rng": sg.PerRank(torch.tensor([engine.rank]))}
    engine.save(root / "good.pt", good, format="full")
    engine.save(root / "good-dir", good, format="sharded")
    engine.barrier()

    messages: dict[str, str | None] = {}
    for fmt, name in (("full", "good.pt"), ("sharded", "good-dir")):
        bad = dict(good)
        if engine.rank == 1:
            bad["extra"] = object()  # unsaveable, on rank 1 only
        messages[f"unsaveable-{fmt}"] = _expect_failure(engine, root / name, bad, fmt)
    # A real write error on one rank: rank 1 writes shards of a sharded save, rank 0 writes a full one.
    with file_size_limit(512) if engine.rank == 1 else contextlib.nullcontext():
        messages["write-sharded"] = _expect_failure(engine, root / "good-dir", good, "sharded")
    with file_size_limit(512) if engine.rank == 0 else contextlib.nullcontext():
        messages["write-full"] = _expect_failure(engine, root / "good.pt", good, "full")

    intact = {}
    for name in ("good.pt", "good-dir"):
        restored = fresh()
        rest = engine.load(root / name, {"model": restored[0], "optimizer": restored[1]})
        intact[name] = (
            same_state(restored, reference) and rest["step"] == 3 and rest["rng"].tolist() == [engine.rank]
        )
    leftovers = sorted(p.name for p in root.iterdir())
    mine = {"messages": messages, "intact": intact, "leftovers": leftovers}
    return {"ranks": [engine.broadcast(mine, src) for src in range(engine.world_size)]}


# -------------------------------------------------------------------------------------------------
# crash safety: SIGKILL a save at a random moment, then load
# -------------------------------------------------------------------------------------------------


class Blob(torch.nn.Module):
    def __init__(self, megabytes: int, tensors: int = 16) -> None:
        super().__init__()
        numel = megabytes * 2**20 // 4 // tensors
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(numel)) for _ in range(tensors))


def _fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _version_of(engine: sg.Engine, path: Path, model: torch.nn.Module) -> int:
    """The version a whole checkpoint holds; raises if it does not load or is a mixture."""
    _fill(model, -1.0)
    rest = engine.load(path, {"model": model})
    version = rest["step"]
    for p in model.parameters():
        if not bool((p == float(version)).all()):
            raise AssertionError(f"checkpoint {path} mixes versions (step {version})")
    return int(version)


def _forked_save(engine: sg.Engine, path: Path, state: dict[str, Any], fmt: str) -> int:
    pid = os.fork()
    if pid == 0:  # the child saves and leaves without running any of the parent's cleanup
        code = 0
        try:
            engine.save(path, state, format=fmt)
        except BaseException:
            code = 3
        os._exit(code)
    return pid


def crash_trials(directory: str, fmt: str, trials: int, megabytes: int, seed: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # no thread pool to inherit across fork
    rng = random.Random(seed)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model, probe = Blob(megabytes), Blob(megabytes)
    path = root / ("ckpt.pt" if fmt == "full" else "ckpt")
    _fill(model, 0.0)
    engine.save(path, {"model": model, "step": 0}, format=fmt)
    # How long a whole save takes in a forked child, so that kills spread over all of it.
    durations = []
    for version in (0, 0):
        start = time.perf_counter()
        _, status = os.waitpid(_forked_save(engine, path, {"model": model, "step": version}, fmt), 0)
        durations.append(time.perf_counter() - start)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    duration = min(durations)
    current, killed, while_writing, after_publishing = 0, 0, 0, 0
    outcomes, errors = {"previous": 0, "new": 0}, []
    for trial in range(1, trials + 1):
        _fill(model, float(trial))
        delay = rng.uniform(0.0, 1.15 * duration)
        before = {p.name for p in root.iterdir()}
        pid = _forked_save(engine, path, {"model": model, "step": trial}, fmt)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # a child that finished is a zombie until waited: the kill is a no-op
        _, status = os.waitpid(pid, 0)
        was_killed = os.WIFSIGNALED(status)
        killed += was_killed
        left_temporary = bool({p.name for p in root.iterdir()} - before - {path.name})
        try:
            version = _version_of(engine, path, probe)
        except Exception as error:
            errors.append(
                f"trial {trial} (kill after {delay * 1000:.0f} ms): {type(error).__name__}: {error}"
            )
            continue
        if version == trial:
            outcomes["new"] += 1
            current = trial
            # Killed after the publishing rename (a sharded save's swapped-out old directory may still sit
            # under a temporary name): not a kill while writing.
            after_publishing += was_killed
        elif version == current:
            outcomes["previous"] += 1
            # Not published, and data on disk beside the checkpoint: the kill landed while writing.
            while_writing += was_killed and left_temporary
        else:
            errors.append(f"trial {trial}: loaded version {version}, expected {current} or {trial}")
    # The next uninterrupted save cleans up what the killed ones left.
    _fill(model, float(trials + 1))
    engine.save(path, {"model": model, "step": trials + 1}, format=fmt)
    final = _version_of(engine, path, probe)
    leftovers = sorted(p.name for p in root.iterdir() if p.name != path.name)
    return {
        "format": fmt,
        "trials": trials,
        "megabytes": megabytes,
        "save_ms": round(duration * 1000, 1),
        "killed_mid_save": killed,
        "killed_while_writing": while_writing,
        "killed_after_publishing": after_publishing,
        "loaded_previous": outcomes["previous"],
        "loaded_new": outcomes["new"],
        "errors": errors,
        "final_version_ok": final == trials + 1,
        "leftovers_after_clean_save": leftovers,
    }


# -------------------------------------------------------------------------------------------------
# asynchronous saves (blocking=False), in every rank of an Engine.launch
# -------------------------------------------------------------------------------------------------


def _wide_model() -> torch.nn.Module:
    # 4 x 1024 x 1024 weights: 16 MiB of parameters, 48 MiB with AdamW's state, so a save takes a while. The
    # batch norm's statistics are buffers that every forward changes, between the save and the next step.
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)], torch.nn.BatchNorm1d(1024))


def async_saves(engine: sg.Engine, root: str, failing_dir: str) -> dict[str, Any]:
    """Per format: train, save with blocking=False, keep training while the save runs (every rank takes the
    same steps: the ranks agree each step whether any is still writing), then load what was saved and compare
    it with the state at the step it was taken; then a save that fails in the background (a real EFBIG)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": engine.rank}
    for fmt in ("full", "sharded"):
        torch.manual_seed(0)
        model = _wide_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = engine.setup(model, optimizer)

        def step(model: Any = model, optimizer: Any = optimizer) -> None:
            loss = model(torch.randn(4, 1024)).pow(2).mean()
            engine.backward(loss, model)
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(2):
            step()
        # The next step's gradients first: right after save() returns, while the parameters and moments are
        # still being copied in the background, a forward changes the batch-norm statistics and the optimizer
        # steps. Neither may reach the checkpoint.
        engine.backward(model(torch.randn(4, 1024)).pow(2).mean(), model)
        at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
        moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
        path = f"{root}/async-{fmt}"
        start = time.perf_counter()
        engine.save(path, {"model": model, "optimizer": optimizer, "step": 2}, format=fmt, blocking=False)
        returned = time.perf_counter() - start
        with torch.no_grad():
            model(torch.randn(4, 1024))
        optimizer.step()
        optimizer.zero_grad()
        steps_during = 0
        while bool(engine.all_reduce(torch.tensor(float(engine.checkpoint_in_flight())), "max") > 0):
            step()
            steps_during += 1
        written = time.perf_counter() - start
        engine.wait_for_checkpoint()
        now = model.state_dict()
        changed = any(not torch.equal(now[k], at_save[k]) for k in now if not k.startswith("4."))
        buffers_changed = not torch.equal(now["4.running_mean"], at_save["4.running_mean"])
        torch.manual_seed(1)
        probe = _wide_model()
        probe_opt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
        probe, probe_opt = engine.setup(probe, probe_opt)
        rest = engine.load(path, {"model": probe, "optimizer": probe_opt})
        same = all(torch.equal(v, at_save[k]) for k, v in probe.state_dict().items())
        loaded_moments = {k: v["exp_avg"] for k, v in probe_opt.state_dict()["state"].items()}
        same_moments = moments.keys() == loaded_moments.keys() and all(
            torch.equal(moments[k], loaded_moments[k]) for k in moments
        )
        out[fmt] = {
            "returned_s": returned,
            "written_s": written,
            "steps_during_save": steps_during,
            "training_changed_params": changed,
            "training_changed_buffers": buffers_changed,
            "loaded_equals_state_at_save": same,
            "loaded_moments_equal": same_moments,
            "step": rest["step"],
        }

        # A background write that fails: the previous checkpoint at the path stays, the next save raises.
        target = Path(failing_dir) / f"fails-{fmt}{'.pt' if fmt == 'full' else ''}"
        engine.save(target, {"model": model, "step": 1}, format=fmt)
        with file_size_limit(64 * 1024):
            engine.save(target, {"model": model, "step": 2}, format=fmt, blocking=False)
            step()
            try:
                engine.save(Path(failing_dir) / f"next-{fmt}", {"model": model, "step": 3}, format=fmt)
                out[fmt]["next_save_error"] = None
            except CheckpointError as error:
                out[fmt]["next_save_error"] = str(error)
        out[fmt]["previous_intact_step"] = engine.load(target, {"model": probe})["step"]
    return {"ranks": [engine.broadcast(out, src) for src in range(engine.world_size)]}


def _store_version(engine: sg.Engine, url: str, model: torch.nn.Module) -> int:
    return _version_of(engine, url, model)  # type: ignore[arg-type]


def store_crash_trials(
    root_url: str, fmt: str, trials: int, megabytes: int, seed: int, asynchronous: bool = False
) -> dict[str, Any]:
    """SIGKILL a Trainer-style periodic save to an object store at random moments.

    Each trial forks a process that saves ``step-N`` under ``root_url/checkpoints`` as the Trainer does
    (checkpoint, then the ``last`` pointer, then pruning to 2) and kills it after a delay drawn uniformly from
    [0, 1.15 x a whole save]. Then the lookup behind ``ckpt_path="last"`` must find a checkpoint that loads
    whole, holding N-1 or N, and every prefix the lookup would accept must load whole too.
    ``asynchronous``: the saves are ``blocking=False`` (``last`` and pruning run once the background write
    has published), as with ``Trainer(async_checkpoint=True)``.
    """
    from stratagem.checkpoint import _store
    from stratagem.trainer._run_dir import (
        checkpoint_name,
        find_last_checkpoint,
        is_complete,
        prune,
        publish_last,
    )

    torch.set_num_threads(1)
    rng = random.Random(seed)
    directory = _store.join(root_url, "checkpoints")
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model, probe = Blob(megabytes), Blob(megabytes)

    def periodic_save(step: int) -> None:
        name = checkpoint_name(step, fmt)

        def published() -> None:
            publish_last(directory, name)
            prune(directory, keep=2, protect=name)

        target = _store.join(directory, name)
        if asynchronous:
            engine.save(
                target, {"model": model, "step": step}, format=fmt, blocking=False, _on_published=published
            )
            engine.wait_for_checkpoint()
        else:
            engine.save(target, {"model": model, "step": step}, format=fmt)
            published()

    def forked(step: int) -> int:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                periodic_save(step)
            except BaseException:
                code = 3
            os._exit(code)
        return pid

    _fill(model, 0.0)
    periodic_save(0)
    durations = []
    for _ in range(2):
        start = time.perf_counter()
        _, status = os.waitpid(forked(0), 0)
        durations.append(time.perf_counter() - start)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    duration = min(durations)
    current, killed = 0, 0
    outcomes, errors = {"previous": 0, "new": 0}, []
    for trial in range(1, trials + 1):
        _fill(model, float(trial))
        delay = rng.uniform(0.0, 1.15 * duration)
        pid = forked(trial)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed += os.WIFSIGNALED(status)
        try:
            found = find_last_checkpoint(directory)
            assert found is not None, "no checkpoint found"
            version = _store_version(engine, str(found), probe)
            for name in _store.children(directory):
                step = int(name.split("-")[1].split(".")[0]) if name.startswith("step-") else None
                url = _store.join(directory, name)
                if step is not None and is_complete(url) and _store_version(engine, url, probe) != step:
                    raise AssertionError(f"{name} is complete but does not hold step {step}")
        except Exception as error:
            errors.append(
                f"trial {trial} (kill after {delay * 1000:.0f} ms): {type(error).__name__}: {error}"
            )
            continue
        if version == trial:
            outcomes["new"] += 1
            current = trial
        elif version == current:
            outcomes["previous"] += 1
        else:
            errors.append(f"trial {trial}: found version {version}, expected {current} or {trial}")
    # The run goes on after its last crash: this save removes the scratch the killed ones left locally.
    periodic_save(trials + 1)
    return {
        "format": fmt,
        "asynchronous": asynchronous,
        "trials": trials,
        "megabytes": megabytes,
        "save_ms": round(duration * 1000, 1),
        "killed_mid_save": killed,
        "loaded_previous": outcomes["previous"],
        "loaded_new": outcomes["new"],
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("crash")
    p.add_argument("--format", choices=["full", "sharded"], required=True)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--megabytes", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--directory", required=True)
    p.add_argument(
        "--async", dest="asynchronous", action="store_true", help="blocking=False saves (store URLs)"
    )
    args = parser.parse_args(argv)
    if "://" in args.directory:
        result = store_crash_trials(
            args.directory, args.format, args.trials, args.megabytes, args.seed, args.asynchronous
        )
    else:
        result = crash_trials(args.directory, args.format, args.trials, args.megabytes, args.seed)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

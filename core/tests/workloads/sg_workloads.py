"""Models, a minimal gradient-averaging strategy and a training script shared by the core's tests.

Run as a script it trains with the Trainer and writes what the tests compare (parameters, optimizer state,
losses) to ``--out``; the same file is imported by tests for in-process references and by spawned workers
(``Engine.launch``), so it lives on ``sys.path`` under a name no other package uses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem import hookimpl
from stratagem.strategies import TorchDistributedStrategy

FEATURES = 6


class GradAverage(TorchDistributedStrategy):
    """Gradient averaging after each backward outside ``no_sync`` (what DDP does, without its buckets)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.syncing = True
        self.synced_backwards = 0
        self.skipped_backwards = 0

    @hookimpl
    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        loss.backward()
        if not self.syncing:
            self.skipped_backwards += 1
            return
        self.synced_backwards += 1
        if dist.is_initialized():
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> Any:
        @contextlib.contextmanager
        def paused() -> Any:
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

        return paused()


def dataset(n: int = 96, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class Regression(sg.Module):
    def __init__(
        self, dropout: float = 0.0, optimizer: str = "sgd", scheduler: bool = False, width: int = 32
    ) -> None:
        super().__init__()
        self.dropout, self.optimizer_name, self.scheduler = dropout, optimizer, scheduler
        self.width = width
        self.losses: list[float] = []
        self.extra_counter = 0

    def configure_model(self) -> None:
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, self.width),
            torch.nn.Tanh(),
            torch.nn.Dropout(self.dropout),
            torch.nn.Linear(self.width, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        # A draw from every RNG on every step: an exact resume must restore all of them.
        noise = torch.rand(()) * 1e-3 + float(torch.tensor(__import__("numpy").random.rand())) * 1e-3
        noise = noise + __import__("random").random() * 1e-3
        trainer = self.trainer
        if trainer is not None:
            torch.rand(1 + trainer.engine.rank)  # ranks' streams drift apart: each needs its own state back
        loss = torch.nn.functional.mse_loss(self(x), y) + (noise if self.dropout else 0.0)
        self.losses.append(loss.item())
        self.extra_counter += 1
        self.log("mse", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if not self.scheduler:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
        }

    def on_save_checkpoint(self, extras: dict[str, Any]) -> None:
        extras["extra_counter"] = self.extra_counter

    def on_load_checkpoint(self, extras: dict[str, Any]) -> None:
        self.extra_counter = extras["extra_counter"]


class Indexed(Regression):
    """A Regression whose batches also carry each sample's index in the data set (``indexed_dataset``): it
    notes the indices it trained on, in order."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen += index.tolist()
        return super().training_step((x, y), batch_idx)


def indexed_dataset(n: int = 64) -> TensorDataset:
    x, y = dataset(n).tensors
    return TensorDataset(x, y, torch.arange(n))


class NoisyIndices(torch.utils.data.Dataset):
    """``indexed_dataset``'s samples, each index plus a draw from the loading process's torch RNG: what a random
    augmentation draws, in a worker process when the loader has some."""

    def __init__(self, n: int = 64) -> None:
        self.data = indexed_dataset(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y, index = self.data[i]
        return x, y, index + torch.rand(())


def reference_loop(
    accumulate: int, batch: int, steps: int, clip: float | None = None
) -> dict[str, torch.Tensor]:
    """The training of the tests written out by hand in plain PyTorch, in one process on the global batch."""
    torch.manual_seed(7)
    module = Regression()
    module.configure_model()
    optimizer = module.configure_optimizers()
    batches = iter(DataLoader(dataset(), batch_size=batch))
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(batches)
            (torch.nn.functional.mse_loss(module(x), y) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _local_shards(state: dict[str, Any]) -> dict[str, Any]:
    by_param = state["state"].items()
    local = {k: {n: v.to_local() if hasattr(v, "to_local") else v for n, v in s.items()} for k, s in by_param}
    return {**state, "state": local}


def snapshot(trainer: sg.Trainer, module: Regression) -> dict[str, Any]:
    """What the tests compare, gathered to plain tensors."""
    assert trainer.model is not None
    optimizer = trainer.optimizers[0].optimizer
    return {
        # A sharded parameter (a DTensor) is gathered whole: every rank calls this.
        "params": {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()
        },
        # FSDP's optimizer state (DTensors) as each rank's own shards: a DTensor in the file would unpickle its
        # DeviceMesh where the file is read, in a process without the run's process groups, and torch warns then.
        "optimizer": _local_shards(optimizer.state_dict()),
        "losses": list(module.losses),
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "extra_counter": module.extra_counter,
        "lr": [g["lr"] for g in optimizer.param_groups],
        "world_size": trainer.engine.world_size,
        "threads": torch.get_num_threads(),
    }


def processes_mentioning(marker: str) -> list[int]:
    """Processes (other than this one) whose command line mentions ``marker``: workers left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry.name))
    return found


def make_strategy(name: str) -> Any:
    # The Trainer's `timeout` sets the process group's (and the hang watchdog's): the strategy sets none.
    return GradAverage() if name == "gradavg" else name


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="gradavg")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accumulate", type=int, nargs="+", default=[1])
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--scheduler", action="store_true")
    p.add_argument("--root", default="runs")
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--format", default=None)
    p.add_argument("--keep-last-k", type=int, default=None)
    p.add_argument("--val", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--fail", choices=["raise", "kill"], default=None)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument(
        "--faults",
        default="",
        help="ATTEMPT:RANK:STEP:HOW,... with HOW kill, raise, hang or save-kill: in restart attempt ATTEMPT "
        "(or * for every attempt), RANK fails at STEP (save-kill: dies just before publishing that step's "
        "checkpoint)",
    )
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each training step sleeps")
    p.add_argument("--launcher", default="auto")
    p.add_argument(
        "--ray-max-failures",
        type=int,
        default=None,
        help="launcher=RayLauncher(max_failures=N) (stratagem-ray)",
    )
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--ckpt-minutes", type=float, default=None)
    p.add_argument("--restart-from-scratch", action="store_true")
    p.add_argument("--async-ckpt", action="store_true", help="Trainer(async_checkpoint=True)")
    p.add_argument("--width", type=int, default=32, help="hidden units of the model")
    p.add_argument("--grace", type=float, default=30.0, help="Trainer(preemption_grace_s=...)")
    p.add_argument("--no-preemption", action="store_true", help="Trainer(preemption_signals=())")
    p.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    p.add_argument(
        "--launcher-options",
        default=None,
        help="Trainer(launcher_options=...) as key=value,... (values stay strings)",
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    torch.use_deterministic_algorithms(True)
    data = dataset()
    results = []
    for i, accumulate in enumerate(args.accumulate):
        trainer = sg.Trainer(
            strategy=make_strategy(args.strategy),
            accelerator="cpu",
            devices=args.devices,
            num_nodes=args.num_nodes,
            max_steps=args.steps,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=args.clip,
            # An object-store URL (s3://...) stays a URL; Path() would fold its "//".
            default_root_dir=f"{args.root}/run{i}" if "://" in args.root else Path(args.root) / f"run{i}",
            checkpoint_every_n_steps=args.ckpt_every,
            checkpoint_format=args.format,
            keep_last_k=args.keep_last_k,
            seed=7,
            log_every_n_steps=2,
            val_check_interval=3 if args.val else None,
            timeout=args.timeout,
            max_restarts=args.max_restarts,
            checkpoint_every_n_minutes=args.ckpt_minutes,
            restart_from_scratch=args.restart_from_scratch,
            async_checkpoint=args.async_ckpt,
            launcher=_launcher(args),
            launcher_options=_launcher_options(args.launcher_options),
            preemption_grace_s=args.grace,
            **({"preemption_signals": ()} if args.no_preemption else {}),
        )
        module = Regression(
            dropout=args.dropout, optimizer=args.optimizer, scheduler=args.scheduler, width=args.width
        )
        if args.fail is not None:
            module.training_step = _failing(module.training_step, trainer, args)  # type: ignore[method-assign]
        if args.step_sleep:
            module.training_step = _slowed(module.training_step, args.step_sleep)  # type: ignore[method-assign]
        if os.environ.get("SG_PROGRESS_DIR"):
            module.training_step = _noting_progress(module.training_step, trainer)  # type: ignore[method-assign]
        if args.faults:
            module.training_step = _scheduled_faults(module.training_step, trainer, args.faults)  # type: ignore[method-assign]
        loader = DataLoader(data, batch_size=args.batch, shuffle=args.shuffle)
        val = DataLoader(data, batch_size=16) if args.val else None
        trainer.fit(module, loader, val, ckpt_path=args.ckpt_path)
        result = snapshot(trainer, module)
        strategy = trainer.strategy
        result["synced_backwards"] = getattr(strategy, "synced_backwards", None)
        result["skipped_backwards"] = getattr(strategy, "skipped_backwards", None)
        result["logged"] = dict(trainer.logged_metrics)
        result["rank"] = trainer.engine.rank
        result["strategy"] = trainer.strategy.name
        result["node_id"] = _ray_node_id()
        result["host"] = socket.gethostname()  # where this rank ran (a host of the tests across hosts)
        results.append(result)
    # The engine's rank: under srun only SLURM_PROCID says it.
    rank = results[-1]["rank"] if results else int(os.environ.get("RANK", "0"))
    if args.out:
        torch.save(results, f"{args.out}.rank{rank}")


def _launcher(args: argparse.Namespace) -> Any:
    if args.ray_max_failures is None:
        return args.launcher
    from stratagem_ray import RayLauncher

    return RayLauncher(max_failures=args.ray_max_failures)


def _launcher_options(text: str | None) -> dict[str, str] | None:
    if not text:
        return None
    return dict(item.split("=", 1) for item in text.split(","))


def _ray_node_id() -> str | None:
    """The Ray node this worker runs on, asked of Ray from inside the worker (None outside Ray)."""
    if "ray" not in sys.modules:
        return None
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _slowed(step: Any, seconds: float) -> Any:
    def training_step(batch: Any, batch_idx: int) -> Any:
        time.sleep(seconds)
        return step(batch, batch_idx)

    return training_step


def _noting_progress(step: Any, trainer: sg.Trainer) -> Any:
    """Each rank writes ``STEPS PID`` to ``$SG_PROGRESS_DIR/rank<R>`` as a step begins (STEPS: those done so
    far), for a test to send a signal at a chosen step and to count the steps a preemption lost."""
    folder = Path(os.environ["SG_PROGRESS_DIR"])

    def training_step(batch: Any, batch_idx: int) -> Any:
        note = folder / f"rank{trainer.engine.rank}"
        note.with_suffix(".tmp").write_text(f"{trainer.global_step} {os.getpid()}")
        note.with_suffix(".tmp").replace(note)
        return step(batch, batch_idx)

    return training_step


def _scheduled_faults(step: Any, trainer: sg.Trainer, faults: str) -> Any:
    """Fail as the schedule says, in this restart attempt of the worker group only."""
    attempt = int(
        os.environ.get("STRATAGEM_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0
    )
    mine = []
    for item in faults.split(","):
        when, rank, at, how = item.split(":")
        if when in ("*", str(attempt)) and int(rank) == int(os.environ.get("RANK", "0")):
            mine.append((int(at), how))
    for at, how in mine:
        if how == "save-kill":
            _die_before_publishing(f"step-{at:06d}")

    marks = os.environ.get("SG_TIME_MARKS")  # a directory: when the kill came, when training went on
    resumed = [attempt == 0]

    def training_step(batch: Any, batch_idx: int) -> Any:
        if marks and not resumed[0] and trainer.engine.rank == 0:
            resumed[0] = True
            Path(marks, f"resumed-{attempt}").write_text(repr(time.time()))
        for at, how in mine:
            if trainer.global_step == at:
                if marks:
                    Path(marks, f"failed-{attempt}").write_text(repr(time.time()))
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == "raise":
                    raise RuntimeError(f"deliberate failure on rank {trainer.engine.rank} at step {at}")
                if how == "hang":
                    while True:
                        time.sleep(1)
        return step(batch, batch_idx)

    return training_step


def _die_before_publishing(name: str) -> None:
    """A crash in the middle of a save: the checkpoint is written but not yet renamed into place."""
    original = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(os.fspath(dst)).startswith(name):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(src, dst, *args, **kwargs)

    os.replace = replace  # type: ignore[assignment]


def _failing(step: Any, trainer: sg.Trainer, args: argparse.Namespace) -> Any:
    def training_step(batch: Any, batch_idx: int) -> Any:
        if trainer.global_step == 3 and trainer.engine.rank == args.fail_rank:
            if args.fail == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"deliberate failure on rank {trainer.engine.rank}")
        return step(batch, batch_idx)

    return training_step


# Engine.launch(fn) workers ----------------------------------------------------------------------------


def collectives_and_loop(
    engine: sg.Engine, accumulations: list[int], steps: int, batch: int
) -> dict[str, Any]:
    """Collectives, the sampler injection and a hand-written loop through the Engine, in every worker."""
    out: dict[str, Any] = {"rank": engine.rank, "world_size": engine.world_size}
    t = torch.tensor([float(engine.rank + 1)])
    out["sum"] = engine.all_reduce(t, "sum").item()
    out["mean"] = engine.all_reduce(t, "mean").item()
    out["max"] = engine.all_reduce(t, "max").item()
    out["gather"] = [g.tolist() for g in engine.all_gather(torch.arange(engine.rank + 2))]
    out["broadcast"] = engine.broadcast({"from": engine.rank}, src=1)
    engine.barrier("checks")
    loader = engine.setup_dataloaders(DataLoader(dataset(), batch_size=batch))
    out["sampler"] = type(loader.sampler).__name__
    out["indices"] = list(iter(loader.sampler))
    out["runs"] = {}
    for accumulate in accumulations:
        engine.seed_everything(7)
        module = Regression()
        with engine.init_module():
            module.configure_model()
        optimizer = module.configure_optimizers()
        model, optimizer = engine.setup(module, optimizer)
        batches = iter(loader)
        for _ in range(steps):
            for micro in range(accumulate):
                x, y = next(batches)
                with engine.no_sync(model, enabled=micro < accumulate - 1):
                    with engine.forward_context():
                        loss = torch.nn.functional.mse_loss(model(x), y)
                    engine.backward(loss / accumulate, model)
            optimizer.step()
            optimizer.zero_grad()
        out["runs"][accumulate] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out["synced"] = engine.strategy.synced_backwards
    out["skipped"] = engine.strategy.skipped_backwards
    return out


def raise_on_rank_one(engine: sg.Engine) -> None:
    engine.barrier("before")
    if engine.rank == 1:
        raise ValueError("worker one gives up")
    engine.barrier("never completes")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The Engine: strategy choice, refusing to run un-launched, and a 2-process run through Engine.launch(fn)
(collectives, sampler injection, a hand-written loop equal to one process on the global batch)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem import hookimpl
from stratagem.engine import STRATEGY_ENV
from stratagem.engine.sampler import EpochSampler
from stratagem.errors import ConfigurationError, UnknownStrategyError

WORKLOADS = Path(__file__).parent / "workloads"
sys.path.insert(0, str(WORKLOADS))
import sg_workloads as wl  # noqa: E402


def test_auto_takes_the_strategy_stratagem_run_names(monkeypatch) -> None:
    monkeypatch.delenv(STRATEGY_ENV, raising=False)
    assert sg.Engine(accelerator="cpu").strategy.name == "single_device"
    monkeypatch.setenv(STRATEGY_ENV, "no_such_strategy")
    with pytest.raises(UnknownStrategyError):
        sg.Engine(accelerator="cpu")
    # A strategy named in the script wins over the command line's.
    assert sg.Engine(strategy="single_device", accelerator="cpu").strategy.name == "single_device"


def test_a_strategy_name_takes_options_in_brackets(monkeypatch) -> None:
    """As ``stratagem compare`` and the contract suite take them: ``Trainer(strategy="fsdp_tp[tp_size=2]")``,
    ``stratagem demo --strategy ...`` and ``stratagem run --strategy ...`` (through the environment)."""
    pytest.importorskip("stratagem_ddp")
    monkeypatch.delenv(STRATEGY_ENV, raising=False)
    engine = sg.Engine(
        strategy="ddp[static_graph=true,gradient_as_bucket_view=true]", accelerator="cpu", devices=2
    )
    assert engine.needs_launch and engine.strategy_name == "ddp"
    assert (
        engine.strategy.config.static_graph is True and engine.strategy.config.gradient_as_bucket_view is True
    )
    monkeypatch.setenv(STRATEGY_ENV, "ddp_find_unused_parameters_true[static_graph=true]")
    config = sg.Engine(accelerator="cpu", devices=2).strategy.config
    assert config.static_graph is True and config.find_unused_parameters is True  # the name's own, kept
    with pytest.raises(UnknownStrategyError, match=r"Unknown strategy 'ddq'\. Did you mean 'ddp'"):
        sg.Engine(strategy="ddq[static_graph=true]", accelerator="cpu", devices=2)
    with pytest.raises(ConfigurationError, match=r"cannot read 'ddp\[static_graph=true'"):
        sg.Engine(strategy="ddp[static_graph=true", accelerator="cpu", devices=2)


def test_an_unlaunched_multi_process_engine_says_how_to_launch() -> None:
    engine = sg.Engine(strategy=wl.GradAverage(), accelerator="cpu", devices=2)
    assert engine.needs_launch
    with pytest.raises(ConfigurationError, match=r"engine\.launch"):
        engine.setup_environment()
    with pytest.raises(ConfigurationError, match="devices"):
        sg.Engine(devices=0)


def test_single_process_loop_save_and_load(tmp_path: Path) -> None:
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    engine.seed_everything(3)
    module = wl.Regression()
    with engine.init_module():
        module.configure_model()
    model, optimizer = engine.setup(module, module.configure_optimizers())
    loader = engine.setup_dataloaders(DataLoader(wl.dataset(), batch_size=8))
    # One process: one share, the whole data set in its order (the epoch's order at any world size).
    assert isinstance(loader.sampler, EpochSampler) and list(loader.sampler) == list(range(96))
    for x, y in loader:
        with engine.forward_context():
            loss = torch.nn.functional.mse_loss(model(x), y)
        engine.backward(loss)
        norm = engine.clip_gradients(model, optimizer, max_norm=1e-3)
        assert float(norm) > 0
        optimizer.step()
        optimizer.zero_grad()
    engine.save(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer, "step": 12})
    fresh = wl.Regression()
    fresh.configure_model()
    rest = engine.load(tmp_path / "c.ckpt", {"model": fresh})
    assert rest["step"] == 12
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert engine.all_reduce(2.0, "sum").item() == 2.0


def test_a_model_set_up_and_dropped_is_freed_and_one_left_is_the_one_calls_default_to() -> None:
    """The engine holds no model its caller dropped: a process that sets up model after model (a sweep, a
    benchmark's repeats) would otherwise keep the memory of every one."""
    import gc
    import weakref

    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    first = engine.setup(torch.nn.Linear(4, 4))
    gone = weakref.ref(first)
    kept = engine.setup(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigurationError, match="Several models"):
        engine.no_sync()
    del first
    gc.collect()
    assert gone() is None
    engine.backward(kept(torch.ones(1, 4)).sum())  # the one model left, without naming it
    assert kept.weight.grad is not None
    del kept
    gc.collect()
    with pytest.raises(ConfigurationError, match="No model set up is in use"):
        engine.no_sync()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_launch_runs_the_function_in_every_process(temp_dir) -> None:
    engine = sg.Engine(strategy=wl.GradAverage(), accelerator="cpu", devices=2, timeout=60)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out = engine.launch(wl.collectives_and_loop, [1, 2], 5, 4)
    assert temp_dir.left() == [], "the launch left these in the temporary directory"
    # The agent's signal handlers are gone with it: a Ctrl-C from here on is a KeyboardInterrupt again.
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert out["rank"] == 0 and out["world_size"] == 2  # rank 0's result comes back
    assert (out["sum"], out["mean"], out["max"]) == (3.0, 1.5, 2.0)
    assert out["gather"] == [[0, 1], [0, 1, 2]]
    assert out["broadcast"] == {"from": 1}
    assert out["sampler"] == "EpochSampler"
    assert out["indices"] == list(range(0, 96, 2))  # rank 0's half, in order (no shuffle asked)
    for accumulate in (1, 2):
        expected = wl.reference_loop(accumulate, batch=8, steps=5)
        for name, value in out["runs"][accumulate].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=f"{accumulate}: {name}")
    # 5 steps without accumulation + 5 steps of 2 batches: gradients synchronised once per step.
    assert (out["synced"], out["skipped"]) == (10, 5)


class OwnOptimizer:
    """What a strategy may return from ``setup_optimizers``: its own object around the user's optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class WrapsItsOptimizer(sg.SingleDeviceStrategy):
    """Customises checkpoints through the hooks alone, and needs its own optimizer object there."""

    def __init__(self) -> None:
        super().__init__()
        self.returned: list[object] = []
        self.seen: dict[str, list[object]] = {"save": [], "load": [], "step": [], "clip": []}

    @hookimpl
    def setup_optimizers(self, model, optimizers):
        self.returned = [OwnOptimizer(opt) for opt in optimizers]
        return self.returned

    @hookimpl
    def optimizer_step(self, optimizer, model) -> None:
        self.seen["step"].append(optimizer)
        optimizer.step()

    @hookimpl
    def clip_gradients(self, model, optimizer, max_norm):
        self.seen["clip"].append(optimizer)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    @hookimpl
    def save_checkpoint(self, path, state, format) -> None:
        self.seen["save"].append(state["optimizer"])
        torch.save({"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}, path)

    @hookimpl
    def load_checkpoint(self, path, state, strict):
        self.seen["load"].append(state["optimizer"])
        saved = torch.load(path, weights_only=True)
        state["model"].load_state_dict(saved["model"])
        state["optimizer"].load_state_dict(saved["optimizer"])
        return {}


def test_hooks_receive_the_optimizer_the_strategy_returned(tmp_path: Path) -> None:
    strategy = WrapsItsOptimizer()
    engine = sg.Engine(strategy=strategy, accelerator="cpu")
    module = wl.Regression()
    module.configure_model()
    model, optimizer = engine.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x, y = wl.dataset()[:8]
    engine.backward(torch.nn.functional.mse_loss(model(x), y))
    engine.clip_gradients(model, optimizer, 1.0)
    optimizer.step()
    engine.save(tmp_path / "own.ckpt", {"model": model, "optimizer": optimizer})
    engine.load(tmp_path / "own.ckpt", {"model": model, "optimizer": optimizer})
    (own,) = strategy.returned
    for hook, received in strategy.seen.items():
        assert received == [own], f"{hook} received {received!r}, not the strategy's own {own!r}"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_launch_takes_lambdas_and_closures_from_a_script(tmp_path: Path, temp_dir) -> None:
    out = tmp_path / "out.json"
    script = WORKLOADS / "launch_callables.py"
    done = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert temp_dir.left() == [], "the launches left these in the temporary directory"
    got = json.loads(out.read_text())
    assert got["writer_is_launcher"]
    assert got["rank"] == 0 and got["world_size"] == 2 and got["sum"] == 3.0
    assert got["indices"] == list(range(0, 96, 2))
    for accumulate in (1, 2):
        expected = wl.reference_loop(accumulate, batch=8, steps=5)
        for name, value in got["runs"][str(accumulate)].items():
            torch.testing.assert_close(torch.tensor(value), expected[name], rtol=0, atol=1e-5, msg=name)
    assert got["second"] == {"rank": 0, "sum": 23.0}  # (0 + 1 + 10) + (1 + 1 + 10), from the second launch


def test_launch_of_an_unpicklable_function_without_a_script_fails_before_starting(monkeypatch) -> None:
    # Under pytest there is no script the workers could re-run; from a REPL or a notebook neither.
    engine = sg.Engine(strategy=wl.GradAverage(), accelerator="cpu", devices=2)
    with pytest.raises(ConfigurationError, match="cannot be sent to worker processes") as caught:
        engine.launch(lambda e: e.rank)
    assert "python script.py" in str(caught.value) and "pytest" in str(caught.value)
    monkeypatch.setattr(sys, "argv", [""])
    with pytest.raises(ConfigurationError, match="none is running"):
        engine.launch(lambda e: e.rank)

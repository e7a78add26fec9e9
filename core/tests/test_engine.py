"""The Engine: strategy choice, refusing to run un-launched, and a 2-process run through Engine.launch(fn)
(collectives, sampler injection, a hand-written loop equal to one process on the global batch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import stratagem as sg
from stratagem.engine import STRATEGY_ENV
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
    assert not isinstance(loader.sampler, DistributedSampler)  # one process: the loader is left alone
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


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_launch_runs_the_function_in_every_process() -> None:
    engine = sg.Engine(strategy=wl.GradAverage(), accelerator="cpu", devices=2, timeout=60)
    out = engine.launch(wl.collectives_and_loop, [1, 2], 5, 4)
    assert out["rank"] == 0 and out["world_size"] == 2  # rank 0's result comes back
    assert (out["sum"], out["mean"], out["max"]) == (3.0, 1.5, 2.0)
    assert out["gather"] == [[0, 1], [0, 1, 2]]
    assert out["broadcast"] == {"from": 1}
    assert out["sampler"] == "DistributedSampler"
    assert out["indices"] == list(range(0, 96, 2))  # rank 0's half, in order (no shuffle asked)
    for accumulate in (1, 2):
        expected = wl.reference_loop(accumulate, batch=8, steps=5)
        for name, value in out["runs"][accumulate].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=f"{accumulate}: {name}")
    # 5 steps without accumulation + 5 steps of 2 batches: gradients synchronised once per step.
    assert (out["synced"], out["skipped"]) == (10, 5)

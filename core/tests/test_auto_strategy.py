"""``strategy="auto"`` with several processes takes, among the strategies that offer themselves for it, one that
fits each device's memory by a plan of the model given to ``fit`` (docs/planning.md): ``ddp`` where it fits,
``fsdp`` where only the sharded strategy does, a refusal with the plan's table where nothing does. The device
memory is set between the plan's totals (``STRATAGEM_DEVICE_MEMORY``); each run trains at 2 real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from auto_fit import Stack, loader

import stratagem as sg
from stratagem.engine._strategy_choice import DEVICE_MEMORY_ENV
from stratagem.planning import NothingFitsError, Plan, RankMemory, StrategyPlan, World, choose, plan
from stratagem.trainer._planned_module import fit_workload

SCRIPT = Path(__file__).parent / "workloads" / "auto_fit.py"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def totals() -> dict[str, int]:
    """What the largest rank of each candidate holds, planned as the Trainer plans it."""
    result = plan(fit_workload(Stack(), loader()), World(devices=2), strategies=["ddp", "fsdp"])
    found = {s.name: s.largest.total for s in result.strategies if s.largest is not None}
    assert found.keys() == {"ddp", "fsdp"}, result.strategies
    assert found["fsdp"] < found["ddp"], found  # else no memory separates them
    return found


def _fit(tmp_path: Path, memory: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, DEVICE_MEMORY_ENV: f"{memory}B"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )


def _trained(tmp_path: Path, done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "out.json").read_text())
    losses = result["losses"]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0], losses  # it trained
    return result


def test_a_model_that_fits_ddp_gets_ddp(tmp_path: Path, totals: dict[str, int]) -> None:
    done = _fit(tmp_path, totals["ddp"] + 1)
    assert _trained(tmp_path, done)["strategy"] == "ddp"
    lines = [line for line in done.stdout.splitlines() if line.startswith("strategy='auto' chose")]
    assert len(lines) == 1 and "'ddp'" in lines[0] and "the least of the 2 that fit" in lines[0], done.stdout


def test_a_model_that_fits_only_sharded_gets_fsdp(tmp_path: Path, totals: dict[str, int]) -> None:
    done = _fit(tmp_path, (totals["ddp"] + totals["fsdp"]) // 2)
    assert _trained(tmp_path, done)["strategy"] == "fsdp"
    assert "strategy='auto' chose 'fsdp', the only installed strategy that fits" in done.stdout, done.stdout


def test_a_model_that_fits_nothing_is_refused_with_the_table(
    tmp_path: Path, totals: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused in fit's checks, before the launch (which pytest's process would refuse too): no script to run.
    monkeypatch.setenv(DEVICE_MEMORY_ENV, f"{totals['fsdp'] - 1}B")
    trainer = sg.Trainer(
        strategy="auto", accelerator="cpu", devices=2, max_steps=1, loggers=[], default_root_dir=str(tmp_path)
    )
    with pytest.raises(NothingFitsError) as refused:
        trainer.fit(Stack(), loader())
    message = str(refused.value)
    assert "no installed strategy fits Stack on 2 device(s)" in message, message
    for name in ("ddp", "fsdp"):  # a row of the table each, with what it needs
        assert re.search(rf"^{name}\s+0\s+\d", message, re.M), message


def test_one_device_stays_single_device_without_a_plan() -> None:
    engine = sg.Engine(strategy="auto", accelerator="cpu", devices=1)
    assert engine.strategy_name == "single_device" and not engine.plans_auto
    assert sg.Engine(strategy="auto", accelerator="cpu", devices=2).plans_auto
    assert not sg.Engine(strategy="ddp", accelerator="cpu", devices=2).plans_auto


# -------------------------------------------------------------------------------------------------
# the rule, on plans made by hand
# -------------------------------------------------------------------------------------------------


def _strategy(name: str, total: int, sends: int | None, groups: int = 0, memory: int = 100) -> StrategyPlan:
    largest = RankMemory(rank=0, parameters=total, communication=sends, activations=0, note="reads a value")
    return StrategyPlan(name=name, status="simulated", largest=largest, fits=total <= memory, groups=groups)


def _plan(*strategies: StrategyPlan) -> Plan:
    return Plan(model="m", parameter_count=1, world=World(devices=2), memory=100, strategies=strategies)


def test_the_least_communication_wins_then_the_simpler_then_the_smaller() -> None:
    chosen = choose(_plan(_strategy("ddp", 90, 40), _strategy("fsdp", 50, 60), _strategy("big", 200, 1)))
    assert chosen.strategy.name == "ddp" and "the least of the 2 that fit" in chosen.reason
    tie = choose(_plan(_strategy("tp", 50, 40, groups=2), _strategy("ddp", 90, 40), _strategy("b", 80, 40)))
    assert tie.strategy.name == "b"  # no groups of its own, and holds less than ddp
    assert "\n" not in tie.reason


def test_unmeasured_communication_takes_the_simpler_and_says_so() -> None:
    chosen = choose(_plan(_strategy("pp", 40, None, groups=1), _strategy("ddp", 90, None)))
    assert chosen.strategy.name == "ddp"
    assert "the communication of none that fit could be measured (reads a value)" in chosen.reason


def test_nothing_fits_gives_the_table() -> None:
    with pytest.raises(NothingFitsError, match=r"(?s)no installed strategy fits m on 2 device\(s\).*\nddp\s"):
        choose(_plan(_strategy("ddp", 190, 40), _strategy("fsdp", 150, 60)))

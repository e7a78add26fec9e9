"""Runs across hosts (stratagem.contract.hosts: network namespaces with host names of their own, one shared
folder): the elastic launcher and torchrun, one launcher per host with the rendezvous on h0, train the demo's
model as the same four processes do on one host."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stratagem.contract.hosts import Host, Hosts

SCRIPT = str(Path(__file__).resolve().parent / "many_hosts_train.py")
STEPS = 6
#: One run of the launchers on both hosts, start-up included, on a busy 2-core machine.
RUN_TIMEOUT = 240
#: Each test makes up to two runs of 4 workers (torch imported 6 times each).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2 * RUN_TIMEOUT + 60)]


def _train(
    hosts: Hosts, name: str, launchers: list[tuple[Host, list[str]]], devices: int, nodes: int
) -> dict:
    root = hosts.shared / name
    out = root / "out.pt"
    script = [SCRIPT, "--devices", str(devices), "--num-nodes", str(nodes), "--steps", str(STEPS)]
    script += ["--root", str(root), "--out", str(out)]
    done = hosts.run_together(
        [(host, [*launcher, *script]) for host, launcher in launchers], timeout=RUN_TIMEOUT
    )
    for (host, _), result in zip(launchers, done):
        assert result.returncode == 0, f"{name} on {host.name}:\n{result.stdout[-4000:]}"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_host(make_hosts: Any) -> dict:
    """The reference: the same world, four processes, on one host."""
    hosts = make_hosts(2)
    run = [sys.executable, "-m", "stratagem", "run", "--devices", "4"]
    result = _train(hosts, "one-host", [(hosts[0], run)], devices=4, nodes=1)
    assert hosts.left_behind() == {}
    return result


def _assert_trained_alike(got: dict, want: dict, tolerance: float = 1e-6) -> None:
    assert got["world_size"] == want["world_size"] == 4 and got["step"] == want["step"] == STEPS
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["start"].items():
        assert torch.equal(got["start"][name], value), f"{name}: the runs started apart"
    difference = max((got["params"][k] - v).abs().max().item() for k, v in want["params"].items())
    moved = max((v - want["start"][k]).abs().max().item() for k, v in want["params"].items())
    print(f"largest difference {difference:.3g} from one host; training moved a parameter by {moved:.3g}")
    # A run that never trained would be `moved` away: a thousand times the tolerance.
    assert moved > 1000 * tolerance
    assert difference <= tolerance, f"largest difference {difference:.3g} (moved {moved:.3g})"


def test_the_elastic_launcher_on_two_hosts_trains_as_four_processes_on_one(
    stratagem_hosts: Hosts, one_host: dict
) -> None:
    h0, h1 = stratagem_hosts
    run = [sys.executable, "-m", "stratagem", "run", "--nnodes", "2", "--devices", "2"]
    run += ["--rdzv-endpoint", "h0:29400"]
    got = _train(stratagem_hosts, "elastic", [(h0, run), (h1, run)], devices=2, nodes=2)
    _assert_trained_alike(got, one_host)


def test_torchrun_on_two_hosts_trains_as_four_processes_on_one(
    stratagem_hosts: Hosts, one_host: dict
) -> None:
    h0, h1 = stratagem_hosts
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    run += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29401", "--rdzv-id", "many-hosts"]
    got = _train(stratagem_hosts, "torchrun", [(h0, run), (h1, run)], devices=2, nodes=2)
    _assert_trained_alike(got, one_host)

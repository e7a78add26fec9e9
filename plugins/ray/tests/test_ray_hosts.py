"""The ``ray`` launcher on a Ray cluster of two hosts (:mod:`stratagem.contract.hosts`): a head started with
``ray start --head`` on ``h0`` and a worker node with ``ray start --address`` on ``h1``, each in its host's
namespaces with its host's address. The driver (the training script) runs on ``h0``. Workers land on both
hosts and train as the elastic launcher's processes do; a host cut off mid-run ends the run, naming it.

One cluster serves the module (Ray's processes take tens of seconds to start here). After each test no
process but the cluster's own is left on the hosts (Ray ends a driver's workers when the driver goes) and no
host's temporary folder holds a stratagem entry. The cut-off test is the module's last: its node does not
come back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

# No access token to hand from `ray start` to its clients (the hosts' network is the tests' own).
os.environ["RAY_AUTH_MODE"] = "disabled"
pytest.importorskip("ray", reason="stratagem-ray's tests need ray (its dependency)")

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "core" / "tests" / "workloads" / "sg_workloads.py"
RAY = str(Path(sys.executable).parent / "ray")
#: Inside h0's network namespace: no other test's Ray can hold it.
PORT = 6379
#: Each node's CPUs: a worker per node.
CPUS = 1
ARGS = ["--devices", "1", "--steps", "6", "--batch", "4", "--shuffle", "--optimizer", "adamw"]
ARGS += ["--strategy", "ddp", "--timeout", "60"]
#: One launch of two workers, start-up included, on a busy 2-core machine.
RUN_TIMEOUT = 240
pytestmark = [pytest.mark.multiprocess, pytest.mark.cluster, pytest.mark.timeout(2 * RUN_TIMEOUT)]
# Ray's switch for clusters of several nodes on: test_ray.py turns it off in this process for its loopback
# clusters (ray start --address then refuses, "not supported on Windows and OSX"), and the hosts inherit it.
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
#: What a node of the cluster runs while no driver does: its daemons and idle workers of its pool.
IDLE = "ray::IDLE"

_ALIVE = """
import json, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
deadline = time.monotonic() + float(sys.argv[3])
while len([n for n in ray.nodes() if n["Alive"]]) < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.5)
print(json.dumps(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])))
"""


def _node(host: Any, temp: Path, *how: str, log: Path) -> subprocess.Popen:
    """``ray start --block`` on ``host``: its processes end with that command (and with the hosts)."""
    argv = [RAY, "start", *how, "--node-ip-address", host.address, "--num-cpus", str(CPUS)]
    # Ray's socket paths must stay under 107 bytes: a short folder of its own per node.
    argv += ["--temp-dir", str(temp / host.name), "--disable-usage-stats", "--block"]
    with open(log, "w") as file:
        return host.popen(argv, env=ENV, daemon=True, stdout=file, stderr=subprocess.STDOUT)


def alive(hosts: Any, count: int, timeout: float = 120) -> list[str]:
    """The addresses of the cluster's alive nodes, once ``count`` are (or ``timeout`` has passed)."""
    done = hosts[0].run(
        [sys.executable, "-c", _ALIVE, f"{hosts[0].address}:{PORT}", str(count), str(timeout)],
        timeout=timeout + 60,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ray_cluster(make_hosts: Any) -> Any:
    hosts = make_hosts(2)
    h0, h1 = hosts
    temp = Path(tempfile.mkdtemp(prefix="sg-rayh-"))
    logs = hosts.root / "ray-logs"
    logs.mkdir(exist_ok=True)
    nodes = [_node(h0, temp, "--head", "--port", str(PORT), "--include-dashboard", "false", log=logs / "h0")]
    try:
        nodes.append(_node(h1, temp, "--address", f"{h0.address}:{PORT}", log=logs / "h1"))
        addresses = alive(hosts, 2)
        assert addresses == [h0.address, h1.address], [p.read_text()[-2000:] for p in logs.iterdir()]
        for host in hosts:  # what `ray start` started is the cluster: its daemons
            for pid in host.pids():
                host.add_daemon(pid)
        yield hosts
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_hosts(ray_cluster: Any, stratagem_hosts: Any) -> Any:
    """The module's cluster for one test. After it, Ray has ended the driver's workers (the pool's idle ones
    are the cluster's)."""
    yield ray_cluster
    deadline = time.monotonic() + 30
    while True:
        left = {p: c for p, c in ray_cluster.left_behind(0).items() if not c.endswith(IDLE)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for host in ray_cluster:
        for pid, command in host.pids().items():
            if command == IDLE:
                host.add_daemon(pid)
    # stratagem_hosts' check follows: any other process, or stratagem scratch in a host's temporary folder,
    # fails the test.


def _train(hosts: Any, name: str, *extra: str, env: dict | None = None, check: bool = True) -> Any:
    """The workload script on h0 (the driver); its output."""
    root = hosts.shared / name
    root.mkdir()
    argv = [
        sys.executable,
        str(SCRIPT),
        *ARGS,
        "--root",
        str(root / "runs"),
        "--out",
        str(root / "out"),
        *extra,
    ]
    done = hosts[0].run(argv, timeout=RUN_TIMEOUT, cwd=root, env={**ENV, **(env or {})})
    if check:
        assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done


def _results(hosts: Any, name: str, ranks: int = 2) -> list[dict]:
    root = hosts.shared / name
    return [torch.load(root / f"out.rank{rank}", weights_only=False)[0] for rank in range(ranks)]


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5


def test_the_ray_launcher_places_a_worker_on_each_host_and_trains_as_elastic(ray_hosts: Any) -> None:
    """launcher="ray", num_nodes=2, devices=1: rank 0 on h0's Ray node (the driver's), rank 1 on h1's (each
    reports its host name and Ray node), trained to the parameters of the elastic launcher's two processes on
    one host."""
    address = {"RAY_ADDRESS": f"{ray_hosts[0].address}:{PORT}"}
    done = _train(ray_hosts, "ray", "--launcher", "ray", "--num-nodes", "2", env=address)
    on_ray = _results(ray_hosts, "ray")
    # Rank 0 (the workers' store) on the driver's node: Ray placed it on h1 at random before.
    assert [r["host"] for r in on_ray] == ["h0", "h1"], [r["host"] for r in on_ray]
    assert len({r["node_id"] for r in on_ray}) == 2 and None not in {r["node_id"] for r in on_ray}
    assert "(rank 1 pid=" in done.stdout + done.stderr  # rank 1's output reached the driver on h0
    _train(ray_hosts, "elastic", "--devices", "2")
    elastic = _results(ray_hosts, "elastic")
    for rank, (got, want) in enumerate(zip(on_ray, elastic)):
        assert got["world_size"] == 2 and got["step"] == 6, got
        assert all(int(state["step"]) == 6 for state in got["optimizer"]["state"].values())
        difference = _relative(got["params"], want["params"])
        print(f"rank {rank} on {got['host']}: relative difference {difference:.3g} from the elastic run")
        # Six AdamW steps of lr 1e-2 move the parameters far more than 1e-6 (relative): an untrained run fails.
        assert difference < 1e-6


#: The Trainer's timeout in the cut-off run (the hang watchdog's).
TIMEOUT = 15


def test_a_host_cut_off_ends_the_run_naming_it(ray_hosts: Any) -> None:
    """2 workers, one a host, checkpoints every step, RayLauncher(max_failures=1); h1's link goes down after
    step 2. Rank 0's hang watchdog names rank 1 and its host within the timeout and ends rank 0, whose report
    the launcher reads on rank 0's node; the group restarts, but Ray finds h1's node dead and no node can take
    its worker: the run ends, naming the node. Once reconnected, h1's Ray node learns that it was declared
    dead and ends, with the worker it held."""
    h0, h1 = ray_hosts
    root = ray_hosts.shared / "cut"
    root.mkdir()
    argv = [sys.executable, str(SCRIPT), *ARGS, "--num-nodes", "2", "--steps", "40", "--step-sleep", "0.3"]
    argv += ["--timeout", str(TIMEOUT), "--ckpt-every", "1", "--ray-max-failures", "1"]
    argv += ["--root", str(root / "runs"), "--out", str(root / "out")]
    log = root / "driver.log"
    env = {**ENV, "RAY_ADDRESS": f"{h0.address}:{PORT}"}
    with open(log, "w") as file:
        driver = h0.popen(argv, cwd=root, env=env, stdout=file, stderr=subprocess.STDOUT)
    mark = root / "runs" / "run0" / "checkpoints" / "step-000002.ckpt"
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while not mark.exists():
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        cut = time.monotonic()
        h1.cut()
        try:
            driver.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        ended = time.monotonic() - cut
    finally:
        h1.reconnect()
    said = log.read_text()
    print(f"the driver ended {ended:.1f} s after the cut")
    assert driver.returncode == 1, said[-6000:]
    noticed = "for rank 1 (on h1), which did not arrive at step 2. It did not answer at all: its host is lost"
    # Rank 0's watchdog report, as the launcher read it on rank 0's node (not "its process died").
    assert f"{noticed}, or cut off from this one.; restarting the workers (1 of 1 restarts)" in said, said[
        -6000:
    ]
    assert f"its Ray node h1 ({h1.address}) died: " in said and "gave up after 1 restart(s)" in said, said[
        -6000:
    ]
    assert ended < RUN_TIMEOUT / 2
    # h1's Ray node ends by itself once it hears that it is dead, and the worker it held with it.
    deadline = time.monotonic() + 120
    while h1.pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert h1.pids() == {}, h1.pids()
    assert alive(ray_hosts, 1, timeout=5) == [h0.address]

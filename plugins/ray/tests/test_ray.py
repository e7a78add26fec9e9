"""The ``ray`` launcher on real Ray clusters (CPU): the same script gives the same parameters as under torch's
elastic agent; two Ray nodes get one worker each; an existing cluster is used and left running, a local one is
started and stopped, leaving nothing in the temporary directory; a killed worker restarts the group; bad input
fails before any worker starts; the contract suite certifies the launcher.

One running two-node cluster serves the module (a Ray cluster takes seconds to start); the local-cluster test
starts its own, through the launcher.
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

import pytest
import torch

# Every Ray process of these tests on the loopback address (Ray otherwise advertises the machine's address
# and turns 127.0.0.1 into it). Read when ray is imported, here and in the processes the tests start.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Loopback-only clusters for the tests: no access token to hand from `ray start` to its clients.
os.environ["RAY_AUTH_MODE"] = "disabled"
pytest.importorskip("ray", reason="stratagem-ray's tests need ray (its dependency)")

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "core" / "tests" / "workloads" / "sg_workloads.py"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _ray_processes() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name in ("raylet", "gcs_server"):
                found.add(int(entry.name))
    return found


def _run(
    root: Path, *extra: str, env: dict[str, str] | None = None, under_run: bool = False
) -> subprocess.CompletedProcess:
    """The workload script with devices=2: as `python script.py`, or under `stratagem run --launcher ray`."""
    command = [sys.executable, str(SCRIPT), "--devices", "2", "--steps", "6", "--optimizer", "adamw"]
    command += ["--shuffle", "--root", str(root), "--out", str(root / "out"), *extra]
    if under_run:
        command[1:1] = ["-m", "stratagem", "run", "--launcher", "ray", "--devices", "2"]
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=240, env={**full_env, **(env or {})}
    )


def _result(root: Path, rank: int = 0) -> dict:
    (result,) = torch.load(f"{root / 'out'}.rank{rank}", weights_only=False)
    return result


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5


#: The module's cluster: two nodes (a head and a second raylet on this machine), three CPUs each.
NODE_CPUS, NODES = 3, 2


@pytest.fixture(scope="module")
def existing_cluster() -> str:
    """A running two-node Ray cluster that stratagem is given by its address, as a user's would be
    (``ray.cluster_utils.Cluster``: a head and a second raylet on this machine). One cluster serves the
    module: a Ray cluster takes seconds to start."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
    for _ in range(NODES - 1):
        cluster.add_node(num_cpus=NODE_CPUS)
    try:
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_same_script_gives_the_same_parameters_on_ray(
    existing_cluster: str, tmp_path: Path, strategy: str
) -> None:
    elastic = _run(tmp_path / "elastic", "--strategy", strategy)
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    if strategy == "ddp":  # the script under `stratagem run --launcher ray`
        on_ray = _run(
            tmp_path / "ray", "--strategy", strategy, env={"RAY_ADDRESS": existing_cluster}, under_run=True
        )
    else:  # Trainer(launcher="ray") in the script
        on_ray = _run(
            tmp_path / "ray",
            "--strategy",
            strategy,
            "--launcher",
            "ray",
            env={"RAY_ADDRESS": existing_cluster},
        )
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert _relative(_result(tmp_path / "ray")["params"], _result(tmp_path / "elastic")["params"]) < 1e-6
    # The workers' output reached the driver, each line led by its rank.
    assert "(rank 0 pid=" in on_ray.stdout + on_ray.stderr
    # The cluster stratagem was given is still there (asked from this process, as the placement test does: a
    # new interpreter importing ray would add seconds and check nothing more).
    import ray

    ray.init(address=existing_cluster, log_to_driver=False, configure_logging=False)
    try:
        assert ray.cluster_resources().get("CPU") == float(NODES * NODE_CPUS), ray.cluster_resources()
    finally:
        ray.shutdown()


def test_a_killed_worker_restarts_the_group_and_the_run_ends_as_if_uninterrupted(
    existing_cluster: str, tmp_path: Path
) -> None:
    env = {"RAY_ADDRESS": existing_cluster}
    plain = _run(tmp_path / "plain", "--launcher", "ray", "--ckpt-every", "2", env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = _run(
        tmp_path / "killed",
        # RayLauncher(max_failures=1): the restart is Ray's launcher's; the Trainer has max_restarts=0.
        *("--ray-max-failures", "1", "--ckpt-every", "2", "--faults", "0:1:3:kill"),
        env=env,
    )
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "rank 1 its process died" in killed.stderr and "restarting the workers (1 of 1" in killed.stderr
    got, want = _result(tmp_path / "killed")["params"], _result(tmp_path / "plain")["params"]
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bad_input_fails_before_any_worker_starts(existing_cluster: str, tmp_path: Path) -> None:
    unreachable = _run(tmp_path / "a", "--launcher", "ray", env={"RAY_ADDRESS": "127.0.0.1:9"})
    assert unreachable.returncode != 0
    assert "Ray cluster at '127.0.0.1:9' cannot be reached" in unreachable.stderr, unreachable.stderr[-2000:]
    too_many = _run(
        tmp_path / "b",
        *("--launcher", "ray", "--devices", "7", "--num-nodes", "1"),
        env={"RAY_ADDRESS": existing_cluster},
    )
    assert too_many.returncode != 0
    assert "7 worker(s) with 1 CPU each need 7 CPU; the Ray cluster has 6 CPU" in too_many.stderr, (
        too_many.stderr[-2000:]
    )
    assert not (tmp_path / "a" / "out.rank0").exists() and not (tmp_path / "b" / "out.rank0").exists()


def _rank(engine: object) -> int:
    return 0


def _refused(address: str, devices: int, num_nodes: int, timeout: float = 60.0) -> tuple[str, float]:
    """What launching on the module's cluster says, and how long it took to say it."""
    import stratagem as sg
    from stratagem.errors import ConfigurationError
    from stratagem_ray import RayLauncher

    launcher = RayLauncher(address=address, placement_timeout=timeout)
    engine = sg.Engine(
        strategy="ddp", accelerator="cpu", devices=devices, num_nodes=num_nodes, launcher=launcher
    )
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as refused:
        engine.launch(_rank)
    return str(refused.value), time.monotonic() - started


def test_a_placement_no_node_holds_fails_at_once_and_a_busy_one_after_its_timeout(
    existing_cluster: str,
) -> None:
    """6 CPUs in all, 3 per node: 4 workers on one node, or 3 nodes, fit the cluster's total but no nodes; Ray
    would keep their placement group pending (the launcher waited 60 s, then named the cluster's 6 CPUs).
    3 workers on one node fit a node, but not while 1 CPU of each is held: that waits ``placement_timeout``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from stratagem.errors import ConfigurationError
    from stratagem_ray import RayLauncher

    with pytest.raises(ConfigurationError, match=r"placement_timeout=0\): give a positive number of seconds"):
        RayLauncher(placement_timeout=0)
    ray.init(address=existing_cluster, log_to_driver=False, configure_logging=False)
    try:
        message, took = _refused(existing_cluster, devices=4, num_nodes=1)
        assert took < 10, took
        assert (
            "Ray cannot place 4 worker(s) with 4 CPU in all on one Ray node: 0 of the cluster's 2 alive node(s) can "
            "hold that, and the largest has 3 CPU (room for 3 worker(s))." in message
        ), message
        message, took = _refused(existing_cluster, devices=1, num_nodes=3)
        assert took < 10, took
        assert (
            "1 worker(s) with 1 CPU in all on each of 3 Ray nodes: 2 of the cluster's 2 alive" in message
        ), message
        assert "Ask for at most 2 node(s)" in message, message
        held = placement_group([{"CPU": 1}] * NODES, strategy="STRICT_SPREAD")
        ray.get(held.ready(), timeout=60)
        try:
            message, took = _refused(existing_cluster, devices=3, num_nodes=1, timeout=2)
        finally:
            remove_placement_group(held)
        assert 2 <= took < 12, took
        assert (
            "Ray could not place 3 worker(s) with 3 CPU in all on one Ray node within 2 s: its nodes can hold that, "
            "but other work holds the resources (free now: 4 CPU of the cluster's 6 CPU)." in message
        ), message
    finally:
        ray.shutdown()


def test_a_local_cluster_is_started_and_stopped(tmp_path: Path) -> None:
    before = _ray_processes()
    # A fresh temporary directory for the run, short enough for Ray's socket paths (at most 107 bytes).
    temp = Path(tempfile.mkdtemp(prefix="sg-ray-"))
    env = {"TMPDIR": str(temp), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    try:
        # Chosen by the environment, as STRATAGEM_STRATEGY chooses a strategy (the script says launcher="auto").
        done = _run(tmp_path / "local", env={"STRATAGEM_LAUNCHER": "ray", **env})
        assert done.returncode == 0, done.stderr[-3000:]
        time.sleep(1.0)
        assert _ray_processes() - before == set(), "the local Ray cluster was left running"
        assert "(rank 0 pid=" in done.stdout + done.stderr, "not run on Ray"
        left = sorted(str(path.relative_to(temp)) for path in temp.rglob("*"))
        assert left == [], "the run left these in the temporary directory (Ray's session folder)"
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_two_ray_nodes_get_one_worker_each(existing_cluster: str, tmp_path: Path) -> None:
    """The module's two nodes, three CPUs each: one worker per node, then two per node (a node's ranks
    together, as under torchrun; packing the four workers would put three on one node)."""
    env = {"RAY_ADDRESS": existing_cluster}
    two = _run(tmp_path / "two", "--launcher", "ray", "--devices", "1", "--num-nodes", "2", env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    four = _run(
        tmp_path / "four",
        *("--launcher", "ray", "--devices", "2", "--num-nodes", "2", "--steps", "1"),
        env=env,
    )
    assert four.returncode == 0, four.stderr[-3000:]
    nodes = {_result(tmp_path / "two", rank)["node_id"] for rank in (0, 1)}
    assert len(nodes) == 2 and None not in nodes, nodes
    by_rank = [_result(tmp_path / "four", rank)["node_id"] for rank in range(4)]
    assert by_rank[0] == by_rank[1] != by_rank[2] == by_rank[3] and None not in by_rank, by_rank
    one = _run(tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    assert _relative(_result(tmp_path / "two")["params"], _result(tmp_path / "one")["params"]) < 1e-6


def test_the_launcher_contract_certifies_ray(existing_cluster: str, tmp_path: Path) -> None:
    """The contract suite's launcher section (a function job returns rank 0's result, a raising rank is named,
    a script job gets the rank environment), as ``stratagem contract --launcher ray --report`` on the running
    cluster; ``stratagem contract --verify`` recomputes the certificate's verdict from its outcomes."""
    report = tmp_path / "certificate.json"
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "contract", "--launcher", "ray", "--report", str(report)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAY_ADDRESS": existing_cluster},
    )
    assert done.returncode == 0 and report.exists(), done.stdout[-6000:] + done.stderr[-3000:]
    [subject] = json.loads(report.read_text())["subjects"]
    assert (subject["kind"], subject["name"], subject["distribution"]) == ("launcher", "ray", "stratagem-ray")
    verified = subprocess.run(
        [sys.executable, "-m", "stratagem", "contract", "--verify", str(report)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    outcomes = {check["check"]: check["outcome"] for check in subject["checks"]}
    assert len(outcomes) >= 4 and set(outcomes.values()) == {"passed"}, outcomes

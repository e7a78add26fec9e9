"""``ft_ddp`` across two hosts (stratagem.contract.hosts: network namespaces with names of their own): a torchft
lighthouse on h0, replica group 0 on h0 and group 1 on h1, each its own ``replica_groups`` launch with its
``replica_id``. h1 is cut off the network at group 0's step 10 and never comes back: group 0 goes on to its last
step and ends naming the lost group's host."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

TRAIN = str(Path(__file__).resolve().parent / "ft_train.py")
STEPS, CUT_AT, PORT = 30, 10, 29510
RUN_TIMEOUT = 300
pytestmark = [pytest.mark.multiprocess, pytest.mark.cluster, pytest.mark.timeout(RUN_TIMEOUT + 60)]

LIGHTHOUSE = (
    "import time\n"
    "from torchft.coordination import LighthouseServer\n"
    f"server = LighthouseServer(bind='[::]:{PORT}', min_replicas=1, join_timeout_ms=5000, "
    "heartbeat_timeout_ms=5000)\n"
    "print(server.address(), flush=True)\n"
    "time.sleep(3600)\n"
)


def _steps(out: Path) -> list[dict[str, Any]]:
    path = out / "group-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def cut_run(make_hosts: Any) -> dict[str, Any]:
    hosts = make_hosts(2)
    out = hosts.shared / "cut"
    out.mkdir()
    env = {"RUST_LOG": "warn", "PYTHONWARNINGS": "ignore"}
    lighthouse = hosts[0].popen(
        [sys.executable, "-c", LIGHTHOUSE], env=env, stdout=subprocess.PIPE, text=True
    )
    address = f"http://{hosts[0].name}:{PORT}"
    launches = []
    for group in (0, 1):
        strategy = f"ft_ddp[replica_id={group},num_replica_groups=2,lighthouse={address},timeout=10]"
        argv = [TRAIN, "--strategy", strategy, "--launcher", "replica_groups", "--steps", str(STEPS)]
        argv += ["--step-sleep", "0.3", "--out", str(out)]
        launches.append(
            hosts[group].popen(
                [sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    deadline = time.monotonic() + RUN_TIMEOUT
    while len(_steps(out)) < CUT_AT and time.monotonic() < deadline and launches[0].poll() is None:
        time.sleep(0.2)
    hosts[1].cut()
    cut_at = len(_steps(out))
    try:
        output, _ = launches[0].communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        hosts[1].kill()  # the lost host never comes back
        hosts[1].reconnect()
        lighthouse.kill()
        launches[0].kill()
        for launch in (*launches, lighthouse):
            launch.communicate()
    return {
        "out": out,
        "output": output,
        "code": launches[0].returncode,
        "cut_at": cut_at,
        "host": hosts[1].name,
    }


def test_the_group_on_the_other_host_goes_on_and_names_the_lost_one(cut_run: dict[str, Any]) -> None:
    assert cut_run["code"] == 0, cut_run["output"][-4000:]
    steps = _steps(cut_run["out"])
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert cut_run["cut_at"] >= CUT_AT
    # After the cut it trains alone: its steps commit with one participant.
    alone = [r for r in steps if r["participants"] == 1]
    assert alone and alone[-1]["step"] == STEPS and alone[-1]["committed"] > cut_run["cut_at"]
    host = cut_run["host"]
    assert f"finished without replica group 1 (on {host})" in cut_run["output"], cut_run["output"][-4000:]

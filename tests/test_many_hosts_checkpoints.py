"""Checkpoints written from two hosts (:mod:`stratagem.contract.hosts`), one rank on each, into one shared folder
(full and sharded) and into S3 (moto's server on h0, reached by both hosts by name), then resumed on one host
and on two: each resumed run ends bit for bit where the run that wrote the checkpoints ended.

Three launches serve the module, each training four runs in the same processes (tests/many_hosts_checkpoints.py:
fsdp sharded and ddp full, in the shared folder and on S3): the run that writes (6 steps, checkpoints at 3 and
6), the runs resumed from step 3 on two hosts, and on one. The hosts' check after each test fails on a
stratagem scratch entry left in a host's temporary folder: full saves to S3 upload a local copy from there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

SCRIPT = str(Path(__file__).resolve().parent / "many_hosts_checkpoints.py")
#: One launch of two workers, start-up included, on a busy 2-core machine.
RUN_TIMEOUT = 240
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * RUN_TIMEOUT)]
#: Inside h0's network namespace: no other test's server can hold it.
S3_PORT = 5123
BUCKET = "ckpt"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
ENV = {"AWS_ENDPOINT_URL": f"http://h0:{S3_PORT}", **CREDENTIALS}
RENDEZVOUS_PORTS = {"write": 29511, "resume-two": 29512}
#: (strategy, format, where): where is "shared" (the hosts' shared folder) or "s3".
TARGETS = [
    ("fsdp", "sharded", "shared"),
    ("ddp", "full", "shared"),
    ("fsdp", "sharded", "s3"),
    ("ddp", "full", "s3"),
]

_CREATE_BUCKET = """
import sys, time, boto3
client = boto3.client("s3")
deadline = time.monotonic() + 60
while True:
    try:
        client.create_bucket(Bucket=sys.argv[1])
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
"""

#: What the written launch left on S3, as a host sees it: each run's checkpoint names, its `last`, and the
#: objects of its newest checkpoint.
_LIST = """
import json, sys, s3fs
fs = s3fs.S3FileSystem()
found = {}
for root in sys.argv[1:]:
    directory = root[len("s3://"):] + "/checkpoints"
    newest = fs.cat(directory + "/last").decode().strip()
    found[root] = {
        "names": sorted(p.rsplit("/", 1)[-1] for p in fs.ls(directory, refresh=True)),
        "last": newest,
        "objects": sorted(p[len(directory) + len(newest) + 2:] for p in fs.find(directory + "/" + newest)),
    }
print(json.dumps(found))
"""


def _root(hosts: Any, run: str, target: tuple[str, str, str]) -> str:
    strategy, fmt, where = target
    if where == "s3":
        return f"s3://{BUCKET}/{run}/{strategy}-{fmt}"
    return str(hosts.shared / run / f"{strategy}-{fmt}")


def _launch(hosts: Any, run: str, on: list[Any], resume_from: str | None = None) -> list[str]:
    """The four runs as one launch: one elastic launcher per host in ``on`` (two hosts: a rank on each), or
    two ranks on one host; the launchers' output."""
    out = hosts.shared / run / "out"
    out.parent.mkdir(parents=True, exist_ok=True)
    devices, nodes = (1, 2) if len(on) == 2 else (2, 1)
    launcher = [sys.executable, "-m", "stratagem", "run", "--devices", str(devices)]
    if nodes == 2:
        launcher += ["--nnodes", "2", "--rdzv-endpoint", f"h0:{RENDEZVOUS_PORTS[run]}"]
    script = [SCRIPT, "--devices", str(devices), "--num-nodes", str(nodes), "--out", str(out)]
    for target in TARGETS:
        script += ["--target", ":".join([*target[:2], _root(hosts, run, target)])]
        if resume_from is not None:
            script += ["--resume", _root(hosts, resume_from, target)]
    done = hosts.run_together([(host, [*launcher, *script]) for host in on], timeout=RUN_TIMEOUT, env=ENV)
    for host, result in zip(on, done):
        assert result.returncode == 0, f"{run} on {host.name}:\n{result.stdout[-5000:]}"
    return [result.stdout for result in done]


def _results(hosts: Any, run: str) -> list[list[dict]]:
    """``[target][rank]``: what each rank of each run ended with."""
    out = hosts.shared / run / "out"
    return [
        [torch.load(f"{out}.{i}.rank{r}", weights_only=False) for r in (0, 1)] for i in range(len(TARGETS))
    ]


@pytest.fixture(scope="module")
def written(make_hosts: Any) -> Any:
    """moto's S3 server on h0, its bucket made from h1; then the run that writes, a rank on each host."""
    hosts = make_hosts(2)
    h0, h1 = hosts
    serve = [sys.executable, "-m", "moto.server", "-H", h0.address, "-p", str(S3_PORT)]
    h0.popen(serve, daemon=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    made = h1.run([sys.executable, "-c", _CREATE_BUCKET, BUCKET], timeout=120, env=ENV)
    assert made.returncode == 0, made.stderr[-3000:]
    _launch(hosts, "write", [h0, h1])
    return hosts


def test_both_hosts_write_one_checkpoint_in_the_shared_folder_and_on_s3(
    written: Any, stratagem_hosts: Any
) -> None:
    """Each run's checkpoints at steps 3 and 6, published whole (nothing else beside them) and `last` naming
    step 6; a sharded one holds a shard from each host's rank."""
    written_by = _results(written, "write")
    for runs in written_by:
        assert [r["host"] for r in runs] == ["h0", "h1"] and all(r["step"] == 6 for r in runs)
    for target in TARGETS:
        if target[2] != "shared":
            continue
        directory = Path(_root(written, "write", target)) / "checkpoints"
        suffix = ".ckpt" if target[1] == "full" else ""
        assert sorted(p.name for p in directory.iterdir()) == [
            "last",
            f"step-000003{suffix}",
            f"step-000006{suffix}",
        ]
        assert (directory / "last").read_text().strip() == f"step-000006{suffix}"
        if target[1] == "sharded":
            shards = sorted(p.name for p in (directory / "step-000006").iterdir())
            assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt", "stratagem.json"], (
                shards
            )
    roots = [_root(written, "write", t) for t in TARGETS if t[2] == "s3"]
    listed = written[1].run([sys.executable, "-c", _LIST, *roots], timeout=120, env=ENV)
    assert listed.returncode == 0, listed.stderr[-3000:]
    on_s3 = json.loads(listed.stdout)
    sharded, full = (on_s3[root] for root in roots)
    assert sharded["names"] == ["last", "step-000003", "step-000006"] and sharded["last"] == "step-000006"
    data = {o.split("/")[0] for o in sharded["objects"] if o != "stratagem.json"}
    assert len(data) == 1 and next(iter(data)).startswith("data-"), sharded
    inside = {o.split("/", 1)[1] for o in sharded["objects"] if "/" in o}
    # Each rank's shards (several files of each rank on an object store), the index, rank 0's plain state.
    shards = {name for name in inside if re.fullmatch(r"__[01]_\d+\.distcp", name)}
    assert inside - shards == {".metadata", "state.pt"}, sharded
    assert {name.split("_")[2] for name in shards} == {"0", "1"}, sharded
    assert (
        full["names"] == ["last", "step-000003.ckpt", "step-000006.ckpt"]
        and full["last"] == "step-000006.ckpt"
    )


def _assert_resumed_exactly(resumed: list[list[dict]], want: list[list[dict]], hosts: list[str]) -> None:
    for target, runs, theirs in zip(TARGETS, resumed, want):
        for rank, (got, ref) in enumerate(zip(runs, theirs)):
            assert got["host"] == hosts[rank] and got["step"] == 6 and got["world_size"] == 2, (target, got)
            # Three steps trained after the resume, three before (restored from the checkpoint).
            assert len(got["losses"]) == 3 and got["losses"] == ref["losses"][3:], (target, rank)
            for name, value in ref["params"].items():
                assert torch.equal(got["params"][name], value), (target, rank, name)
            for key, state in ref["optimizer"]["state"].items():
                for name, value in state.items():
                    assert torch.equal(got["optimizer"]["state"][key][name], value), (target, rank, key, name)


def _assert_resumed_from_step_3(hosts: Any, said: str) -> None:
    for strategy, fmt, where in TARGETS:
        step3 = _root(hosts, "write", (strategy, fmt, where)) + "/checkpoints/step-000003"
        assert f"Resumed from {step3}{'.ckpt' if fmt == 'full' else ''} at step 3" in said, said[-3000:]


def test_resumed_on_two_hosts_the_runs_end_bit_for_bit(written: Any, stratagem_hosts: Any) -> None:
    said = _launch(written, "resume-two", [written[0], written[1]], resume_from="write")
    _assert_resumed_from_step_3(written, said[0])
    _assert_resumed_exactly(_results(written, "resume-two"), _results(written, "write"), ["h0", "h1"])


def test_resumed_on_one_host_the_runs_end_bit_for_bit(written: Any, stratagem_hosts: Any) -> None:
    """Both ranks on h1, which wrote only rank 1's shards."""
    said = _launch(written, "resume-one", [written[1]], resume_from="write")
    _assert_resumed_from_step_3(written, said[0])
    _assert_resumed_exactly(_results(written, "resume-one"), _results(written, "write"), ["h1", "h1"])

"""One training script, three ways to start it: ``python script.py`` (devices=2, stratagem launches the
workers), ``torchrun --nproc_per_node 2 script.py`` and ``stratagem run --devices 2 script.py``. The results
are identical, also as two one-process "nodes" joined by ``stratagem run --nnodes 2 --node-rank R
--rdzv-endpoint``; ``stratagem run --strategy ddp`` makes ``strategy="auto"`` pick DDP, which agrees too."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "core" / "tests" / "workloads" / "sg_workloads.py"
BIN = Path(sys.executable).parent
ARGS = ["--devices", "2", "--steps", "6", "--batch", "4", "--shuffle", "--dropout", "0.1", "--timeout", "60"]


def _two_nodes(tmp_path: Path) -> list[dict]:
    from stratagem.launchers._worker_start import free_port

    out = tmp_path / "nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    args = [str(SCRIPT), *ARGS, "--strategy", "gradavg", "--root", str(out), "--out", str(out)]
    run = [str(BIN / "stratagem"), "run", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    nodes = [
        subprocess.Popen(
            [*run, "--node-rank", str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        stdout, stderr = node.communicate(timeout=120)
        assert node.returncode == 0, stdout + stderr
    return [torch.load(f"{out}.rank{r}", weights_only=False)[0] for r in (0, 1)]


def _run(prefix: list[str], tmp_path: Path, name: str, strategy: str = "gradavg") -> list[dict]:
    out = tmp_path / name
    command = [*prefix, str(SCRIPT), *ARGS, "--strategy", strategy, "--root", str(out), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"
    return [torch.load(f"{out}.rank{r}", weights_only=False)[0] for r in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_same_script_trains_alike_under_python_torchrun_and_stratagem_run(tmp_path: Path) -> None:
    results = {
        "python": _run([sys.executable], tmp_path, "python"),
        "torchrun": _run(
            # Its log folder under tmp_path: torchrun's default is a new /tmp/torchelastic_* per run.
            [
                str(BIN / "torchrun"),
                "--standalone",
                "--nproc_per_node",
                "2",
                "--log-dir",
                str(tmp_path / "logs"),
            ],
            tmp_path,
            "torchrun",
        ),
        "stratagem run": _run([str(BIN / "stratagem"), "run", "--devices", "2"], tmp_path, "run"),
        "stratagem run, 2 nodes": _two_nodes(tmp_path),
    }
    reference = results["python"]
    for mode, ranks in results.items():
        for rank, result in enumerate(ranks):
            assert result["world_size"] == 2 and result["rank"] == rank and result["step"] == 6, mode
            assert result["losses"] == reference[rank]["losses"], mode
            for name, value in result["params"].items():
                assert torch.equal(value, reference[rank]["params"][name]), (mode, name)
    if importlib.util.find_spec("stratagem_ddp") is None:
        pytest.skip("the stratagem run --strategy check needs stratagem-ddp installed")
    ddp = _run(
        [str(BIN / "stratagem"), "run", "--strategy", "ddp", "--devices", "2"], tmp_path, "ddp", "auto"
    )
    for rank, result in enumerate(ddp):
        assert result["strategy"] == "ddp"
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference[rank]["params"][name], rtol=0, atol=1e-5, msg=name)

"""Every strategy of the repository's plugin packages, certified by the contract suite as a user would run it.

One ``stratagem contract NAME`` per strategy (new processes, the installed packages), so a failure names the
strategy. A skipped check must name the capability that excludes it; anything else is a failure.
(``single_device`` is certified in core's own tests, ``local_sgd`` in the example package's.)
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from stratagem import get_registry
from stratagem.contract._checks import skipped_declaration

PACKAGES = ("stratagem-ddp", "stratagem-fsdp", "stratagem-deepspeed", "stratagem-tp")
NAMES = sorted(info.name for info in get_registry() if info.plugin.distribution in PACKAGES)


def test_every_repository_package_registered_strategies() -> None:
    found = {info.plugin.distribution for info in get_registry() if info.name in NAMES}
    assert found == set(PACKAGES), f"installed repository packages with strategies: {sorted(found)}"


#: Configurations certified besides the names' defaults: fsdp_tp's default on one node of 4 is a 1 x 4 mesh
#: (tensor parallel over every rank), so the 2 x 2 mesh is certified as a variant.
VARIANTS = ["fsdp_tp[tensor_parallel_size=2]"]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NAMES + VARIANTS)
def test_certified(name: str, tmp_path: Path) -> None:
    junit = tmp_path / "report.xml"
    completed = subprocess.run(
        [sys.executable, "-m", "stratagem", "contract", name, f"--pytest-args=--junitxml={junit}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-3000:]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert cases, "the suite ran no check"
    caps = get_registry().get(name.split("[")[0]).capabilities
    declared = {
        "checkpoint_formats": caps.checkpoint_formats,
        "precisions": caps.precisions,
        "accelerators": caps.accelerators,
    }
    for case in cases:
        skipped = case.find("skipped")
        if skipped is not None:
            reason = skipped.get("message", "")
            found = skipped_declaration(reason)
            assert found is not None, (
                f"{case.get('name')} skipped for a reason no declaration gives: {reason}"
            )
            capability, value = found
            # The declaration it names really lacks that value.
            assert capability in declared and ast.literal_eval(value) not in declared[capability], reason


#: stratagem-pp's strategies, and ``pp`` with each schedule torch offers, certified together: the names of
#: one world size share their two launches (``--share-launches``), so that the seven configurations of
#: ``pp`` cost two launches rather than fourteen.
PIPELINE_SCHEDULES = (
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "zero_bubble",
    "zbv_zero_bubble",
    "dual_pipe_v",
)
PIPELINES = ["pp", *(f"pp[schedule={s}]" for s in PIPELINE_SCHEDULES), "pp_fsdp"]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not any(info.plugin.distribution == "stratagem-pp" for info in get_registry()),
    reason="needs stratagem-pp installed",
)
def test_pipelines_certified(tmp_path: Path) -> None:
    from stratagem_pp import SCHEDULES

    # Every schedule is certified: 1f1b is pp's default.
    assert {"1f1b", *PIPELINE_SCHEDULES} == set(SCHEDULES)
    junit = tmp_path / "report.xml"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratagem",
            "contract",
            *PIPELINES,
            "--share-launches",
            f"--pytest-args=--junitxml={junit}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-3000:]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    for name in PIPELINES:
        mine = [c for c in cases if f"[{name}]" in c.get("name", "") or f"[{name}-" in c.get("name", "")]
        assert len(mine) >= 15, f"{name}: {len(mine)} checks ran"
        assert not [c for c in mine if c.find("skipped") is not None], f"{name}: a check was skipped"


LAUNCHER_PACKAGES = ("stratagem", "stratagem-ray")
LAUNCHERS = sorted(
    name for name, info in get_registry().launchers.items() if info.plugin.distribution in LAUNCHER_PACKAGES
)


def test_every_repository_launcher_is_certified() -> None:
    assert set(LAUNCHERS) >= {"elastic", "ray"}, f"launchers of the repository's packages: {LAUNCHERS}"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_certified(name: str, tmp_path: Path) -> None:
    junit = tmp_path / "report.xml"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratagem",
            "contract",
            "--launcher",
            name,
            f"--pytest-args=--junitxml={junit}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=580,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
    )
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-3000:]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert len(cases) >= 4, f"the launcher section ran {len(cases)} checks"
    assert not [c for c in cases if c.find("skipped") is not None], "a launcher check was skipped"

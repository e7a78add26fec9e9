"""The plugin's own tests: its options, and certification by stratagem's contract suite."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest


def test_registered_through_the_entry_point() -> None:
    from stratagem import get_registry

    info = get_registry().get("local_sgd")
    assert info.plugin.distribution == "stratagem-localsgd"
    assert info.capabilities.checkpoint_formats == {"full", "sharded"}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_sync_every_must_be_a_positive_whole_number(bad: object) -> None:
    from stratagem_localsgd.strategy import LocalSGDStrategy

    with pytest.raises(ValueError, match=r"sync_every=.*whole number of optimizer steps >= 1"):
        LocalSGDStrategy(sync_every=bad)


def test_only_synchronous_mode_claims_equivalence() -> None:
    from stratagem_localsgd.strategy import LocalSGDStrategy

    assert LocalSGDStrategy().contract_tolerance == 1e-5
    assert LocalSGDStrategy(sync_every=4).contract_tolerance is None


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_certified_by_the_contract_suite(tmp_path: Path) -> None:
    junit = tmp_path / "report.xml"
    cli = "import sys; from stratagem.cli import main; sys.exit(main())"
    completed = subprocess.run(
        [sys.executable, "-c", cli, "contract", "local_sgd", f"--pytest-args=--junitxml={junit}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-2000:]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    skipped = [c.get("name") for c in cases if c.find("skipped") is not None]
    assert len(cases) >= 19 and not skipped, (len(cases), skipped)
    # No compile code in the strategy, and the compile section certifies it all the same.
    compiled = [c.get("name") for c in cases if c.get("classname", "").endswith("test_compile")]
    assert len(compiled) == 4, compiled

"""Every strategy of the repository's plugin packages, certified by the contract suite as a user would run it.

Each family is certified by one ``stratagem contract NAME... --share-launches --report FILE`` (new processes,
the installed packages): the strategies of one world size share the suite's two worker launches, and the
certificate records every check of every strategy. One test per strategy then reads its own part of the
certificate, so a failure names the strategy and its failed checks. A skipped check must be justified by a
declaration the strategy really makes (the certificate's verdict is recomputed from its outcomes); anything
else is a failure. (``single_device`` is certified in core's own tests, ``local_sgd`` in the example
package's.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stratagem import get_registry
from stratagem.contract import _certificate as certificate

FAMILIES = {
    "torch": ("stratagem-ddp", "stratagem-fsdp", "stratagem-tp"),
    # A family of its own: DeepSpeed patches torch in the processes it runs in.
    "deepspeed": ("stratagem-deepspeed",),
    # The strategies that run the step themselves.
    "pipelines": ("stratagem-pp",),
}
#: Names registered twice for one configuration: ``deepspeed`` is stage 2 with no other option. The alias is
#: certified through the name it equals (checked below), not a second time.
ALIASES = {"deepspeed": "deepspeed_stage_2"}
#: Configurations certified besides the names' defaults: fsdp_tp's default on one node of 4 is a 1 x 4 mesh
#: (tensor parallel over every rank), so the 2 x 2 mesh is certified as a variant.
VARIANTS = {"torch": ["fsdp_tp[tensor_parallel_size=2]"]}
#: The pipeline family: ``pp`` with its default schedule (1f1b) and with every other schedule it offers (those
#: with several stages per rank split the suite's model into four stages), and the 2-D and 3-D meshes.
PIPELINE_SCHEDULES = (
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "zero_bubble",
    "zbv_zero_bubble",
    "dual_pipe_v",
)


def test_every_pipeline_schedule_is_certified() -> None:
    pp = pytest.importorskip("stratagem_pp", reason="stratagem-pp is not installed")
    assert set(pp.SCHEDULES) == {"1f1b", *PIPELINE_SCHEDULES}, sorted(pp.SCHEDULES)


EXPLICIT = {"pipelines": ["pp", *(f"pp[schedule={s}]" for s in PIPELINE_SCHEDULES), "pp_fsdp", "pp_fsdp_tp"]}


def _family_names(family: str) -> list[str]:
    if family in EXPLICIT:
        installed = any(info.plugin.distribution in FAMILIES[family] for info in get_registry())
        return EXPLICIT[family] if installed else []
    names = sorted(
        info.name
        for info in get_registry()
        if info.plugin.distribution in FAMILIES[family] and info.name not in ALIASES
    )
    return names + VARIANTS.get(family, [])


CERTIFIED = [(family, name) for family in FAMILIES for name in _family_names(family)]


def test_every_repository_package_registered_strategies() -> None:
    packages = {p for family in FAMILIES.values() for p in family}
    found = {info.plugin.distribution for info in get_registry() if info.plugin.distribution in packages}
    assert found == packages, f"installed repository packages with strategies: {sorted(found)}"


def test_an_alias_is_the_configuration_it_is_certified_through() -> None:
    registry = get_registry()
    for alias, name in ALIASES.items():
        a, b = registry.get(alias), registry.get(name)
        assert (a.factory, a.capabilities) == (b.factory, b.capabilities), (alias, name)
        assert repr(a.create()) == repr(b.create()), (alias, name)


def _certify(names: list[str], workdir: Path, *extra: str) -> tuple[dict[str, Any] | None, str]:
    report = workdir / "certificate.json"
    completed = subprocess.run(
        [sys.executable, "-m", "stratagem", "contract", *names, *extra, "--report", str(report)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=1700,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
    )
    output = completed.stdout[-6000:] + completed.stderr[-3000:]
    document = json.loads(report.read_text()) if report.exists() else None
    return document, f"exit {completed.returncode}\n{output}"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``certificates(family)``: that family's certification, run once for all of its tests."""
    done: dict[str, tuple[dict[str, Any] | None, str]] = {}

    def get(family: str) -> tuple[dict[str, Any] | None, str]:
        if family not in done:
            workdir = tmp_path_factory.mktemp(f"contract-{family}")
            done[family] = _certify(_family_names(family), workdir, "--share-launches")
        return done[family]

    return get


def _subject(document: dict[str, Any] | None, kind: str, name: str, output: str) -> dict[str, Any]:
    assert document is not None, f"the suite wrote no certificate:\n{output}"
    found = [s for s in document["subjects"] if (s["kind"], s["name"]) == (kind, name)]
    assert len(found) == 1, f"the certificate has {len(found)} subjects named {kind} {name}:\n{output}"
    return found[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("family", "name"), CERTIFIED, ids=[name for _, name in CERTIFIED])
def test_certified(certificates: Any, family: str, name: str) -> None:
    document, output = certificates(family)
    subject = _subject(document, "strategy", name, output)
    verdict, reasons = certificate.recompute(subject)
    assert verdict == "passed" and subject["verdict"] == "passed", "\n".join(reasons) + f"\n{output}"
    assert len(subject["checks"]) >= 20, f"{name}: only {len(subject['checks'])} checks ran"
    # Every skip names a declaration the strategy really makes (recompute checked it); say which they were.
    skipped = [c["declaration"]["name"] for c in subject["checks"] if c["outcome"] == "skipped"]
    assert set(skipped) <= {"checkpoint_formats", "precisions", "accelerators", "compile"}, skipped


#: The launchers certified here: the core's, and the third-party example's. stratagem-ray's and stratagem-slurm's
#: are certified in their own tests, on the Ray and SLURM clusters those tests start.
LAUNCHER_PACKAGES = ("stratagem", "stratagem-subprocess-launcher")
LAUNCHERS = sorted(
    name for name, info in get_registry().launchers.items() if info.plugin.distribution in LAUNCHER_PACKAGES
)


def test_every_repository_launcher_is_certified() -> None:
    assert "elastic" in LAUNCHERS, f"launchers of the repository's packages: {LAUNCHERS}"


@pytest.fixture(scope="module")
def launcher_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any] | None, str]:
    """Every launcher of LAUNCHERS certified by one ``stratagem contract --launcher A --launcher B ...``: each
    makes its own three launches, and the suite's start-up is paid once."""
    workdir = tmp_path_factory.mktemp("contract-launchers")
    return _certify([], workdir, *(option for name in LAUNCHERS for option in ("--launcher", name)))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_certified(launcher_certificate: tuple[dict[str, Any] | None, str], name: str) -> None:
    document, output = launcher_certificate
    subject = _subject(document, "launcher", name, output)
    verdict, reasons = certificate.recompute(subject)
    assert verdict == "passed", "\n".join(reasons) + f"\n{output}"
    assert len(subject["checks"]) >= 4, f"the launcher section ran {len(subject['checks'])} checks"
    assert not [c for c in subject["checks"] if c["outcome"] == "skipped"], "a launcher check was skipped"

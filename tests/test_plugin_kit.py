"""The plugin author's kit, end to end, as an author and a user meet it.

``stratagem new`` writes one package of each kind; pip installs them (built and installed by pip, as a user's
``pip install ./NAME`` would, into a folder on this run's path rather than the shared environment); one
``stratagem contract ... --share-launches --report`` certifies them all unmodified, and their own generated tests
pass (one package's in full, its certification included). A strategy with one hook broken, certified in the
same run, fails the training checks and its certificate says so; ``--verify`` rejects the certificate edited to pass. The
certificates shipped in the packages show in the listings; ``stratagem doctor`` finds a wrong hook signature
and a name two plugins register; ``STRATAGEM_DISABLE_PLUGINS`` keeps a plugin that raises on import from being
imported at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from stratagem.contract import _certificate as certificate

#: The packages CI generates and certifies: (kind, name, --based-on).
GENERATED = [
    ("strategy", "acme_ddp", "ddp"),
    ("strategy", "acme_plain", None),
    ("launcher", "acme_launcher", None),
    ("callback", "acme_callback", None),
    ("logger", "acme_logger", None),
]
BROKEN = "acme_unaveraged"
#: The checks that compare training with one process on the global batch (eager, compiled, through the Trainer,
#: and the evaluation of the trained model).
TRAINING_CHECKS = {
    "test_training::test_losses_match_the_reference",
    "test_training::test_gradient_norms_match_the_reference",
    "test_training::test_parameters_match_the_reference",
    "test_training::test_the_trainer_matches_the_reference",
    "test_training::test_evaluation_matches_the_reference",
    "test_compile::test_compiled_training_matches_eager",
}


def run(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def stratagem(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "stratagem", *args, env=env, cwd=cwd, timeout=timeout)


def new(kind: str, name: str, where: Path, based_on: str | None = None) -> Path:
    extra = ["--based-on", based_on] if based_on else []
    made = stratagem("new", kind, name, *extra, env=dict(os.environ), cwd=where)
    assert made.returncode == 0, made.stderr
    return where / name


def install(folders: list[Path], site: Path) -> dict[str, str]:
    """pip builds and installs the packages into ``site``; the environment that puts them on the path."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    done = run(
        *command,
        "--target",
        str(site),
        *map(str, folders),
        env=dict(os.environ),
        cwd=site.parent,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def edit(path: Path, old: str, new_text: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} in {path}"
    path.write_text(text.replace(old, new_text))


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The generated packages (and the broken strategy), installed."""
    work = tmp_path_factory.mktemp("kit")
    folders = [new(kind, name, work, based_on) for kind, name, based_on in GENERATED]
    broken = new("strategy", BROKEN, work)
    # One hook broken: backward no longer averages the gradients, so each rank steps on its own batch.
    edit(
        broken / f"src/stratagem_{BROKEN}/strategy.py",
        "            self.average_gradients(model)\n",
        "            pass\n",
    )
    env = install([*folders, broken], work / "site")
    return {"work": work, "folders": folders, "env": env}


#: The generated package whose own tests run in full, certification included: the test module is one template
#: for every kind (only the `stratagem contract` arguments differ), so one run shows the template passes as
#: generated. The others' own tests run too, but their certification comes from the one shared run below.
OWN_CERTIFICATION = "acme_callback"


@pytest.fixture(scope="module")
def certified(kit: dict) -> dict:
    """Every generated package certified by one ``stratagem contract ... --share-launches --report`` (the
    strategies, the broken one among them, share the suite's launches), and the generated packages' own tests,
    run as their CI runs them (``OWN_CERTIFICATION``'s keeps its certificate in STRATAGEM_CERTIFICATE_DIR)."""
    work = kit["work"]
    report = work / "certificate.json"
    names = [name for kind, name, _ in GENERATED if kind == "strategy"] + [BROKEN]
    plugins = [option for kind, name, _ in GENERATED if kind != "strategy" for option in (f"--{kind}", name)]
    shared = stratagem(
        "contract", *names, *plugins, "--share-launches", "--report", str(report),
        env=kit["env"], cwd=work, timeout=1500,
    )  # fmt: skip
    # Exit 1: the broken strategy fails; each subject's own verdict is read from the certificate.
    assert shared.returncode == 1 and report.exists(), shared.stdout[-8000:] + shared.stderr[-3000:]

    out = work / "certificates"
    env = {**kit["env"], "STRATAGEM_CERTIFICATE_DIR": str(out)}
    # The working folder as pytest's root (else the first package's would be): --deselect takes node ids.
    tests = [f"{folder.name}/tests" for folder in kit["folders"]]
    others = [
        f"{folder.name}/tests/test_contract.py::test_certified_by_the_contract_suite"
        for folder in kit["folders"]
        if folder.name != OWN_CERTIFICATION
    ]
    # importlib mode: every package names its test module test_contract.py.
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "--rootdir=.",
    ]
    done = run(*command, *tests, *(f"--deselect={test}" for test in others), env=env, cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]
    assert f"{len(GENERATED) + 1} passed, {len(others)} deselected" in done.stdout, done.stdout[-2000:]
    document = json.loads(report.read_text())
    return {
        "shared": document,
        "own": json.loads((out / f"{OWN_CERTIFICATION}.json").read_text()),
        "stderr": shared.stderr,
        "subjects": {subject["name"]: subject for subject in document["subjects"]},
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(1600)
def test_each_generated_package_is_certified_as_generated(kit: dict, certified: dict) -> None:
    subjects = certified["subjects"]
    assert sorted(subjects) == sorted([BROKEN, *(name for _, name, _ in GENERATED)])
    jsonschema.validate(certified["shared"], certificate.schema())
    own = certified["own"]
    jsonschema.validate(own, certificate.schema())
    assert own["verdict"] == "passed" and certificate.problems(own) == []
    assert [s["name"] for s in own["subjects"]] == [OWN_CERTIFICATION]
    listing = stratagem("strategies", "--json", env=kit["env"], cwd=kit["work"])
    declared = {row["name"]: row["capabilities"] for row in json.loads(listing.stdout)["strategies"]}
    for _, name, _ in GENERATED:
        subject = subjects[name]
        # The subject alone, as `stratagem contract NAME --report` would write it.
        alone = {**certified["shared"], "subjects": [subject], "verdict": subject["verdict"]}
        assert subject["verdict"] == "passed" and certificate.problems(alone) == [], name
        assert (
            subject["distribution"] == "stratagem-" + name.replace("_", "-") and subject["version"] == "0.1.0"
        )
        outcomes = [check["outcome"] for check in subject["checks"]]
        assert "failed" not in outcomes and "not_run" not in outcomes, name
        assert outcomes.count("passed") >= (18 if subject["kind"] == "strategy" else 4), outcomes
        for check in subject["checks"]:
            if check["outcome"] == "skipped":
                # Independently of what the certificate records: the installed strategy lacks what the skip names.
                assert subject["kind"] == "strategy", check
                field, value = check["declaration"]["name"], check["declaration"]["value"]
                assert check["reason"].startswith(f"undeclared {field}={value!r}: ")
                assert value not in declared[name][field], check
    ddp = subjects["acme_ddp"]
    assert ddp["declarations"]["checkpoint_formats"] == ["full"] and ddp["world_sizes"] == [2]
    skipped = {c["check"] for c in ddp["checks"] if c["outcome"] == "skipped"}
    assert skipped == {"test_checkpoint::test_round_trip[sharded]", "test_resume::test_exact_resume[sharded]"}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_strategy_that_does_not_average_gradients_fails_training_and_its_certificate(
    kit: dict, certified: dict
) -> None:
    document = {**certified["shared"], "subjects": [certified["subjects"][BROKEN]]}
    document["verdict"] = "failed"
    jsonschema.validate(document, certificate.schema())
    [subject] = document["subjects"]
    assert subject["verdict"] == "failed"
    outcomes = {c["check"]: c["outcome"] for c in subject["checks"]}
    failed = {check for check, outcome in outcomes.items() if outcome == "failed"}
    # Every training check fails. So may exact resume: a full checkpoint holds one replica, and the ranks'
    # replicas have drifted apart. What does not depend on the replicas agreeing still holds.
    assert TRAINING_CHECKS <= failed <= TRAINING_CHECKS | {"test_resume::test_exact_resume[full]"}, failed
    for check in (
        "test_collectives::test_all_reduce",
        "test_checkpoint::test_round_trip[full]",
        "test_registration::test_hook_implementations_match_the_specs",
        "test_teardown::test_no_process_group_left",
        "test_hooks::test_every_hook_is_exercised",
    ):
        assert outcomes.get(check) == "passed", (check, sorted(outcomes))
    losses = next(
        c for c in subject["checks"] if c["check"] == "test_training::test_losses_match_the_reference"
    )
    assert "vs one process on the global batch" in losses["reason"]
    assert "verdict failed" in certified["stderr"]
    assert certified["shared"]["verdict"] == "failed"

    # Edited to say passed: the verdict recomputed from the outcomes refuses it.
    subject["verdict"] = document["verdict"] = "passed"
    forged = kit["work"] / "forged.json"
    forged.write_text(json.dumps(document))
    verify = stratagem("contract", "--verify", str(forged), env=kit["env"], cwd=kit["work"])
    assert verify.returncode == 1, verify.stdout
    assert (
        "REJECTED" in verify.stderr
        and "says 'passed', its outcomes and declarations say 'failed'" in verify.stderr
    )
    assert f"{len(failed)} failed: " in verify.stderr
    # The rejection names the failed checks (the first six of them).
    named = [check for check in failed if check in verify.stderr]
    assert len(named) == min(len(failed), 6), verify.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_listings_show_shipped_certificates_without_importing_torch(kit: dict, certified: dict) -> None:
    # The author ships the certificate inside the package and installs it again, as a user then gets it.
    shipped = kit["work"] / "shipped"
    folders = []
    for folder in kit["folders"]:
        copy = shipped / folder.name
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        package = next((copy / "src").iterdir())
        # The shared certificate names every generated package: the listing finds each one's own subject.
        document = certified["shared"]
        if folder.name == OWN_CERTIFICATION:  # its own certificate, as if an older suite had written it
            document = {**certified["own"], "suite_version": "0.9"}
        (package / certificate.SHIPPED_NAME).write_text(json.dumps(document))
        folders.append(copy)
    env = install(folders, shipped / "site")
    listings = {
        what: json.loads(stratagem(what, "--json", env=env, cwd=shipped).stdout)
        for what in ("strategies", "launchers", "callbacks")
    }
    tables = [
        listings["strategies"]["strategies"],
        listings["launchers"]["launchers"],
        listings["callbacks"]["callbacks"],
        listings["callbacks"]["loggers"],
    ]
    status = {row["name"]: row["certificate"] for rows in tables for row in rows}
    assert {k: v for k, v in status.items() if k.startswith("acme")} == {
        "acme_ddp": "certified",
        "acme_plain": "certified",
        "acme_launcher": "certified",
        "acme_callback": "certified for 0.9",
        "acme_logger": "certified",
    }
    assert status["ddp"] == "" and status["elastic"] == ""  # nothing shipped, nothing claimed
    text = stratagem("strategies", env=env, cwd=shipped).stdout
    assert "from stratagem-acme-ddp 0.1.0 (certified); accelerators" in text
    probe = (
        "import sys, io, contextlib\nfrom stratagem.cli import main\n"
        "for what in ('strategies', 'launchers', 'callbacks'):\n"
        "    with contextlib.redirect_stdout(io.StringIO()): main([what])\n"
        "print('torch' in sys.modules)\n"
    )
    assert run(sys.executable, "-c", probe, env=env, cwd=shipped).stdout.strip() == "False"
    older = shipped / "older.json"
    older.write_text(json.dumps({**certified["own"], "suite_version": "0.9"}))
    verify = stratagem("contract", "--verify", str(older), env=env, cwd=shipped)
    assert verify.returncode == 1 and "older than the installed stratagem's" in verify.stderr


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Generated packages with one defect each: a hook with an argument its spec does not offer, two callbacks
    registering one name, and a plugin whose entry-point module raises on import (after leaving a mark)."""
    work = tmp_path_factory.mktemp("faulty")
    bad = new("strategy", "acme_badsig", work)
    edit(
        bad / "src/stratagem_acme_badsig/strategy.py",
        "def backward(self, loss: torch.Tensor, model: torch.nn.Module)",
        "def backward(self, loss: torch.Tensor, model: torch.nn.Module, scale: float)",
    )
    twins = [new("callback", "twin_a", work), new("callback", "twin_b", work)]
    edit(twins[1] / "src/stratagem_twin_b/__init__.py", '"twin_b",\n', '"twin_a",\n')
    raises = new("callback", "acme_raises", work)
    marker = work / "imported"
    edit(
        raises / "src/stratagem_acme_raises/__init__.py",
        "from __future__ import annotations\n",
        "from __future__ import annotations\n\nimport os\n\nopen(os.environ['ACME_MARKER'], 'w').close()\n"
        "raise RuntimeError('acme_raises is broken')\n",
    )
    env = install([bad, *twins, raises], work / "site")
    return {"work": work, "env": {**env, "ACME_MARKER": str(marker)}, "marker": marker}


def test_doctor_passes_this_repositorys_plugins(tmp_path: Path) -> None:
    done = stratagem("doctor", env=dict(os.environ), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("ddp", "fsdp", "deepspeed", "tp", "pp", "ray", "slurm", "elastic", "csv", "local_sgd"):
        assert f" {name} " in done.stdout, name
    assert "nothing wrong" in done.stdout


def test_doctor_fails_a_wrong_hook_signature_and_a_name_two_plugins_register(faulty: dict) -> None:
    only = {**faulty["env"], "STRATAGEM_PLUGINS": "acme_badsig"}
    done = stratagem("doctor", env=only, cwd=faulty["work"])
    assert done.returncode == 1, done.stdout
    [row] = [line for line in done.stdout.splitlines() if "acme_badsig" in line]
    assert row.startswith("ERROR") and "stratagem-acme-badsig 0.1.0" in row
    assert "takes ['scale'], which the hook spec backward('loss', 'model') does not offer" in row

    twins = {**faulty["env"], "STRATAGEM_PLUGINS": "twin_a,twin_b"}
    done = stratagem("doctor", "--json", env=twins, cwd=faulty["work"])
    assert done.returncode == 1, done.stdout
    errors = [f for f in json.loads(done.stdout)["findings"] if f["status"] == "error"]
    assert len(errors) == 1 and "registers 'twin_a', which stratagem-twin-" in errors[0]["details"][0]
    assert {errors[0]["distribution"]} <= {"stratagem-twin-a", "stratagem-twin-b"}
    assert "STRATAGEM_DISABLE_PLUGINS=" in errors[0]["details"][0]


def test_a_disabled_plugin_is_never_imported_and_the_listing_says_so(faulty: dict) -> None:
    env = {**faulty["env"], "STRATAGEM_PLUGINS": "acme_raises", "STRATAGEM_DISABLE_PLUGINS": "acme_raises"}
    listing = json.loads(stratagem("callbacks", "--json", env=env, cwd=faulty["work"]).stdout)
    assert not faulty["marker"].exists()
    assert listing["broken"] == []
    assert listing["disabled"] == [
        {
            "entry_point": "acme_raises",
            "distribution": "stratagem-acme-raises",
            "version": "0.1.0",
            "disabled_by": "STRATAGEM_DISABLE_PLUGINS",
        }
    ]
    text = stratagem("strategies", env=env, cwd=faulty["work"]).stdout
    assert (
        "DISABLED  acme_raises (stratagem-acme-raises 0.1.0): not loaded, STRATAGEM_DISABLE_PLUGINS names it"
        in text
    )
    # '*' disables every plugin but the built-ins; without the variable the import runs, and fails.
    every = {**faulty["env"], "STRATAGEM_DISABLE_PLUGINS": "*"}
    names = [
        row["name"]
        for row in json.loads(stratagem("strategies", "--json", env=every, cwd=faulty["work"]).stdout)[
            "strategies"
        ]
    ]
    assert names == ["single_device"] and not faulty["marker"].exists()
    loaded = json.loads(
        stratagem(
            "callbacks",
            "--json",
            env={**faulty["env"], "STRATAGEM_PLUGINS": "acme_raises"},
            cwd=faulty["work"],
        ).stdout
    )
    assert faulty["marker"].exists()
    [broken] = loaded["broken"]
    assert (
        broken["entry_point"] == "acme_raises = stratagem_acme_raises"
        and "acme_raises is broken" in broken["error"]
    )
    assert loaded["disabled"] == []

"""The certificate's schema and its verdict, without running the suite (``tests/test_plugin_kit.py`` checks
real certificates of generated plugins): the schema is valid JSON Schema and stratagem's own validator agrees
with ``jsonschema`` on it; the verdict follows from the outcomes and declarations alone."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest

from stratagem.contract import _certificate as certificate
from stratagem.contract._schema import validate


def _document() -> dict:
    """A certificate as the suite writes one: a strategy with a justified skip, and a callback."""
    skip = "undeclared checkpoint_formats='sharded': acme does not declare checkpoint format 'sharded'"
    strategy = {
        "kind": "strategy",
        "name": "acme",
        "registered_name": "acme",
        "options": {},
        "distribution": "stratagem-acme",
        "version": "0.1.0",
        "declarations": {
            "accelerators": ["cpu", "cuda"],
            "precisions": ["32-true"],
            "checkpoint_formats": ["full"],
            "min_world_size": 1,
            "max_world_size": None,
            "requires": [],
            "contract_tolerance": 1e-05,
        },
        "world_sizes": [2],
        "device": "cpu",
        "checks": [
            {"check": "test_training::test_losses_match_the_reference", "outcome": "passed"},
            {
                "check": "test_checkpoint::test_round_trip[sharded]",
                "outcome": "skipped",
                "reason": skip,
                "declaration": {"name": "checkpoint_formats", "value": "sharded"},
            },
        ],
        "verdict": "passed",
    }
    callback = {
        **copy.deepcopy(strategy),
        "kind": "callback",
        "name": "counter",
        "registered_name": "counter",
        "distribution": "stratagem-counter",
        "declarations": {"requires": []},
        "checks": [{"check": "test_callback::test_fit_runs_on_every_rank", "outcome": "passed"}],
    }
    return {
        "format": "stratagem-certificate",
        "format_version": 1,
        "suite_version": certificate.SUITE_VERSION,
        "stratagem_version": "0.1.0",
        "torch_version": "2.13.0+cpu",
        "python_version": "3.11.7",
        "platform": "Linux",
        "created": "2026-11-25T12:00:00Z",
        "subjects": [strategy, callback],
        "verdict": "passed",
    }


def _mutations() -> list[tuple[str, dict]]:
    """Documents the schema must refuse, one defect each."""
    found = []

    def mutated(label: str, change) -> None:
        document = _document()
        change(document)
        found.append((label, document))

    mutated("no verdict", lambda d: d.pop("verdict"))
    mutated("unknown field", lambda d: d.update(signed=True))
    mutated("format version", lambda d: d.update(format_version=2))
    mutated("suite version text", lambda d: d.update(suite_version="one"))
    mutated("created not UTC", lambda d: d.update(created="2026-11-25 12:00"))
    mutated("no subjects", lambda d: d.update(subjects=[]))
    mutated("unknown kind", lambda d: d["subjects"][0].update(kind="optimizer"))
    mutated("outcome", lambda d: d["subjects"][0]["checks"][0].update(outcome="xfail"))
    mutated("check id", lambda d: d["subjects"][0]["checks"][0].update(check="losses"))
    mutated("skip without declaration", lambda d: d["subjects"][0]["checks"][1].pop("declaration"))
    mutated("world size 0", lambda d: d["subjects"][0].update(world_sizes=[0]))
    mutated("boolean world size", lambda d: d["subjects"][0].update(world_sizes=[True]))
    mutated("device", lambda d: d["subjects"][0].update(device="tpu"))
    mutated("options not text", lambda d: d["subjects"][0].update(options={"size": 2}))
    mutated("registered name", lambda d: d["subjects"][0].update(registered_name="Acme Fast"))
    return found


def test_the_schema_is_json_schema_and_ships_in_the_wheel(tmp_path: Path) -> None:
    jsonschema.Draft202012Validator.check_schema(certificate.schema())
    # The package data of a real (non-editable) install: the schema and the templates of `stratagem new`.
    core = Path(__file__).parents[1]
    # Built from a copy: a build leaves build/ and *.egg-info beside the sources.
    source = tmp_path / "core"
    shutil.copytree(
        core, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    )
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source)]
    subprocess.run([*command, "-w", str(tmp_path)], check=True, cwd=tmp_path, timeout=120)
    [wheel] = tmp_path.glob("stratagem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "stratagem/contract/certificate.schema.json" in names
    assert "stratagem/cli/demo/corpus.txt" in names
    shipped = {n.split("templates/", 1)[1] for n in names if "/cli/new/templates/" in n}
    on_disk = {
        str(p.relative_to(core / "src/stratagem/cli/new/templates"))
        for p in (core / "src/stratagem/cli/new/templates").rglob("*.tmpl")
    }
    assert shipped == on_disk and len(on_disk) > 20


def test_both_validators_accept_the_certificate_and_refuse_each_defect() -> None:
    schema = certificate.schema()
    jsonschema.validate(_document(), schema)
    assert validate(_document(), schema) == []
    for label, document in _mutations():
        assert not jsonschema.Draft202012Validator(schema).is_valid(document), label
        assert validate(document, schema), f"stratagem's validator accepted: {label}"


def test_the_verdict_follows_from_outcomes_and_declarations() -> None:
    document = _document()
    assert certificate.problems(document) == []
    strategy = document["subjects"][0]
    assert certificate.recompute(strategy) == ("passed", [])

    failed = copy.deepcopy(strategy)
    failed["checks"][0]["outcome"] = "failed"
    verdict, reasons = certificate.recompute(failed)
    assert verdict == "failed" and "1 failed: test_training::test_losses_match_the_reference" in reasons[0]

    # Skipped for sharded, yet sharded is declared: the skip hid a check the strategy promises.
    declared = copy.deepcopy(strategy)
    declared["declarations"]["checkpoint_formats"] = ["full", "sharded"]
    verdict, reasons = certificate.recompute(declared)
    assert (
        verdict == "failed"
        and "yet the subject declares checkpoint_formats=['full', 'sharded']" in reasons[0]
    )

    # A skip whose reason names no declaration (an override that skips, an environment that lacks something).
    bare = copy.deepcopy(strategy)
    bare["checks"][1].update(reason="no /proc here", declaration=None)
    assert "for a reason no declaration gives" in certificate.recompute(bare)[1][0]

    # contract_tolerance=None justifies the training checks' skip only when that is what is declared.
    tolerance = copy.deepcopy(strategy)
    tolerance["checks"][1] = {
        "check": "test_training::test_losses_match_the_reference",
        "outcome": "skipped",
        "reason": "undeclared contract_tolerance=None: acme claims no equivalence",
        "declaration": {"name": "contract_tolerance", "value": None},
    }
    assert certificate.recompute(tolerance)[0] == "failed"
    tolerance["declarations"]["contract_tolerance"] = None
    assert certificate.recompute(tolerance)[0] == "passed"

    # Capabilities(compile=False) justifies skipping the compile section; compile=True does not.
    flag = copy.deepcopy(strategy)
    flag["checks"][1] = {
        "check": "test_compile::test_compiled_training_matches_eager",
        "outcome": "skipped",
        "reason": "undeclared compile=True: acme declares Capabilities(compile=False)",
        "declaration": {"name": "compile", "value": True},
    }
    flag["declarations"]["compile"] = True
    verdict, reasons = certificate.recompute(flag)
    assert verdict == "failed" and "yet the subject declares compile=True" in reasons[0]
    flag["declarations"]["compile"] = False
    assert certificate.recompute(flag)[0] == "passed"

    not_run = copy.deepcopy(strategy)
    not_run["checks"][0]["outcome"] = "not_run"
    assert certificate.recompute(not_run)[0] == "failed"


def test_an_edited_verdict_an_older_suite_and_another_installed_version_are_refused() -> None:
    edited = _document()
    edited["subjects"][0]["checks"][0]["outcome"] = "failed"
    problems = certificate.problems(edited)
    assert any(
        "the certificate says 'passed', its outcomes and declarations say 'failed'" in p for p in problems
    )

    older = _document()
    older["suite_version"] = "0.9"
    assert any("older than the installed stratagem's" in p for p in certificate.problems(older))

    installed = {
        ("strategy", "acme"): {
            "distribution": "stratagem-acme",
            "version": "0.2.0",
            "declarations": {
                **_document()["subjects"][0]["declarations"],
                "precisions": ["32-true", "bf16-mixed"],
            },
        }
    }
    problems = certificate.problems(_document(), installed)
    assert any("installed is stratagem-acme 0.2.0" in p for p in problems)
    assert any(
        "records precisions=['32-true'], the installed plugin declares ['32-true', 'bf16-mixed']" in p
        for p in problems
    )


def test_what_the_listing_shows_for_a_shipped_certificate() -> None:
    document = _document()
    declarations = document["subjects"][0]["declarations"]
    args = ("strategy", "acme", "stratagem-acme", "0.1.0", declarations)
    assert certificate.shipped_status(document, *args) == ("certified", "")
    older = {**document, "suite_version": "0.9"}
    assert certificate.shipped_status(older, *args) == ("certified for 0.9", "")
    status, why = certificate.shipped_status(
        document, "strategy", "acme", "stratagem-acme", "0.2.0", declarations
    )
    assert status == "" and "installed is stratagem-acme 0.2.0" in why
    failing = _document()
    failing["subjects"][0]["checks"][0]["outcome"] = "failed"
    failing["subjects"][0]["verdict"] = failing["verdict"] = "failed"
    assert certificate.shipped_status(failing, *args)[0] == ""
    assert certificate.shipped_status(document, "strategy", "other", "x", "1", {})[1].startswith(
        "the certificate"
    )


def test_verify_from_the_command_line(tmp_path: Path) -> None:
    good, edited = tmp_path / "good.json", tmp_path / "edited.json"
    good.write_text(json.dumps(_document()))
    document = _document()
    document["subjects"][0]["checks"][0]["outcome"] = "failed"
    edited.write_text(json.dumps(document))
    (tmp_path / "not-json.json").write_text("{")

    def verify(path: Path) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "stratagem", "contract", "--verify", str(path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    accepted = verify(good)
    assert accepted.returncode == 0, accepted.stderr
    assert (
        "valid; verdict passed, contract suite" in accepted.stdout and "not installed here" in accepted.stdout
    )
    rejected = verify(edited)
    assert rejected.returncode == 1 and "REJECTED" in rejected.stderr
    assert "says 'passed', its outcomes and declarations say 'failed'" in rejected.stderr
    broken = verify(tmp_path / "not-json.json")
    assert broken.returncode == 2 and "is not JSON" in broken.stderr


@pytest.mark.parametrize("keyword", ["oneOf", "$ref"])
def test_the_validator_refuses_keywords_it_does_not_implement(keyword: str) -> None:
    schema = {"type": "object", keyword: [] if keyword == "oneOf" else "http://elsewhere/schema.json"}
    with pytest.raises(ValueError, match=r"(are not|only local references are) implemented"):
        validate({}, schema)

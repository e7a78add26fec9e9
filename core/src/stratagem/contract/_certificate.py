"""Certificates: the JSON file ``stratagem contract NAME --report FILE`` writes, and the verdict recomputed from it.

A certificate says which contract suite (:data:`SUITE_VERSION`) certified which version of which plugin, against
which stratagem, torch and Python, with every check's outcome. Its verdict is not taken on trust: it follows
from the outcomes and the declarations alone (:func:`recompute`). A check may be skipped only when the
subject's own declaration excludes it (the skip names it: ``undeclared checkpoint_formats='sharded': ...``),
and the recorded declaration must lack that value. A plugin ships its certificate as
``stratagem-certificate.json`` beside its entry-point module (:data:`SHIPPED_NAME`); the listings read it from
there without importing anything. Torch-free and pytest-free: the listings import this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stratagem.contract import CERTIFICATE_FILE

if TYPE_CHECKING:
    from pathlib import Path

#: The contract suite's version: MAJOR.MINOR, raised whenever a check is added or changed, so that a
#: certificate tells which checks it vouches for. ``--verify`` refuses a certificate from an older suite.
SUITE_VERSION = "1.0"
#: The file name under which a plugin ships its certificate, beside its entry-point module.
SHIPPED_NAME = CERTIFICATE_FILE
#: A string, not a Path: the listing reads shipped certificates and does without pathlib's import.
SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "certificate.schema.json")
KINDS = ("strategy", "launcher", "callback", "logger")

_schema: dict[str, Any] | None = None


def schema() -> dict[str, Any]:
    """The certificate's JSON schema, shipped in the package (``certificate.schema.json``)."""
    global _schema
    if _schema is None:
        with open(SCHEMA_PATH, encoding="utf-8") as f:
            _schema = json.load(f)
    return _schema


def suite_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def capability_declarations(kind: str, info: Any) -> dict[str, Any]:
    """What a registered name declares, as a certificate records it (read from the registry; torch-free).

    A strategy's contract declarations (``contract_tolerance``) live on its class and are added by the suite.
    """
    if kind == "strategy":
        caps = info.capabilities
        return {
            "accelerators": sorted(caps.accelerators),
            "precisions": sorted(caps.precisions),
            "checkpoint_formats": sorted(caps.checkpoint_formats),
            "min_world_size": caps.min_world_size,
            "max_world_size": caps.max_world_size,
            "requires": list(caps.requires),
            "compile": bool(caps.compile),
        }
    if kind == "launcher":
        caps = info.capabilities
        return {
            "accelerators": sorted(caps.accelerators),
            "multi_node": bool(caps.multi_node),
            "starts_all_nodes": bool(caps.starts_all_nodes),
            "requires": list(caps.requires),
        }
    return {"requires": list(info.requires)}


def unjustified_skip(check: Mapping[str, Any], declarations: Mapping[str, Any]) -> str | None:
    """Why a skipped check's skip is not justified by ``declarations`` (``None``: it is)."""
    declaration = check.get("declaration")
    if not declaration:
        return f"{check['check']} was skipped for a reason no declaration gives: {check.get('reason', '')!r}"
    name, value = declaration["name"], declaration["value"]
    if not str(check.get("reason", "")).startswith(f"undeclared {name}={value!r}: "):
        return f"{check['check']}: the skip's reason does not name {name}={value!r}: {check.get('reason')!r}"
    if name not in declarations:
        return f"{check['check']} was skipped for {name}={value!r}, a declaration the certificate does not record"
    declared = declarations[name]
    # A set-valued declaration excludes what it lacks, a flag by being off (the skip names the missing True),
    # a single value by being that value.
    if isinstance(declared, list) and value not in declared:
        return None
    if isinstance(declared, bool):
        return (
            None
            if value is True and declared is False
            else (
                f"{check['check']} was skipped for {name}={value!r}, yet the subject declares {name}={declared!r}"
            )
        )
    if not isinstance(declared, list) and declared == value:
        return None
    return f"{check['check']} was skipped for {name}={value!r}, yet the subject declares {name}={declared!r}"


def recompute(subject: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The verdict one subject's outcomes and declarations give, and every reason it is not ``passed``."""
    reasons: list[str] = []
    checks = subject.get("checks") or []
    if not checks:
        reasons.append("no check ran")
    for outcome in ("failed", "not_run"):
        named = [c["check"] for c in checks if c["outcome"] == outcome]
        if named:
            shown = ", ".join(named[:6]) + (", ..." if len(named) > 6 else "")
            reasons.append(f"{len(named)} {outcome.replace('_', ' ')}: {shown}")
    for check in checks:
        if check["outcome"] == "skipped":
            problem = unjustified_skip(check, subject.get("declarations", {}))
            if problem:
                reasons.append(problem)
    return ("failed" if reasons else "passed"), reasons


def counts(subject: Mapping[str, Any]) -> dict[str, int]:
    found = {"passed": 0, "failed": 0, "skipped": 0, "not_run": 0}
    for check in subject.get("checks", []):
        found[check["outcome"]] = found.get(check["outcome"], 0) + 1
    return found


def label(subject: Mapping[str, Any]) -> str:
    return f"{subject['kind']} {subject['name']} ({subject['distribution']} {subject['version']})"


def problems(
    document: Any, installed: Mapping[tuple[str, str], Mapping[str, Any]] | None = None
) -> list[str]:
    """Everything that keeps ``document`` from certifying what it names; empty when it certifies all of it.

    :param installed: for subjects installed here, ``{(kind, name): {"distribution", "version",
        "declarations"}}`` as they are now: a certificate must name the installed version and record what it
        declares today.
    """
    from stratagem.contract._schema import validate

    found = validate(document, schema())
    if found:
        return [
            f"not a valid certificate ({os.path.basename(SCHEMA_PATH)}): {problem}" for problem in found[:12]
        ]
    older = suite_tuple(document["suite_version"]) < suite_tuple(SUITE_VERSION)
    if older:
        found.append(
            f"certified by contract suite {document['suite_version']}, older than the installed stratagem's "
            f"({SUITE_VERSION}): certify again with this stratagem (`stratagem contract NAME --report FILE`)"
        )
    verdicts = []
    for subject in document["subjects"]:
        verdict, reasons = recompute(subject)
        verdicts.append(verdict)
        if subject["verdict"] != verdict:
            found.append(
                f"{label(subject)}: the certificate says {subject['verdict']!r}, its outcomes and declarations "
                f"say {verdict!r}" + (f" ({'; '.join(reasons)})" if reasons else "")
            )
        elif reasons:
            found.append(f"{label(subject)} failed: {'; '.join(reasons)}")
        now = (installed or {}).get((subject["kind"], subject["registered_name"]))
        if now is not None:
            found += _against_installed(subject, now)
    overall = "passed" if all(v == "passed" for v in verdicts) else "failed"
    if document["verdict"] != overall:
        found.append(f"the certificate's verdict is {document['verdict']!r}; its subjects' give {overall!r}")
    return found


def _against_installed(subject: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    found = []
    if (subject["distribution"], subject["version"]) != (now["distribution"], now["version"]):
        found.append(
            f"{label(subject)}: installed is {now['distribution']} {now['version']}; certify that version"
        )
    for key, value in now["declarations"].items():
        if subject["declarations"].get(key, "(not recorded)") != value:
            found.append(
                f"{label(subject)}: the certificate records {key}={subject['declarations'].get(key, '(nothing)')!r}, "
                f"the installed plugin declares {value!r}"
            )
    return found


def load(path: str | Path) -> Any:
    """The JSON document at ``path``; a clear error when it is not JSON."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from None


def shipped_status(
    document: Any, kind: str, name: str, distribution: str, version: str, declarations: Mapping[str, Any]
) -> tuple[str, str]:
    """What the listing shows for one registered name from the certificate its plugin ships:
    ``("certified", "")``, ``("certified for X.Y", "")`` when an older suite (or a newer one) certified it, or
    ``("", why not)``."""
    subject = None
    if isinstance(document, dict):
        subject = next(
            (
                s
                for s in document.get("subjects", [])
                if isinstance(s, dict) and (s.get("kind"), s.get("name")) == (kind, name)
            ),
            None,
        )
    if subject is None:
        return "", f"the certificate it ships does not name the {kind} {name}"
    installed = {
        (kind, name): {"distribution": distribution, "version": version, "declarations": declarations}
    }
    # Only this subject's problems (and the document's shape) count; the suite's age is what the status says.
    single = {**document, "subjects": [subject], "verdict": subject.get("verdict")}
    issues = [p for p in problems(single, installed) if not p.startswith("certified by contract suite")]
    if issues:
        return "", issues[0]
    suite = document["suite_version"]
    return ("certified" if suite == SUITE_VERSION else f"certified for {suite}"), ""


def shipped_certificate(directory: str | None) -> tuple[Any, str]:
    """The certificate shipped in ``directory`` (a plugin's package), as ``(document or None, problem)``."""
    if not directory:
        return None, ""
    path = os.path.join(directory, SHIPPED_NAME)
    try:
        return load(path), ""
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as error:
        return None, str(error)

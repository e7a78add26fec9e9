"""The certificate a contract run writes (``--stratagem-report FILE``, ``stratagem contract ... --report FILE``).

A pytest plugin object, registered by :mod:`stratagem.contract.plugin` when the option is given: it notes every
check of every subject the run certifies as it is collected, its outcome as it runs, and at the end writes one
JSON document (``certificate.schema.json``, see :mod:`stratagem.contract._certificate`). A check that was
collected but never ran (deselected with ``-k``, or after ``-x`` stopped the session) is recorded as
``not_run`` and fails the verdict: a certificate vouches for the whole suite or for nothing.
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any

import pytest

from stratagem.contract import _certificate as certificate

#: The fixture that names each kind of subject (parametrised by the plugin), and the kind it names.
SUBJECT_PARAMS = {"stratagem_strategy": "strategy", "stratagem_launcher": "launcher"}
#: Callbacks and loggers share a section, whose parameter says which: ``"callback:NAME"``, ``"logger:NAME"``.
EVENT_PARAM = "stratagem_event_plugin"
_REASON_LIMIT = 2000


def _subject_of(item: Any) -> tuple[str, str] | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    for param, kind in SUBJECT_PARAMS.items():
        if isinstance(params.get(param), str):
            return kind, params[param]
    if isinstance(params.get(EVENT_PARAM), str):
        kind, _, name = params[EVENT_PARAM].partition(":")
        return kind, name
    return None


def _check_id(item: Any) -> str:
    params = getattr(getattr(item, "callspec", None), "params", {})
    own = [str(v) for k, v in params.items() if k not in SUBJECT_PARAMS and k != EVENT_PARAM]
    module = item.module.__name__.rsplit(".", 1)[-1]
    return f"{module}::{item.originalname}" + (f"[{'-'.join(own)}]" if own else "")


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


class ReportWriter:
    """Collects outcomes per subject and check; writes the certificate when the session ends."""

    def __init__(self, path: str) -> None:
        self.path = Path(path).absolute()
        #: ``{(kind, name): {check id: record}}``, in collection order.
        self.subjects: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        self._items: dict[str, tuple[tuple[str, str], str]] = {}
        self.written: dict[str, Any] | None = None

    def _note(self, item: Any, outcome: str, reason: str = "") -> None:
        subject = _subject_of(item)
        if subject is None:
            return
        check = _check_id(item)
        record: dict[str, Any] = {"check": check, "outcome": outcome}
        if reason:
            record["reason"] = reason
        self.subjects.setdefault(subject, {})[check] = record
        self._items[item.nodeid] = (subject, check)

    @pytest.hookimpl
    def pytest_deselected(self, items: list[Any]) -> None:
        for item in items:
            self._note(item, "not_run", "deselected (-k, -m or --deselect): a certificate needs every check")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:
            self._note(
                item, "not_run", "the session ended before this check ran (-x, --maxfail or an interruption)"
            )

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: Any) -> None:
        key = self._items.get(report.nodeid)
        if key is None:
            return
        record = self.subjects[key[0]][key[1]]
        if report.failed:
            message = report.longreprtext.strip()
            if record["outcome"] == "failed":  # a teardown error after a failure: keep both
                message = record.get("reason", "") + "\n" + message
            record.update(outcome="failed", reason=message[-_REASON_LIMIT:])
            record.pop("declaration", None)
        elif report.skipped and record["outcome"] != "failed":
            from stratagem.contract._comparisons import skipped_declaration

            reason = _skip_reason(report)
            found = skipped_declaration(reason)
            declaration = None
            if found is not None:
                import ast

                try:
                    declaration = {"name": found[0], "value": ast.literal_eval(found[1])}
                except (ValueError, SyntaxError):
                    declaration = None
            record.update(outcome="skipped", reason=reason[:_REASON_LIMIT], declaration=declaration)
        elif report.when == "call" and report.passed and record["outcome"] == "not_run":
            record.update(outcome="passed")
            record.pop("reason", None)

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: Any) -> None:
        if not self.subjects:
            return
        subjects = [
            {**describe(kind, name), "checks": list(checks.values())}
            for (kind, name), checks in self.subjects.items()
        ]
        for subject in subjects:
            subject["verdict"] = certificate.recompute(subject)[0]
        document = {
            "format": "stratagem-certificate",
            "format_version": 1,
            "suite_version": certificate.SUITE_VERSION,
            "stratagem_version": _version("stratagem"),
            "torch_version": _version("torch"),
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "subjects": subjects,
            "verdict": "passed" if all(s["verdict"] == "passed" for s in subjects) else "failed",
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(document, indent=2) + "\n")
        self.written = document

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.written is None:
            return
        terminalreporter.write_sep("-", f"stratagem certificate: {self.path}")
        for subject in self.written["subjects"]:
            tally = ", ".join(
                f"{n} {k.replace('_', ' ')}" for k, n in certificate.counts(subject).items() if n
            )
            terminalreporter.write_line(f"{certificate.label(subject)}: {subject['verdict']} ({tally})")
        terminalreporter.write_line(f"verdict: {self.written['verdict']}")


def _version(distribution: str) -> str:
    import importlib_metadata

    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def describe(kind: str, name: str) -> dict[str, Any]:
    """Who the subject is and what it declares, as the certificate records it."""
    from stratagem.registry._labels import parse_label
    from stratagem.registry._manager import get_registry

    registry = get_registry()
    options: dict[str, Any] = {}
    if kind == "strategy":
        registered, options = parse_label(name, "--stratagem-strategy")
        info = registry.get(registered)
    elif kind == "launcher":
        registered, info = name, registry.get_launcher(name)
    else:
        registered, info = name, registry.get_callback(name, kind)
    declarations = certificate.capability_declarations(kind, info)
    if kind == "strategy":
        from stratagem.contract._runner import subject_for

        subject = subject_for(name)
        # What the strategy declares to the suite itself, beside its capabilities.
        declarations["contract_tolerance"] = subject.tolerance
        world_sizes = [subject.world_size] if subject.world_size else []
    elif kind == "launcher":
        from stratagem.contract._launcher_runner import WORLD

        world_sizes = [WORLD]
    else:
        from stratagem.contract._callback_runner import WORLD as CALLBACK_WORLD

        world_sizes = [CALLBACK_WORLD]
    return {
        "kind": kind,
        "name": name,
        "registered_name": registered,
        "options": {key: str(value) for key, value in options.items()},
        "distribution": info.plugin.distribution,
        "version": info.plugin.version,
        "declarations": declarations,
        "world_sizes": world_sizes,
        "device": "cpu",
    }

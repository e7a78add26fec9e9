"""Comparisons for the contract checks. Each returns a list of problems, every one saying what was expected
and what came back; :func:`fail_on` turns them into one test failure."""

from __future__ import annotations

import re
from typing import Any, NoReturn

import pytest

_PHASES = {1: "phase one (collectives, training, saving)", 2: "phase two (loading and resuming)"}


#: A skip's reason starts with the declaration that excludes the check: ``undeclared <name>=<value>: ...``.
_SKIP_REASON = re.compile(r"^undeclared (?P<name>[a-z_]+)=(?P<value>.+?): ")
#: The declarations a skip may name: the capability fields and the strategy's contract declarations.
DECLARATIONS = frozenset(
    {"accelerators", "precisions", "checkpoint_formats", "requires", "contract_tolerance", "compile"}
)


def skip_undeclared(name: str, value: Any, explanation: str) -> NoReturn:
    """Skip a check that the strategy's declaration ``name`` does not promise (``value`` is what it lacks)."""
    if name not in DECLARATIONS:
        raise ValueError(f"skip_undeclared({name!r}): not one of {sorted(DECLARATIONS)}")
    pytest.skip(f"undeclared {name}={value!r}: {explanation}")


def skipped_declaration(reason: str) -> tuple[str, str] | None:
    """``(name, value)`` of the declaration a skip reason names, or ``None`` if it names none."""
    match = _SKIP_REASON.match(reason.removeprefix("Skipped: "))
    if match is None or match["name"] not in DECLARATIONS:
        return None
    return match["name"], match["value"]


def fail_on(problems: list[str], header: str) -> None:
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        pytest.fail(f"{header}:\n  " + "\n  ".join(shown), pytrace=False)


def section(run: Any, phase: int, name: str) -> dict[int, Any]:
    """``{rank: data}`` of one section of a phase; a failed launch or a section that raised fails the check."""
    if phase in run.launch_errors:
        pytest.fail(f"{_PHASES[phase]} did not complete: {run.launch_errors[phase]}", pytrace=False)
    results = run.phase1 if phase == 1 else run.phase2
    expected = run.subject.world_size
    if len(results) != expected:
        pytest.fail(
            f"{_PHASES[phase]}: expected results from {expected} ranks, got {sorted(results)}", pytrace=False
        )
    data = {}
    for rank, result in sorted(results.items()):
        if name in result["errors"]:
            pytest.fail(
                f"{_PHASES[phase]}: the {name!r} section raised on rank {rank}:\n{result['errors'][name]}",
                pytrace=False,
            )
        if name not in result:
            pytest.fail(f"{_PHASES[phase]}: rank {rank} returned no {name!r} section", pytrace=False)
        data[rank] = result[name]
    return data


def show(value: Any, limit: int = 6) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten().tolist()
        head = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in flat[:limit])
        more = ", ..." if len(flat) > limit else ""
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, [{head}{more}])"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.9g}" for v in value) + "]"
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, (list, tuple)):
        # Lists and tuples compare alike: a tuple saved may come back a list.
        out = {f"{prefix}.len": len(value)} if prefix else {".len": len(value)}
        for index, item in enumerate(value):
            out.update(_leaves(item, f"{prefix}[{index}]"))
        return out
    return {prefix: value}


def compare(expected: Any, got: Any, what: str, *, tolerance: float | None = None) -> list[str]:
    """Leaf-by-leaf comparison of nested state: bit-equal, or within ``tolerance`` (absolute + relative)."""
    import torch

    want, have = _leaves(expected), _leaves(got)
    problems = [f"{what}: expected {k} = {show(want[k])}, got nothing" for k in sorted(set(want) - set(have))]
    problems += [f"{what}: got unexpected {k} = {show(have[k])}" for k in sorted(set(have) - set(want))]
    for key in sorted(set(want) & set(have)):
        a, b = want[key], have[key]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            a_t, b_t = torch.as_tensor(a), torch.as_tensor(b)
            if a_t.shape != b_t.shape:
                problems.append(f"{what}: {key}: expected shape {tuple(a_t.shape)}, got {tuple(b_t.shape)}")
                continue
            if tolerance is None:
                if not torch.equal(a_t, b_t) or a_t.dtype != b_t.dtype:
                    diff = _max_diff(a_t, b_t)
                    problems.append(
                        f"{what}: {key}: expected bit-equal {show(a_t)}, got {show(b_t)} (max abs diff {diff})"
                    )
            elif not torch.allclose(b_t.double(), a_t.double(), rtol=tolerance, atol=tolerance):
                problems.append(
                    f"{what}: {key}: expected {show(a_t)} within {tolerance:g} (abs + rel), got {show(b_t)} "
                    f"(max abs diff {_max_diff(a_t, b_t)})"
                )
        elif isinstance(a, float) and isinstance(b, float) and tolerance is not None:
            if abs(a - b) > tolerance * (1 + abs(a)):
                problems.append(f"{what}: {key}: expected {a!r} within {tolerance:g}, got {b!r}")
        elif a != b:
            problems.append(f"{what}: {key}: expected {show(a)}, got {show(b)}")
    return problems


def _max_diff(a: Any, b: Any) -> str:
    try:
        return f"{(a.double() - b.double()).abs().max().item():.3g}"
    except Exception:
        return "n/a"


def compare_series(expected: list[float], got: list[float], what: str, tolerance: float | None) -> list[str]:
    if len(expected) != len(got):
        return [f"{what}: expected {len(expected)} values {show(expected)}, got {len(got)}: {show(got)}"]
    bad = [
        i
        for i, (a, b) in enumerate(zip(expected, got))
        if (a != b if tolerance is None else abs(a - b) > tolerance * (1 + abs(a)))
    ]
    if not bad:
        return []
    rule = "bit-equal" if tolerance is None else f"within {tolerance:g} (abs + rel)"
    return [
        f"{what}: expected {show(expected)} ({rule}), got {show(got)}; first difference at index {bad[0]}"
    ]

"""Running the contract for one strategy: what it declares, the two launches, and the references.

The pytest fixtures call :func:`subject_for` and :func:`run`; the checks in ``stratagem.contract`` assert on
the :class:`ContractRun` they return.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import attrs

from stratagem.registry._labels import parse_label

#: Training equivalence in float32 holds to this unless the strategy declares otherwise.
DEFAULT_TOLERANCE = 1e-5
#: A declared tolerance above this certifies nothing useful about equivalence and is refused.
LOOSEST_TOLERANCE = 1e-2
#: Process-group timeout inside the workers: a hung collective fails the run rather than the CI job.
WORKER_TIMEOUT_S = 90.0
WORLD_SIZE_PREFERENCE = (2, 4)


@attrs.define
class Subject:
    """One strategy and what the suite will check for it.

    ``name`` is as the user wrote it: a registered name, or one with options (``fsdp_tp[tensor_parallel_size=2]``,
    the syntax of ``stratagem compare``), which certifies the strategy created with them.
    """

    name: str
    info: Any
    registered: str = ""
    options: dict[str, Any] = attrs.field(factory=dict)
    strategy_class: type | None = None
    world_size: int = 0
    tolerance: float | None = DEFAULT_TOLERANCE
    precision: str = "32-true"
    #: Why nothing can run here (a missing requirement, no CPU support), or ``None``.
    unavailable: str | None = None
    #: Why training checks cannot run (no ``32-true``), or ``None``.
    no_training: str | None = None
    #: Problems with the declarations themselves (reported by the registration check).
    declaration_problems: list[str] = attrs.field(factory=list)

    @property
    def formats(self) -> list[str]:
        return sorted(self.info.capabilities.checkpoint_formats)


def _choose_world_size(caps: Any, declared: Any) -> tuple[int, str | None]:
    if declared is not None:
        if not isinstance(declared, int) or not caps.serves_world_size(declared):
            return 0, (
                f"contract_world_size={declared!r} is not a world size its capabilities serve "
                f"({caps.min_world_size}..{caps.max_world_size or 'n'})"
            )
        return declared, None
    for size in (*WORLD_SIZE_PREFERENCE, caps.min_world_size):
        if caps.serves_world_size(size):
            return size, None
    return caps.min_world_size, None


def subject_for(name: str) -> Subject:
    """Look ``name`` up in the registry and read what it declares (importing its class)."""
    from stratagem.registry._manager import get_registry

    registered, options = parse_label(name, "--stratagem-strategy")
    info = get_registry().get(registered)
    subject = Subject(name=name, info=info, registered=registered, options=options)
    caps = info.capabilities
    missing = caps.missing_requirements()
    if missing:
        subject.unavailable = f"{name} requires {', '.join(missing)} (capabilities.requires), not installed"
        return subject
    if "cpu" not in caps.accelerators:
        subject.unavailable = (
            f"{name} does not declare accelerator 'cpu' (capabilities.accelerators = "
            f"{sorted(caps.accelerators)}); the suite runs on CPU over gloo"
        )
        return subject
    try:
        strategy = info.create(**options)
    except Exception as error:
        subject.unavailable = f"{name} could not be created: {type(error).__name__}: {error}"
        subject.declaration_problems.append(subject.unavailable)
        return subject
    subject.strategy_class = type(strategy)
    subject.world_size, problem = _choose_world_size(caps, getattr(strategy, "contract_world_size", None))
    if problem:
        subject.declaration_problems.append(problem)
        subject.unavailable = problem
    tolerance = getattr(strategy, "contract_tolerance", DEFAULT_TOLERANCE)
    if tolerance is not None and not (
        isinstance(tolerance, (int, float)) and 0 < tolerance <= LOOSEST_TOLERANCE
    ):
        subject.declaration_problems.append(
            f"contract_tolerance={tolerance!r}: declare a number in (0, {LOOSEST_TOLERANCE}] (looser "
            "certifies nothing about equivalence), or None to claim no equivalence with synchronous training"
        )
        tolerance = DEFAULT_TOLERANCE
    subject.tolerance = None if tolerance is None else float(tolerance)
    if "32-true" not in caps.precisions:
        subject.no_training = (
            f"{name} does not declare precision '32-true' (capabilities.precisions = "
            f"{sorted(caps.precisions)}); training checks compare float32 runs"
        )
        subject.precision = sorted(p for p in caps.precisions if p != "16-mixed")[0]
    return subject


@attrs.define
class ContractRun:
    """Everything the two launches and the references produced for one strategy."""

    subject: Subject
    workdir: Path
    phase1: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    phase2: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    launch_errors: dict[int, str] = attrs.field(factory=dict)
    reference: dict[str, Any] = attrs.field(factory=dict)
    single_device_payload: dict[str, Any] = attrs.field(factory=dict)
    #: Children of this (pytest) process left after each launch, and ports still listening.
    children_left: dict[int, list[str] | None] = attrs.field(factory=dict)
    ports_in_use: dict[int, list[int]] = attrs.field(factory=dict)
    seconds: dict[int, float] = attrs.field(factory=dict)


def _spec(subject: Subject, workdir: Path, phase: int, single_device: str) -> dict[str, Any]:
    return {
        "name": subject.name,
        "strategy": subject.registered,
        "options": subject.options,
        "world_size": subject.world_size,
        "precision": subject.precision,
        "timeout": WORKER_TIMEOUT_S,
        "phase": phase,
        "train": subject.no_training is None,
        "formats": subject.formats,
        "compile": bool(subject.info.capabilities.compile),
        "workdir": str(workdir),
        "single_device_checkpoint": single_device,
    }


def _launch(runs: list[ContractRun], phase: int, specs: list[dict[str, Any]]) -> None:
    """One launch running every spec's phase in turn in each worker; each run gets its own results."""
    from stratagem.contract._processes import child_processes, port_in_use
    from stratagem.contract._workers import run_phases
    from stratagem.errors import WorkerFailedError
    from stratagem.launchers import _worker_start

    before = child_processes(os.getpid())
    start = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    error = None
    try:
        results = _worker_start.launch_function(
            run_phases,
            (specs,),
            nproc_per_node=specs[0]["world_size"],
            accelerator="cpu",
            env={"OMP_NUM_THREADS": "1"},
        )
    except WorkerFailedError as failure:
        error = str(failure)
    seconds = time.perf_counter() - start
    after = child_processes(os.getpid())
    left = None if after is None else sorted(set(after) - set(before or []))
    ports = {
        r["teardown"]["master_port"] for per in results.values() for r in per.values() if "teardown" in r
    }
    busy = sorted(p for p in ports if port_in_use(p))
    for run in runs:
        if error is not None:
            run.launch_errors[phase] = error
        mine = {rank: per[run.subject.name] for rank, per in results.items() if run.subject.name in per}
        if phase == 1:
            run.phase1 = mine
        else:
            run.phase2 = mine
        run.seconds[phase], run.children_left[phase], run.ports_in_use[phase] = seconds, left, busy


def write_single_device_checkpoint(path: Path) -> dict[str, Any]:
    """One training step under ``single_device`` in this process, saved as a full checkpoint."""
    import torch

    from stratagem.contract import _suite_model as m
    from stratagem.engine import Engine

    engine = Engine("single_device", accelerator="cpu")
    with engine.init_module():
        model = m.build_model(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.LEARNING_RATE)
    model, optimizer = engine.setup(model, optimizer)
    tokens, targets = m.dataset(1)[: m.step_batch(1)]
    engine.backward(m.loss_fn(model(tokens), targets), model)
    optimizer.step()
    optimizer.zero_grad()
    engine.save(path, {"model": model, "optimizer": optimizer, "step": 1}, format="full")
    engine.teardown()
    return torch.load(path, map_location="cpu", weights_only=True)


def run(subject: Subject, workdir: Path) -> ContractRun:
    """Both launches for ``subject``, plus the one-process reference and the single_device checkpoint."""
    return run_together([subject], workdir)[subject.name]


def run_together(subjects: list[Subject], workdir: Path) -> dict[str, ContractRun]:
    """Both launches for several subjects of one world size: each worker runs every subject's phase in turn
    (a fresh Engine and process group each), which saves the launches' start-up. A worker that crashes fails
    the launch for all of them; a section that raises fails that subject's checks only."""
    import re

    from stratagem.contract import _suite_model as m

    sizes = {s.world_size for s in subjects}
    if len(sizes) != 1:
        raise ValueError(f"subjects certified together must share one world size, got {sorted(sizes)}")
    runs = []
    for subject in subjects:
        label = re.sub(r"[^\w.-]+", "_", subject.name)
        directory = workdir / label if len(subjects) > 1 else workdir
        directory.mkdir(parents=True, exist_ok=True)
        runs.append(ContractRun(subject=subject, workdir=directory))
    single_device = workdir / "single_device.pt"
    payload: dict[str, Any] = {}
    if any(s.no_training is None for s in subjects):
        payload = write_single_device_checkpoint(single_device)
    for run_ in runs:
        run_.single_device_payload = payload if run_.subject.no_training is None else {}
    for phase in (1, 2):
        _launch(runs, phase, [_spec(r.subject, r.workdir, phase, str(single_device)) for r in runs])
        if phase == 1:
            for run_ in runs:
                if run_.subject.no_training is None:
                    # After the launch: the samples per step follow the data-parallel size the strategy reported.
                    straight = run_.phase1.get(0, {}).get("straight") or {}
                    run_.reference = m.reference_run(run_.subject.world_size, straight.get("replicas"))
    return {r.subject.name: r for r in runs}

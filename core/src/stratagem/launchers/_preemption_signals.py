"""Preemption as the launchers see it: which signals mean "the machine is being taken back", how a launcher hands
them to its workers, and what the workers leave for it to report.

A scheduler preempts a job with a signal and a grace period before it kills it (SLURM: SIGTERM, or the signal of
``--signal=USR1@90``; Kubernetes and spot instances: SIGTERM). The Trainer in each worker catches the signal and
the ranks stop together at a step boundary with a checkpoint of that step (:mod:`stratagem.trainer._preemption_stop`).
A launcher that receives one passes it on to its workers and waits for them up to the grace period, instead of
stopping them at once; then it exits with :data:`~stratagem.errors.PREEMPTED_EXIT_CODE`, as a worker that was
preempted does. Each preempted worker writes a note beside the agent's error file, which the launcher reads to
say what was saved.
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stratagem.errors import PREEMPTED_EXIT_CODE, ConfigurationError, Preempted

#: What ``Trainer(preemption_signals=...)`` catches unless told otherwise: SLURM, Kubernetes and cloud spot
#: instances end a job with SIGTERM; SIGUSR1 is the usual choice for SLURM's early warning (``--signal``).
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
#: Seconds between the signal and the kill, unless told otherwise: Kubernetes' default
#: ``terminationGracePeriodSeconds`` and SLURM's default ``KillWait``.
DEFAULT_GRACE_S = 30.0
#: How a launcher's job tells the agent which signals to pass on, and for how long to wait.
SIGNALS_ENV = "STRATAGEM_PREEMPTION_SIGNALS"
GRACE_ENV = "STRATAGEM_PREEMPTION_GRACE_S"
#: Beside the agent's error file of a worker: what that worker saved when it was preempted.
NOTE_SUFFIX = ".preempted.json"
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_names(value: Any, option: str = "Trainer(preemption_signals=...)") -> tuple[str, ...]:
    """``("SIGTERM", "SIGUSR1")`` from names (``"SIGTERM"``, ``"TERM"``, ``"sigusr1"``), numbers or
    ``signal.Signals``; one name alone is one signal; ``()`` or ``None`` is none."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, int)) else list(value)
    names: list[str] = []
    for item in items:
        name = _signal_name(item, option)
        if name not in names:
            names.append(name)
    return tuple(names)


def _signal_name(item: Any, option: str) -> str:
    known = sorted(n for n in signal.Signals.__members__ if n.startswith("SIG") and not n.startswith("SIG_"))
    if isinstance(item, bool) or not isinstance(item, (str, int)):
        raise ConfigurationError(f"{option}: {item!r} is not a signal; give names such as 'SIGTERM'.")
    if isinstance(item, int):
        try:
            name = signal.Signals(item).name
        except ValueError:
            raise ConfigurationError(f"{option}: {item} is not a signal number on this system.") from None
    else:
        name = item.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(f"{option}: {item!r} is not a signal on this system.{hint}")
    if name in _UNCATCHABLE:
        raise ConfigurationError(
            f"{option}: {name} cannot be caught, so nothing can be saved when it comes; the signal a scheduler "
            "sends before it (SIGTERM, or the one of SLURM's --signal) is the one to name."
        )
    return name


def check_grace(value: Any, option: str = "Trainer(preemption_grace_s=...)") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(
            f"{option}: {value!r}; give the seconds the scheduler leaves between its signal and the kill "
            "(a positive number)."
        )
    return float(value)


def launcher_env(signals: tuple[str, ...], grace_s: float) -> dict[str, str]:
    """The environment that tells stratagem's agent what to pass on to the workers, and for how long to wait."""
    return {SIGNALS_ENV: ",".join(signals), GRACE_ENV: repr(float(grace_s))}


def from_env(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], float]:
    """What :func:`launcher_env` said (no signals where it said nothing: the agent's own handling, unchanged)."""
    env = os.environ if environ is None else environ
    signals = signal_names(env.get(SIGNALS_ENV, "").split(",") if env.get(SIGNALS_ENV) else ())
    try:
        grace = float(env.get(GRACE_ENV) or DEFAULT_GRACE_S)
    except ValueError:
        grace = DEFAULT_GRACE_S
    return signals, grace


# the worker's note ---------------------------------------------------------------------------------------


def write_note(note: Mapping[str, Any]) -> None:
    """In a worker of stratagem's agent (or torchrun's): note what was saved, for the launcher's report."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path + NOTE_SUFFIX).write_text(json.dumps(dict(note)))
    except OSError:
        pass  # the folder went with its agent: nobody is left to read the note


def read_notes(folder: Path) -> list[dict[str, Any]]:
    notes = []
    for path in sorted(folder.rglob("*" + NOTE_SUFFIX)):
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return notes


def report(
    signal_name: str | None, received: float | None, notes: list[dict[str, Any]], grace_s: float
) -> Preempted:
    """The launcher's account of a preemption, printed, as the exception that ends it with the preempted code.

    ``signal_name`` and ``received`` (a wall-clock time) when the launcher got the signal itself; the workers'
    notes say which signal they saw first, when, and what they saved.
    """
    times = [float(n["received"]) for n in notes if n.get("received") is not None]
    times += [received] if received is not None else []
    name = signal_name or next((n["signal"] for n in notes if n.get("signal")), "a preemption signal")
    took = f"{time.time() - min(times):.1f} s" if times else "an unknown time"
    steps = sorted({int(n["step"]) for n in notes if n.get("step") is not None})
    if steps:
        checkpoint = str(notes[0].get("checkpoint") or "")
        what = f"the workers stopped at step {steps[-1]} and saved {checkpoint}"
        if len(steps) > 1:  # cannot happen when every rank agreed: say it rather than hide it
            what = f"the workers stopped at steps {steps} (they did not agree)"
    else:
        checkpoint = None
        what = (
            "the workers ended without a checkpoint of their step (they had not started training, caught no "
            "preemption signal, or were not done within the grace period); a resumed run continues from the "
            "newest complete checkpoint"
        )
    message = (
        f"stratagem: preempted by {name}: {what}; {took} from the signal to the end (grace period "
        f"{grace_s:g} s). Exit code {PREEMPTED_EXIT_CODE}: run it again (ckpt_path='last', or the scheduler's "
        "requeue) to continue."
    )
    print(message, file=sys.stderr, flush=True)
    return Preempted(
        message, signal=name, step=steps[-1] if steps else None, checkpoint=checkpoint if steps else None
    )

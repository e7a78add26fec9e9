"""Hang detection: a rank that stops making progress is found, named, and ended like any failed worker.

The training loop beats at each phase of each batch. A daemon thread per rank watches the beats; when none
came for ``timeout`` seconds, it writes where its rank is (step, batch, phase, and whether the main thread is
inside torch, i.e. waiting in a collective or the autograd engine, or in the user's code) to the process
group's store and reads the other ranks' notes. The rank that is behind, or in user code while the others
wait inside torch, or that wrote nothing at all, is the one that did not arrive. That rank's watchdog records
the failure with its main thread's stack and ends the process first; the others record who they waited for
and end after a grace period, so that the launcher reports the culprit. With restarts allowed, torch's
elastic agent then restarts the group; without, the run ends naming that rank.

The process group's own timeout is set longer than ``timeout`` (see :func:`collective_timeout`), so the
watchdog speaks before a collective gives up with an error that names nobody.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from stratagem.launchers._failure_records import FAILURE_SUFFIX

#: The loop's phases, in the order they happen within one batch.
PHASES = ("data", "training_step", "backward", "optimizer_step", "validation", "checkpoint", "logging")
#: Phases that run the user's code on the main thread.
USER_PHASES = frozenset({"data", "training_step", "validation"})
_TORCH_DIR = str(Path(torch.__file__).parent)
_KEY = "stratagem/watchdog/{rank}"
#: Each rank's host, written as the watchdog starts: a rank that cannot answer is named with its host.
_HOST_KEY = "stratagem/watchdog/host/{rank}"


def collective_timeout(timeout: float) -> float:
    """The process-group timeout for a watchdog ``timeout``: long enough for the watchdog to speak first."""
    return timeout + max(30.0, 0.5 * timeout)


class Watchdog:
    """Watches the beats of this rank's training loop; see the module docstring."""

    def __init__(self, timeout: float, rank: int, world_size: int, store: Any) -> None:
        self.timeout, self.rank, self.world_size, self.store = float(timeout), rank, world_size, store
        self.grace = min(5.0, max(1.0, self.timeout / 4))
        self._where = (0, 0, 0)  # step, batch, phase index
        self._last = time.monotonic()
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stratagem-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._last = time.monotonic()
        if self.store is not None and self.world_size > 1:
            try:
                self.store.set(_HOST_KEY.format(rank=self.rank), socket.gethostname())
            except Exception:
                pass  # a note for a later message; training goes on without it
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def beat(self, step: int, batch: int, phase: str) -> None:
        self._where = (step, batch, PHASES.index(phase))
        self._last = time.monotonic()

    # the watching thread ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        period = min(1.0, self.timeout / 10)
        while not self._stop.wait(period):
            stalled = time.monotonic() - self._last
            if stalled >= self.timeout:
                self._fire(stalled)
                return

    def _note(self, stalled: float) -> dict[str, Any]:
        frame = sys._current_frames().get(self._main)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        in_torch = frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR)
        step, batch, phase = self._where
        return {
            "rank": self.rank,
            "step": step,
            "batch": batch,
            "phase": PHASES[phase],
            "in_torch": in_torch,
            "stalled": round(stalled, 1),
            "stack": stack,
        }

    def _gather(self, mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        notes = {self.rank: mine}
        if self.store is None or self.world_size == 1:
            return notes
        try:
            self.store.set(_KEY.format(rank=self.rank), json.dumps(mine))
        except Exception:
            return notes
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and len(notes) < self.world_size:
            for rank in range(self.world_size):
                if rank in notes:
                    continue
                try:
                    if self.store.check([_KEY.format(rank=rank)]):
                        notes[rank] = json.loads(self.store.get(_KEY.format(rank=rank)))
                except Exception:
                    pass
            time.sleep(0.1)
        return notes

    def _fire(self, stalled: float) -> None:
        notes = self._gather(self._note(stalled))
        culprits = find_culprits(notes, self.world_size)
        if self.rank in culprits:
            mine = notes[self.rank]
            message = (
                f"rank {self.rank} stopped making progress: nothing happened for {stalled:.1f} s (timeout "
                f"{self.timeout:g} s) in {mine['phase']} at step {mine['step']}, batch {mine['batch']}."
            )
            _record(message, f"Its main thread was here:\n{mine['stack']}{message}")
            os._exit(1)
        waiting_for = ", ".join(self._named(r) for r in culprits) or "no rank that could be told apart"
        message = (
            f"rank {self.rank} waited {stalled:.1f} s (timeout {self.timeout:g} s) for {waiting_for}, which did "
            f"not arrive at step {notes[self.rank]['step']}."
        )
        silent = bool(culprits) and all(r not in notes for r in culprits)
        if silent:
            message += " It did not answer at all: its host is lost, or cut off from this one."
        else:
            # The culprit ends first, so that the launcher reports it; this rank follows if nobody stops it. A
            # rank that could not answer cannot end first: there is nothing to wait for.
            time.sleep(self.grace * 2)
        _record(message, message)
        os._exit(1)

    def _named(self, rank: int) -> str:
        """``rank 1 (on h1)``: with its host, when the rank said which it is."""
        try:
            if self.store.check([_HOST_KEY.format(rank=rank)]):
                return f"rank {rank} (on {self.store.get(_HOST_KEY.format(rank=rank)).decode()})"
        except Exception:
            pass
        return f"rank {rank}"


def find_culprits(notes: dict[int, dict[str, Any]], world_size: int) -> list[int]:
    """The ranks that did not arrive: silent ones, else the furthest behind, preferring those in user code."""
    silent = [rank for rank in range(world_size) if rank not in notes]
    if silent:
        return silent

    def position(note: dict[str, Any]) -> tuple[int, int, int]:
        return note["step"], note["batch"], PHASES.index(note["phase"])

    behind = min(position(n) for n in notes.values())
    candidates = sorted(rank for rank, n in notes.items() if position(n) == behind)
    in_user_code = [r for r in candidates if not notes[r]["in_torch"] and notes[r]["phase"] in USER_PHASES]
    return in_user_code or candidates


def _record(message: str, callstack: str) -> None:
    """Write the failure where torch's elastic agent reads it (what an uncaught exception would write)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    print(f"stratagem: {message}", file=sys.stderr, flush=True)
    if not path:
        return
    data = {
        "message": {
            "message": f"TimeoutError: {message}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as file:
            json.dump(data, file)
        with open(path + FAILURE_SUFFIX, "w") as file:
            json.dump({"time": time.time()}, file)
    except OSError:
        pass

"""A node cut off from the rendezvous ends, instead of hanging.

torch's elastic agent talks to the rendezvous store (a TCPStore on the node that hosts the endpoint) from its
main thread while the workers run: each monitoring round asks it how many nodes wait to join. When the network
between this node and that host goes away without a word (a pulled cable, a dead switch port, a partition:
nothing resets the connection), that call does not come back. After its own timeout, ``TCPStore::doWait`` sends
``CANCEL_WAIT`` and waits for the server's answer with no timeout at all: a ``recv`` on a connection that the
kernel keeps retransmitting on for about 15 minutes. The agent's signal handlers (SIGTERM) cannot run until it
returns, and its workers, whose failures it would notice, are left running. Meanwhile the other nodes have dropped
this one from the rendezvous (its keep-alives stopped: ``keep_alive_interval`` x ``keep_alive_max_attempt``
seconds, 15 by default) and gone on without it.

So a thread probes the endpoint with a TCP connection, every ``keep_alive_interval`` seconds, each attempt
bounded by that interval. When none has got through for as long as the other nodes take to drop this one, this
node is out of the run: the thread stops its workers (SIGKILL), says so, and ends the launching process with
exit code 1, from the thread, since the main thread may never come back. Until a first probe gets through the
node is still joining, which the rendezvous's own ``join_timeout`` bounds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

#: torch's c10d rendezvous defaults: a node whose keep-alives stop is dropped after interval x attempts.
KEEP_ALIVE_INTERVAL_S = 5.0
KEEP_ALIVE_MAX_ATTEMPT = 3
#: The exit code of a launcher that ended because its node was cut off.
CUT_OFF_EXIT_CODE = 1


def reachable(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class RendezvousGuard:
    """Watches whether this node can still reach the rendezvous endpoint; see the module docstring.

    :param endpoint: ``host:port`` of the rendezvous.
    :param budget_s: how long the endpoint may stay out of reach.
    :param interval_s: time between probes (and each probe's bound).
    :param on_cut_off: called once, from the guard's thread, with what happened, when the budget is spent.
    """

    def __init__(
        self, endpoint: str, budget_s: float, interval_s: float, on_cut_off: Callable[[str], None]
    ) -> None:
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.budget_s, self.interval_s, self.on_cut_off = budget_s, interval_s, on_cut_off
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stratagem-rendezvous-guard", daemon=True)

    def __enter__(self) -> RendezvousGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _watch(self) -> None:
        last_reached: float | None = None
        while not self._stop.is_set():
            started = time.monotonic()
            if reachable(self.host, self.port, self.interval_s):
                last_reached = time.monotonic()
            elif last_reached is not None and time.monotonic() - last_reached >= self.budget_s:
                if not self._stop.is_set():
                    self.on_cut_off(
                        f"this node ({socket.gethostname()}) cannot reach the rendezvous at "
                        f"{self.host}:{self.port}: nothing got through for {time.monotonic() - last_reached:.0f} s "
                        f"(the other nodes drop a node after {self.budget_s:g} s without keep-alives and go on "
                        "without it)"
                    )
                return
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))


def guard_budget(configs: Mapping[str, Any]) -> tuple[float, float]:
    """``(budget, interval)`` from the rendezvous settings: as long as the other nodes wait for keep-alives."""
    interval = float(configs.get("keep_alive_interval", KEEP_ALIVE_INTERVAL_S))
    attempts = int(configs.get("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT))
    return interval * attempts, interval


def end_cut_off_node(message: str, workers: Callable[[], Iterable[int]], cleanup: Callable[[], None]) -> None:
    """Stop this node's workers and end the process: it is out of the run, and its main thread may be stuck."""
    for pid in workers():
        # Each worker leads a process group of its own (its DataLoader workers are in it).
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    print(f"stratagem: {message}; stopped this node's workers.", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        cleanup()
    os._exit(CUT_OFF_EXIT_CODE)


def guard(max_nodes: int, parameters: Any, workers: Callable[[], Iterable[int]], scratch: Path) -> Any:
    """The guard for a run of ``max_nodes`` nodes with these rendezvous parameters (torch's
    ``RendezvousParameters``); none on one node, whose endpoint is on this machine."""
    if max_nodes == 1:
        return contextlib.nullcontext()
    budget, interval = guard_budget(parameters.config)

    def cut_off(message: str) -> None:
        end_cut_off_node(message, workers, lambda: shutil.rmtree(scratch, ignore_errors=True))

    return RendezvousGuard(parameters.endpoint, budget, interval, cut_off)

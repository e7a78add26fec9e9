"""Simulated ranks on several cores: a plan's ranks are independent of each other, so the ranks after the first are
simulated in forked children of this process while it simulates the first.

A child is forked before any simulated world is entered (``simulated_world`` is a process-wide state: a default
process group, patched torch functions), so each child starts from the parent's state between two ranks, exactly as
a rank simulated next in this process would. It sends back, per rank, what the rank holds, or why it could not be
simulated, and the warnings raised meanwhile (the plan reports them with the strategy's). A child that dies without
answering (killed, out of memory) fails the strategy's plan naming the rank.

Without ``fork`` (Windows), or given one worker, every rank is simulated in this process, one after another.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from stratagem.errors import StratagemError

Job = tuple[int, bool]  # (rank, step)
Simulate = Callable[[int, bool], Any]
Describe = Callable[[Exception], str]


class RankFailed(StratagemError):
    """A rank simulated in a child could not be: the child's reason, as this process would have given it."""


def default_workers() -> int:
    """The cores this process may run on (1 without ``fork``)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_jobs(jobs: Sequence[Job], simulate: Simulate, describe: Describe, workers: int) -> list[Any]:
    """``simulate(rank, step)`` of each job, in the jobs' order: the first in this process, the others dealt out
    to up to ``workers - 1`` forked children running meanwhile. ``describe`` words an exception raised in a child
    as the plan would word it; a :class:`StratagemError` keeps its own message."""
    if workers <= 1 or len(jobs) <= 1 or default_workers() == 1:
        return [simulate(rank, step) for rank, step in jobs]
    children = min(workers - 1, len(jobs) - 1)
    # Dealt round-robin: each child's ranks cost about the same (a pipeline's stages alike, FSDP's shards alike).
    shares = [list(jobs[1 + i :: children]) for i in range(children)]
    context = multiprocessing.get_context("fork")
    started: list[tuple[Any, Any, list[Job]]] = []
    try:
        for share in shares:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(share, simulate, describe, send), daemon=True)
            process.start()
            send.close()
            started.append((process, receive, share))
        first = simulate(*jobs[0])
        answers = {
            job: answer for process, receive, share in started for job, answer in _collect(receive, share)
        }
    finally:
        for process, receive, _ in started:
            receive.close()
            if process.is_alive():
                process.kill()
            process.join()
    return [first, *(answers[job] for job in jobs[1:])]


def _collect(receive: Any, share: list[Job]) -> list[tuple[Job, Any]]:
    found = []
    for rank, step in share:
        try:
            kind, value, caught = receive.recv()
        except EOFError:
            raise RankFailed(
                f"the simulation of rank {rank} ended without an answer (its process died: killed, or out of "
                "memory); plan with workers=1 (`stratagem plan --workers 1`) to see it fail in this process"
            ) from None
        for message, category in caught:
            warnings.warn(message, category, stacklevel=2)
        if kind != "ok":
            raise RankFailed(value)
        found.append(((rank, step), value))
    return found


def _picklable(category: type[Warning]) -> type[Warning]:
    import pickle

    try:
        pickle.dumps(category)
    except Exception:  # a class that cannot be found by its name: its message goes as a plain warning
        return UserWarning
    return category


def _child(share: list[Job], simulate: Simulate, describe: Describe, send: Any) -> None:
    for rank, step in share:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                answer: tuple[str, Any] = ("ok", simulate(rank, step))
            except StratagemError as error:
                answer = ("failed", str(error))
            except Exception as error:
                answer = ("failed", describe(error))
        send.send((*answer, [(str(w.message), _picklable(w.category)) for w in caught]))
        if answer[0] != "ok":
            break
    send.close()

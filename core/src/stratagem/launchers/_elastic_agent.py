"""torch's elastic agent, run by stratagem so that each restart of the worker group is on record.

The agent (``LocalElasticAgent``) starts the workers, watches them and, when one fails and restarts remain,
stops the group and starts it again. What failed is known only inside the agent; stratagem's agent writes it
down (rank, exit code or signal, the worker's recorded exception, time) as one JSON line per failed attempt in
the file named by ``STRATAGEM_RESTART_LOG``, which the restarted workers read to report the restart and the
work it cost.

A preemption signal (:mod:`stratagem.launchers._preemption_signals`) that reaches the agent goes on to the workers, which
get the grace period to save and stop, and workers that stopped for a preemption are not restarted: the run ends
with :class:`~stratagem.errors.Preempted`. Everything else is the agent's own behaviour.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stratagem.errors import PREEMPTED_EXIT_CODE
from stratagem.launchers import _forked_workers, _preemption_signals, _reachability, _rounds
from stratagem.launchers._failure_records import describe_failure
from stratagem.launchers._restarts import RESTART_COUNT_ENV, RESTART_LOG_ENV

__all__ = ["RESTART_LOG", "RESTART_LOG_ENV", "run_agent"]

#: The restart log's name in the launch's scratch folder.
RESTART_LOG = "restarts.jsonl"


def _agent_class() -> type:
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class RecordingAgent(LocalElasticAgent):
        """The local agent, noting each failed attempt before it restarts the group."""

        def __init__(
            self,
            *args: Any,
            restart_log: Path,
            worker_tmp: Path,
            preemption_signals: tuple[str, ...] = (),
            grace_s: float = _preemption_signals.DEFAULT_GRACE_S,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            self.restart_log = restart_log
            self.worker_tmp = worker_tmp
            self.preemption_signals = {getattr(signal, name) for name in preemption_signals}
            self.grace_s = grace_s
            #: The preemption signal this process got, and when (wall clock).
            self.preempted_by: str | None = None
            self.preempted_at: float | None = None
            #: Whether the workers ended for a preemption that reached them (and not this process).
            self.workers_preempted = False
            #: Workers the agent stopped (they did not fail).
            self.stopped_pids: set[int] = set()

        def _start_workers(self, worker_group: Any) -> Any:
            # torch.multiprocessing names a file per function worker in the temporary directory, where a
            # worker that raises writes its traceback, and never removes it: have it named in the launch's
            # folder instead. Only while the workers start, as tempfile.tempdir is the whole process's.
            saved = tempfile.tempdir
            tempfile.tempdir = str(self.worker_tmp)
            scripts = worker_group.spec.entrypoint is _forked_workers.run_script
            try:
                with _forked_workers.no_main_to_import() if scripts else contextlib.nullcontext():
                    return super()._start_workers(worker_group)
            finally:
                tempfile.tempdir = saved
                self._stop_at_once()

        def _set_local_rank_env(self, worker_env: dict[str, Any], *args: Any) -> None:
            super()._set_local_rank_env(worker_env, *args)
            if self._start_method == "forkserver":
                _forked_workers.environment_for_worker(worker_env)

        def _stop_at_once(self) -> None:
            # Once a worker failed, torch stops the others with SIGTERM and waits up to 30 s. A worker that
            # catches SIGTERM as a preemption would save instead, and one blocked in a collective would not see
            # the signal before the collective ends: stop them with SIGKILL. A signal the agent passes on (a
            # preemption) is given explicitly and stays what it is.
            context = self._pcontext
            if context is None or getattr(context, "_stratagem_stops", False):
                return
            # Forked workers (torch.multiprocessing's): its join, which sees the failure first, stops the others
            # itself with terminate (SIGTERM) and waits up to 30 s.
            for process in getattr(getattr(context, "_pc", None), "processes", None) or []:
                process.terminate = process.kill
            close = context.close
            # Weak references: the context holds this function, and a cycle through the agent would keep the
            # rendezvous store (and its port) alive after the run until the garbage collector came by.
            agent, held = weakref.ref(self), weakref.ref(context)

            def stopping_close(death_sig: Any = None, timeout: int = 30) -> None:
                me, pcontext = agent(), held()
                if death_sig is None:
                    if me is not None and pcontext is not None:
                        me.stopped_pids.update(_running_pids(pcontext))
                    death_sig = signal.SIGKILL
                close(death_sig, timeout)

            context.close = stopping_close
            context._stratagem_stops = True

        def _restart_workers(self, worker_group: Any) -> None:
            # Restarts for a failure and for a node joining alike: the new workers must resume either way,
            # and torch counts only the first kind in TORCHELASTIC_RESTART_COUNT.
            self.restarts_done = getattr(self, "restarts_done", 0) + 1
            os.environ[RESTART_COUNT_ENV] = str(self.restarts_done)
            super()._restart_workers(worker_group)

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                return result
            # The workers torch stopped because another failed are on its list too, "for bookkeeping": they
            # did not fail.
            failures = {r: f for r, f in result.failures.items() if f.pid not in self.stopped_pids}
            result.failures = failures or result.failures
            if any(f.exitcode == PREEMPTED_EXIT_CODE for f in result.failures.values()):
                # A preemption is no failure to restart from: the machine is being taken back. A worker exits
                # with this code only after every rank has saved and passed the barrier that follows.
                self.workers_preempted = True
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:
                self._note(worker_group, result)
            return result

        def _stop_workers(self, worker_group: Any, *args: Any, **kwargs: Any) -> None:
            # For a restart, or after the last failure: at once (see _stop_at_once).
            if self._pcontext is not None:
                self.stopped_pids.update(_running_pids(self._pcontext))
            self._shutdown(signal.SIGKILL)

        def _invoke_run(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.elastic.multiprocessing import SignalException

            try:
                return super()._invoke_run(*args, **kwargs)
            except SignalException as error:
                # torch's handler raised: the agent's shutdown passes the signal on to the workers next.
                if error.sigval in self.preemption_signals and self.preempted_by is None:
                    self.preempted_by, self.preempted_at = signal.Signals(error.sigval).name, time.time()
                    _ignore(self.preemption_signals)  # a second signal must not cut the wait short
                    print(
                        f"stratagem: {self.preempted_by}: passed on to the workers; waiting up to "
                        f"{self.grace_s:g} s for them to save and stop.",
                        file=sys.stderr,
                        flush=True,
                    )
                raise

        def _shutdown(self, death_sig: Any = signal.SIGTERM, timeout: int = 30) -> None:
            if self.preempted_by is not None and death_sig == getattr(signal, self.preempted_by):
                # The workers save and stop: they get the grace period, not the seconds of a plain shutdown.
                timeout = self.grace_s  # type: ignore[assignment]
            super()._shutdown(death_sig, timeout)

        def _note(self, worker_group: Any, result: Any) -> None:
            spec = worker_group.spec
            attempt = spec.max_restarts - self._remaining_restarts
            root = describe_failure(result.failures) if result.failures else None
            why = "" if root is None else root.detail.strip().splitlines()[-1] if root.detail.strip() else ""
            if root is not None and why.startswith(f"rank {root.rank} "):
                why = why[len(f"rank {root.rank} ") :].rstrip(".")  # the watchdog's message names its rank
            entry = {
                "attempt": attempt,
                "time": time.time(),
                "rank": None if root is None else root.rank,
                "why": why,
            }
            with open(self.restart_log, "a") as file:
                file.write(json.dumps(entry) + "\n")
            what = f"rank {root.rank} {why}" if root is not None else "a worker failed"
            print(
                f"stratagem: {what}; restarting the workers ({attempt + 1} of {spec.max_restarts} restarts).",
                file=sys.stderr,
                flush=True,
            )

    return RecordingAgent


def _running_pids(context: Any) -> set[int]:
    """The workers of a torch process context that are still running (a script's or a function's)."""
    handlers = getattr(context, "subprocess_handlers", None) or {}
    running = {h.proc.pid for h in handlers.values() if h.proc.poll() is None}
    processes = getattr(getattr(context, "_pc", None), "processes", None) or []
    return running | {p.pid for p in processes if p.is_alive()}


def _addr_and_port(backend: str, endpoint: str) -> tuple[str | None, int | None]:
    # With a static rendezvous, node 0 hosts the store at the endpoint; c10d finds them itself.
    if backend != "static":
        return None, None
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def run_agent(
    *,
    entrypoint: Any,
    args: list[Any],
    nproc_per_node: int,
    min_nodes: int,
    max_nodes: int,
    run_id: str,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_configs: dict[str, Any],
    max_restarts: int,
    scratch: Path,
    monitor_interval: float = 0.1,
    start_method: str = "spawn",
    shutdown_timeout: int = 5,
) -> dict[int, Any]:
    """Run the workers to the end; return this node's results by rank. Raises ``ChildFailedError``.

    Everything the agent and its workers write down (the restart log, each attempt's per-rank error files) goes
    under ``scratch``, a folder the caller owns and removes.
    """
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    parameters = RendezvousParameters(
        backend=rdzv_backend,
        endpoint=rdzv_endpoint,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        **rdzv_configs,
    )
    master_addr, master_port = _addr_and_port(rdzv_backend, rdzv_endpoint)
    spec = WorkerSpec(
        role="default",
        local_world_size=nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=_rounds.publish_each_round(get_rendezvous_handler(parameters)),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
    )
    worker_tmp = scratch / "tmp"
    worker_tmp.mkdir(exist_ok=True)
    _freeze_at_exit()
    signals, grace_s = _preemption_signals.from_env()
    agent = _agent_class()(
        spec=spec,
        # Without a log_dir the agent makes a folder of its own in the temporary directory and leaves it there.
        logs_specs=DefaultLogsSpecs(log_dir=str(scratch / "logs")),
        start_method=start_method,
        shutdown_timeout=shutdown_timeout,
        restart_log=scratch / RESTART_LOG,
        worker_tmp=worker_tmp,
        preemption_signals=signals,
        grace_s=grace_s,
    )
    # With several nodes, one cut off from the rendezvous ends rather than hangs in a store call.
    guard = _reachability.guard(
        max_nodes, parameters, lambda: _running_pids(agent._pcontext) if agent._pcontext else set(), scratch
    )
    try:
        with _signal_handlers_kept(signals), _agent_handles(signals), guard:
            result = agent.run()
        if result.is_failed() and agent.workers_preempted:
            raise _preemption_signals.report(None, None, _preemption_signals.read_notes(scratch), grace_s)
        if result.is_failed():
            name = (
                entrypoint if isinstance(entrypoint, str) else getattr(entrypoint, "__qualname__", "worker")
            )
            raise ChildFailedError(name=name, failures=result.failures)
        return result.return_values
    except SignalException as error:
        if agent.preempted_by is not None:
            notes = _preemption_signals.read_notes(scratch)
            raise _preemption_signals.report(agent.preempted_by, agent.preempted_at, notes, grace_s) from None
        if error.sigval != signal.SIGINT:
            raise
        # Ctrl-C: the agent has stopped the workers; say it as Python does.
        raise KeyboardInterrupt from None
    finally:
        spec.rdzv_handler.shutdown()
        _rounds.forget()


_freeze_registered = False


def _freeze_at_exit() -> None:
    """At this process's exit, after the handlers registered from here on: :func:`gc.freeze` what is alive.

    The interpreter's teardown then frees those objects as their references go, without the full collections
    that walk all of torch's objects again and again: most of a second of a launcher's exit, which a preempted
    run spends inside its grace period. A launching process holds no process group whose threads could still
    need the objects such a collection would free.
    """
    global _freeze_registered
    if not _freeze_registered:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _freeze_registered = True


#: The signals torch's agent turns into ``SignalException`` once it has started workers.
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
#: Where torch's agent reads which signals to handle (torchrun's ``--signals_to_handle``).
_HANDLED_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


@contextlib.contextmanager
def _agent_handles(preemption_signals: tuple[str, ...]) -> Iterator[None]:
    """Have torch's agent handle the preemption signals too (SIGUSR1 would otherwise end this process and leave
    the workers running): its handler ends the monitoring, and its shutdown passes the signal on."""
    saved = os.environ.get(_HANDLED_ENV)
    names = list(dict.fromkeys([*(saved.split(",") if saved else _AGENT_SIGNALS), *preemption_signals]))
    os.environ[_HANDLED_ENV] = ",".join(names)
    # Its warning on the signal ("Received 15 death signal") says less than stratagem's own line; torch gives
    # each of its loggers a level of its own, so the parent's (launchers/_worker_start.py) does not reach this one.
    chatty = logging.getLogger("torch.distributed.elastic.agent.server.api")
    level = chatty.level
    chatty.setLevel(logging.ERROR)
    try:
        yield
    finally:
        chatty.setLevel(level)
        if saved is None:
            os.environ.pop(_HANDLED_ENV, None)
        else:
            os.environ[_HANDLED_ENV] = saved


def _ignore(signals: set[Any]) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def _signal_handlers_kept(extra: tuple[str, ...] = ()) -> Iterator[None]:
    # The agent installs its handlers and never puts back the ones it found: after Engine.launch(fn) returned,
    # a Ctrl-C would still raise torch's SignalException instead of KeyboardInterrupt.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = dict.fromkeys([*_AGENT_SIGNALS, *extra])
    signals = [getattr(signal, name) for name in names if hasattr(signal, name)]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)

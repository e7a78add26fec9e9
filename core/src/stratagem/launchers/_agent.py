"""torch's elastic agent, run by stratagem so that each restart of the worker group is on record.

The agent (``LocalElasticAgent``) starts the workers, watches them and, when one fails and restarts remain,
stops the group and starts it again. What failed is known only inside the agent; stratagem's agent writes it
down (rank, exit code or signal, the worker's recorded exception, time) as one JSON line per failed attempt in
the file named by ``STRATAGEM_RESTART_LOG``, which the restarted workers read to report the restart and the
work it cost. Everything else is the agent's own behaviour.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stratagem.launchers._failures import describe
from stratagem.launchers._restarts import RESTART_COUNT_ENV, RESTART_LOG_ENV

__all__ = ["RESTART_LOG", "RESTART_LOG_ENV", "run_agent"]

#: The restart log's name in the launch's scratch folder.
RESTART_LOG = "restarts.jsonl"


def _agent_class() -> type:
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class RecordingAgent(LocalElasticAgent):
        """The local agent, noting each failed attempt before it restarts the group."""

        def __init__(self, *args: Any, restart_log: Path, worker_tmp: Path, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.restart_log = restart_log
            self.worker_tmp = worker_tmp

        def _start_workers(self, worker_group: Any) -> Any:
            # torch.multiprocessing names a file per function worker in the temporary directory, where a
            # worker that raises writes its traceback, and never removes it: have it named in the launch's
            # folder instead. Only while the workers start, as tempfile.tempdir is the whole process's.
            saved = tempfile.tempdir
            tempfile.tempdir = str(self.worker_tmp)
            try:
                return super()._start_workers(worker_group)
            finally:
                tempfile.tempdir = saved

        def _restart_workers(self, worker_group: Any) -> None:
            # Restarts for a failure and for a node joining alike: the new workers must resume either way,
            # and torch counts only the first kind in TORCHELASTIC_RESTART_COUNT.
            self.restarts_done = getattr(self, "restarts_done", 0) + 1
            os.environ[RESTART_COUNT_ENV] = str(self.restarts_done)
            super()._restart_workers(worker_group)

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts > 0:
                self._note(worker_group, result)
            return result

        def _note(self, worker_group: Any, result: Any) -> None:
            spec = worker_group.spec
            attempt = spec.max_restarts - self._remaining_restarts
            root = describe(result.failures) if result.failures else None
            why = "" if root is None else root.detail.strip().splitlines()[-1] if root.detail.strip() else ""
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
        rdzv_handler=get_rendezvous_handler(parameters),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
    )
    worker_tmp = scratch / "tmp"
    worker_tmp.mkdir(exist_ok=True)
    agent = _agent_class()(
        spec=spec,
        # Without a log_dir the agent makes a folder of its own in the temporary directory and leaves it there.
        logs_specs=DefaultLogsSpecs(log_dir=str(scratch / "logs")),
        start_method=start_method,
        shutdown_timeout=shutdown_timeout,
        restart_log=scratch / RESTART_LOG,
        worker_tmp=worker_tmp,
    )
    try:
        with _signal_handlers_kept():
            result = agent.run()
        if result.is_failed():
            name = (
                entrypoint if isinstance(entrypoint, str) else getattr(entrypoint, "__qualname__", "worker")
            )
            raise ChildFailedError(name=name, failures=result.failures)
        return result.return_values
    except SignalException as error:
        if error.sigval != signal.SIGINT:
            raise
        # Ctrl-C: the agent has stopped the workers; say it as Python does.
        raise KeyboardInterrupt from None
    finally:
        spec.rdzv_handler.shutdown()


#: The signals torch's agent turns into ``SignalException`` once it has started workers.
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    # The agent installs its handlers and never puts back the ones it found: after Engine.launch(fn) returned,
    # a Ctrl-C would still raise torch's SignalException instead of KeyboardInterrupt.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [getattr(signal, name) for name in _AGENT_SIGNALS if hasattr(signal, name)]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)

"""Launchers: how the worker processes of a run start, restart and report, chosen by name like strategies.

``elastic`` (torch's elastic agent) is built in and the default; other launchers come from plugins
(``stratagem-ray``: ``ray``). A process that is already a worker (torchrun, SLURM, a launcher's worker)
launches nothing.

A launcher plugin subclasses :class:`Launcher` and implements ``launch_workers(job)`` for a :class:`LaunchJob`.
The rest is the launcher author's kit, the parts every launcher shares so that a failure reads the same
whichever launcher ran the workers:

- :data:`ERROR_FILE_ENV`: give each worker a file of its own in this variable; stratagem, in the worker,
  records an uncaught exception there (:func:`record_exception` does it for a function job's runner).
- :class:`WorkerExit` and :func:`describe_failure`: how each worker ended, and the
  :class:`~stratagem.errors.WorkerFailedError` to raise (the rank that failed first for its own reason, with
  its traceback).
- :func:`is_lost_peer` and :data:`LOST_PEER_GRACE_S`: a collective that lost its peer is a consequence, not a
  cause; how long to wait for the cause.
- :func:`worker_threads`: the compute threads of a worker that a scheduler started as a task of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.launchers._failure_records import (
        ERROR_FILE_ENV,
        LOST_PEER_GRACE_S,
        WorkerExit,
        describe_failure,
        is_lost_peer,
        record_exception,
    )
    from stratagem.launchers._job import LauncherCapabilities, LaunchJob
    from stratagem.launchers._worker_start import worker_threads
    from stratagem.launchers.elastic import ElasticLauncher
    from stratagem.launchers.launcher import Launcher

__all__ = [
    "ERROR_FILE_ENV",
    "LOST_PEER_GRACE_S",
    "ElasticLauncher",
    "LaunchJob",
    "Launcher",
    "LauncherCapabilities",
    "WorkerExit",
    "describe_failure",
    "is_lost_peer",
    "record_exception",
    "worker_threads",
]

_LAZY = {
    "LaunchJob": "stratagem.launchers._job",
    "LauncherCapabilities": "stratagem.registry.capabilities",
    "Launcher": "stratagem.launchers.launcher",
    "ElasticLauncher": "stratagem.launchers.elastic",
    "ERROR_FILE_ENV": "stratagem.launchers._failure_records",
    "LOST_PEER_GRACE_S": "stratagem.launchers._failure_records",
    "WorkerExit": "stratagem.launchers._failure_records",
    "describe_failure": "stratagem.launchers._failure_records",
    "is_lost_peer": "stratagem.launchers._failure_records",
    "record_exception": "stratagem.launchers._failure_records",
    "worker_threads": "stratagem.launchers._worker_start",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())

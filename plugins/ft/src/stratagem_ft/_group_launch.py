"""``python -m stratagem_ft._group_launch JOB RESULT``: one replica group's launch, in a process of its own.

The ``replica_groups`` launcher starts one of these per group. Each runs the group's workers under torch's
elastic agent (stratagem's ``elastic`` launcher), which restarts that group alone, ``max_restarts`` times, when
one of its workers fails; the other groups' launches go on. The outcome is written to RESULT for the launcher.
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing import spawn
from typing import Any

from stratagem.errors import WorkerFailedError
from stratagem.launchers import ElasticLauncher

#: What a function job needs of ``multiprocessing.spawn.get_preparation_data`` to import the launching script.
PREPARATION_KEYS = ("sys_path", "sys_argv", "dir", "init_main_from_name", "init_main_from_path")


def write_job(path: str, job: Any) -> None:
    """Write ``job`` for a group's process, after what that process needs to import the launching script (a
    function job's function may be defined there)."""
    preparation = None
    if job.kind == "function":
        data = spawn.get_preparation_data("stratagem-ft-replica-group")
        # Only what locates the script: the rest (the authentication key above all) does not pickle.
        preparation = {key: data[key] for key in PREPARATION_KEYS if key in data}
    with open(path, "wb") as file:
        pickle.dump(preparation, file)
        pickle.dump(job, file)


def main(job_path: str, result_path: str) -> int:
    with open(job_path, "rb") as file:
        preparation = pickle.load(file)
        if preparation is not None:
            spawn.prepare(preparation)
        job = pickle.load(file)
    code = 0
    try:
        outcome: tuple[Any, ...] = ("ok", ElasticLauncher().launch_workers(job))
    except WorkerFailedError as error:
        outcome, code = ("failed", error.rank, error.exitcode, error.detail), 1
    except SystemExit as error:  # a preemption (stratagem.Preempted) or the agent's own exit
        outcome, code = ("exited", error.code, str(error)), (error.code if isinstance(error.code, int) else 1)
    with open(result_path, "wb") as file:
        pickle.dump(outcome, file)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

"""``python -m stratagem_subprocess.worker FOLDER``: one worker of a function job.

It becomes what a process that ``multiprocessing`` spawns is (the launching script imported in its stead, so
that functions defined there unpickle), calls the pickled ``(function, args)`` of ``FOLDER/call.pkl`` and
writes what it returned to ``FOLDER/result-RANK.pkl``. When the function raises, the exception is recorded
where stratagem's launchers read it, and the worker exits 1.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import traceback
from multiprocessing import spawn
from pathlib import Path

from stratagem.launchers import record_exception

CALL_FILE = "call.pkl"


def result_file(folder: Path, rank: int) -> Path:
    return folder / f"result-{rank}.pkl"


def main(folder: Path) -> int:
    try:
        with open(folder / CALL_FILE, "rb") as file:
            # The preparation first: unpickling the function may need the script it was defined in.
            spawn.prepare(pickle.load(file))
            function, args = pickle.load(file)
        result = function(*args)
        written = result_file(folder, int(os.environ["RANK"])).with_suffix(".tmp")
        written.write_bytes(pickle.dumps(result))
        written.replace(written.with_suffix(".pkl"))
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (None, 0):
            return 0
        if not record_exception(type(error), error, error.__traceback__):
            traceback.print_exception(error)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # The exception is on record. An ordinary exit would tear down a live process group from
        # arbitrary threads, which can abort the process and hide the exception behind a signal.
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

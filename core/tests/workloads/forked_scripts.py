"""A script that writes down what its worker sees (argv, path, ``__main__``, session, parent), for
test_launcher's comparison of forked and spawned script workers. ``python forked_scripts.py OUT [exit CODE |
raise]``: with the second form, rank 1 then exits with CODE or raises."""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

from stratagem.launchers._worker_start import install_worker_excepthook

if __name__ == "__main__":
    install_worker_excepthook()
    out, rank = sys.argv[1], os.environ["RANK"]
    atexit.register(Path(f"{out}.exit.{rank}").write_text, "exit handlers ran")
    seen = {
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "file": __file__,
        "main": sys.modules["__main__"].__dict__ is globals(),
        "spec": None if __spec__ is None else __spec__.name,
        "cwd": os.getcwd(),
        "session_leader": os.getsid(0) == os.getpid(),
        "parent": os.getppid(),
        # What ps shows (and a search for leftover workers reads); the memory after the arguments is zeroed.
        "cmdline": [arg for arg in Path("/proc/self/cmdline").read_bytes().decode().split("\0") if arg],
    }
    Path(f"{out}.{rank}").write_text(json.dumps(seen))
    if len(sys.argv) > 2 and rank == "1":
        if sys.argv[2] == "exit":
            sys.exit(int(sys.argv[3]))
        raise ValueError("deliberate failure in the script")

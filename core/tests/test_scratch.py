"""Scratch in the temporary directory: what a killed process left is removed by the next process that makes
scratch; what a live process holds, or a process of another machine, is not."""

from __future__ import annotations

import os
import subprocess
import sys

from stratagem.checkpoint import _scratch

MAKER = """
import sys, time
from stratagem.checkpoint import _scratch
print(_scratch.make_file("upload"), _scratch.make_dir("agent"), flush=True)
time.sleep(60)
"""


def _maker() -> tuple[subprocess.Popen[str], list[str]]:
    process = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, [os.path.basename(path) for path in process.stdout.readline().split()]


def test_a_killed_makers_scratch_goes_at_the_next_make_and_a_live_ones_stays(temp_dir) -> None:
    killed, killed_names = _maker()
    live, live_names = _maker()
    killed.kill()
    killed.wait()
    (temp_dir.path / killed_names[1] / "error.json").write_text("{}")  # a folder goes with what is in it
    machine = _scratch._machine()
    # Another machine's (a temporary directory shared over the network, another container): its process ids
    # mean nothing here. A process id reused by a later process: its start time differs.
    other_machine = "00000000" if machine != "00000000" else "11111111"
    elsewhere = f"stratagem-upload-{killed.pid}-1-{other_machine}-abcdefgh"
    reused = f"stratagem-upload-{os.getpid()}-1-{machine}-abcdefgh"
    unrelated = "stratagem-upload-abcdefgh"  # not named by this module: whose it is cannot be told
    for name in (elsewhere, reused, unrelated):
        (temp_dir.path / name).write_bytes(b"x")
    try:
        with _scratch.file("upload") as mine:
            assert sorted(os.listdir(temp_dir.path)) == sorted([*live_names, elsewhere, unrelated, mine.name])
        assert not mine.exists()
        live.kill()
        live.wait()
        with _scratch.folder("agent") as folder:
            (folder / "restarts.jsonl").touch()
            assert sorted(os.listdir(temp_dir.path)) == sorted([elsewhere, unrelated, folder.name])
        assert sorted(os.listdir(temp_dir.path)) == sorted([elsewhere, unrelated])
    finally:
        live.kill()
        live.wait()

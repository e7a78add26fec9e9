"""Crash safety at scale: SIGKILL a save at a random moment, 100 times per format, and load after each.

Each trial forks a process that saves version N over version N-1 and kills it after a delay drawn uniformly
from [0, 1.15 x the duration of a whole save]; the checkpoint must then load whole, as N-1 or N. A kill counts
as "while writing" only if it landed before the publishing rename (the old version still loads, and data of
the new one was on disk); a kill after it is counted apart.
The trials themselves live in core/tests/ckpt_workers.py (the test runs 10 of them per format).

    /work/venv/bin/python benchmarks/checkpoint_crash.py [--trials 100] [--megabytes 64]

With ``--s3`` the saves go to a local S3 API server (moto, core/tests/s3_server.py) as a Trainer's periodic
checkpoints do (checkpoint, ``last``, pruning), and after each kill the lookup behind ``ckpt_path="last"`` must
find a checkpoint that loads whole (``ckpt_workers.store_crash_trials``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "tests"))
import ckpt_workers as W
from _common import table


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--s3", action="store_true", help="save to a local S3 API server")
    args = parser.parse_args()
    if args.s3:
        return _s3(args)
    rows, failed = [], False
    for fmt in ("full", "sharded"):
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
            r = W.crash_trials(tmp, fmt, args.trials, args.megabytes, args.seed)
        failed |= bool(r["errors"]) or not r["final_version_ok"] or bool(r["leftovers_after_clean_save"])
        rows.append(
            [
                fmt,
                r["trials"],
                f"{r['save_ms']:.0f} ms",
                r["killed_mid_save"],
                r["killed_while_writing"],
                r["killed_after_publishing"],
                r["loaded_previous"],
                r["loaded_new"],
                len(r["errors"]),
            ]
        )
        for error in r["errors"]:
            print(f"{fmt}: {error}")
    print(
        table(
            rows,
            [
                "format",
                "trials",
                "save",
                "killed mid-save",
                "killed while writing (before publishing)",
                "killed after publishing",
                "loaded previous",
                "loaded new",
                "unloadable",
            ],
        )
    )
    return 1 if failed else 0


def _s3(args: argparse.Namespace) -> int:
    import os

    from s3_server import S3Server

    rows, failed = [], False
    with S3Server() as server:
        server.create_bucket("crash")
        os.environ.update(server.env())
        for fmt in ("full", "sharded"):
            r = W.store_crash_trials(f"s3://crash/{fmt}", fmt, args.trials, args.megabytes, args.seed)
            failed |= bool(r["errors"])
            rows.append(
                [
                    fmt,
                    r["trials"],
                    f"{r['save_ms']:.0f} ms",
                    r["killed_mid_save"],
                    r["loaded_previous"],
                    r["loaded_new"],
                    len(r["errors"]),
                ]
            )
            for error in r["errors"]:
                print(f"{fmt}: {error}")
    header = [
        "format (S3)",
        "trials",
        "save",
        "killed mid-save",
        "last = previous",
        "last = new",
        "unloadable",
    ]
    print(table(rows, header))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Building blocks for a strategy that writes its own on-disk layout (the DeepSpeed adapter does).

Such a strategy still owes users what every stratagem checkpoint promises: atomic publication, every rank
failing together with each rank's error, per-rank values, plain state that loads without pickled code, and a
``stratagem.json`` naming its ``layout`` so that ``stratagem checkpoint consolidate`` can find the strategy's
``consolidate(source, output)``, and checksums: the CRC32C of every file computed as it is written
(:class:`Summing`), recorded in ``stratagem.json`` (:func:`manifest_checksums`, sealed by :func:`seal`) and verified
before a load reads the files (:func:`verify_files`). These are the same functions the built-in formats use.
"""

from __future__ import annotations

from pathlib import Path

from stratagem.checkpoint._atomic import (
    atomic_file,
    fsync_tree,
    publish_directory,
    recover,
    remove,
    remove_stale_temporaries,
    temporary_sibling,
)
from stratagem.checkpoint._checksum import ChecksumError, Summing, crc_of, hexdigest, seal
from stratagem.checkpoint._load import _restore_plain as restore_plain
from stratagem.checkpoint._ranks import _agree as agree
from stratagem.checkpoint._ranks import _attempt as attempt
from stratagem.checkpoint._ranks import _gather_per_rank as gather_per_rank
from stratagem.checkpoint._ranks import _local_state as local_state
from stratagem.checkpoint._read import file_checksums, read_json_metadata, read_sharded_state
from stratagem.checkpoint._state_layout import (
    FORMAT_VERSION,
    METADATA_FILE,
    STATE_FILE,
    Parts,
    metadata,
    owner_of,
)
from stratagem.checkpoint._state_layout import classify as split_state
from stratagem.checkpoint._write import manifest_checksums

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILE",
    "STATE_FILE",
    "ChecksumError",
    "Parts",
    "Summing",
    "agree",
    "atomic_file",
    "attempt",
    "crc_of",
    "file_checksums",
    "fsync_tree",
    "gather_per_rank",
    "hexdigest",
    "local_state",
    "manifest_checksums",
    "metadata",
    "owner_of",
    "publish_directory",
    "read_json_metadata",
    "read_sharded_state",
    "recover",
    "remove",
    "remove_stale_temporaries",
    "restore_plain",
    "seal",
    "split_state",
    "temporary_sibling",
    "verify_files",
]


def verify_files(directory: Path, meta: dict) -> None:
    """Refuse a checkpoint directory whose files are not those its ``stratagem.json`` recorded the checksums of
    (nothing to check for one written before checkpoints recorded them)."""
    checksums = file_checksums(meta)
    if checksums is None:
        return
    for name, expected in checksums.items():
        try:
            found = crc_of(directory / name)
        except FileNotFoundError:
            found = "(file missing)"
        if found != expected:
            raise ChecksumError(directory, name, expected, found)

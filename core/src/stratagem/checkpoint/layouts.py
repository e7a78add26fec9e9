"""Building blocks for a strategy that writes its own on-disk layout (the DeepSpeed adapter does).

Such a strategy still owes users what every stratagem checkpoint promises: atomic publication, every rank
failing together with each rank's error, per-rank values, plain state that loads without pickled code, and a
``stratagem.json`` naming its ``layout`` so that ``stratagem checkpoint consolidate`` can find the strategy's
``consolidate(source, output)``. These are the same functions the built-in formats use.
"""

from __future__ import annotations

from stratagem.checkpoint._atomic import (
    atomic_file,
    fsync_tree,
    publish_directory,
    recover,
    remove,
    remove_stale_temporaries,
    temporary_sibling,
)
from stratagem.checkpoint._load import _restore_plain as restore_plain
from stratagem.checkpoint._ranks import _agree as agree
from stratagem.checkpoint._ranks import _attempt as attempt
from stratagem.checkpoint._ranks import _gather_per_rank as gather_per_rank
from stratagem.checkpoint._ranks import _local_state as local_state
from stratagem.checkpoint._read import read_json_metadata, read_sharded_state
from stratagem.checkpoint._state_layout import (
    FORMAT_VERSION,
    METADATA_FILE,
    STATE_FILE,
    Parts,
    metadata,
    owner_of,
)
from stratagem.checkpoint._state_layout import classify as split_state

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILE",
    "STATE_FILE",
    "Parts",
    "agree",
    "atomic_file",
    "attempt",
    "fsync_tree",
    "gather_per_rank",
    "local_state",
    "metadata",
    "owner_of",
    "publish_directory",
    "read_json_metadata",
    "read_sharded_state",
    "recover",
    "remove",
    "remove_stale_temporaries",
    "restore_plain",
    "split_state",
    "temporary_sibling",
]

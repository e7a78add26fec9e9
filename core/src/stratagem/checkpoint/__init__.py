"""Checkpoints: full (one ``torch.save`` file of plain tensors) and sharded (a ``torch.distributed.checkpoint``
directory plus ``stratagem.json``). Neither format ever needs pickled code to load."""

from stratagem.checkpoint._layout import FORMAT_VERSION, METADATA_FILE, PerRank

__all__ = ["FORMAT_VERSION", "METADATA_FILE", "PerRank"]

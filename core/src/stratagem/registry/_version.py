"""The version of the stratagem distribution (the built-in plugins report it; checkpoints record it)."""

__version__ = "0.1.0"

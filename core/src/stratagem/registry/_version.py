"""The version of the stratagem distribution (the built-in plugins report it; checkpoints record it)."""

#: The version of the stratagem distribution, as ``"MAJOR.MINOR.PATCH"``.
__version__ = "0.1.0"

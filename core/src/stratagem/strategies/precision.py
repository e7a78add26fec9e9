"""Precision names and what they mean for autocast, parameter dtype and loss scaling."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager

from stratagem.errors import ConfigurationError
from stratagem.registry.capabilities import PRECISIONS

if TYPE_CHECKING:
    import torch

_ALIASES = {
    "32": "32-true",
    "32-true": "32-true",
    "fp32": "32-true",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
}


def normalize(precision: str | int) -> str:
    key = str(precision)
    if key not in _ALIASES:
        raise ConfigurationError(f"precision={precision!r} is not one of {sorted(PRECISIONS)}.")
    return _ALIASES[key]


def param_dtype(precision: str) -> torch.dtype | None:
    """The dtype parameters are created in (``*-true``), or ``None`` to keep float32."""
    import torch

    return torch.bfloat16 if precision == "bf16-true" else None


def autocast_dtype(precision: str) -> torch.dtype | None:
    import torch

    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def autocast(precision: str, device_type: str) -> ContextManager[None]:
    """Autocast for ``*-mixed`` precisions, a null context otherwise."""
    import torch

    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """Create floating-point tensors in ``dtype`` inside the block."""
    import torch

    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

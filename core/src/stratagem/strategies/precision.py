"""Precision names and what they mean for autocast, parameter dtype and loss scaling."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, ContextManager

from stratagem.errors import ConfigurationError, PrecisionKernelError
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
    "16-true": "16-true",
}


def normalize(precision: str | int) -> str:
    key = str(precision)
    if key not in _ALIASES:
        raise ConfigurationError(f"precision={precision!r} is not one of {sorted(PRECISIONS)}.")
    return _ALIASES[key]


def param_dtype(precision: str) -> torch.dtype | None:
    """The dtype parameters are created in (``*-true``), or ``None`` to keep float32."""
    import torch

    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)


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


#: How torch says that a kernel has no float16 version (CPU kernels mostly): the op's name is in group 1.
_NO_HALF_KERNEL = (
    re.compile(r'"(\w+)" not implemented for \'Half\''),
    re.compile(r"([\w.]+): Low precision dtypes not supported\. Got Half"),
    re.compile(r"()Unsupported dtype Half"),
)


def missing_half_kernel(error: BaseException) -> str | None:
    """The op named by a torch error that says it has no float16 kernel (``""`` when the error names none),
    or ``None`` for any other error."""
    if not isinstance(error, (NotImplementedError, RuntimeError)):
        return None
    message = str(error)
    for pattern in _NO_HALF_KERNEL:
        found = pattern.search(message)
        if found:
            return found.group(1)
    return None


@contextlib.contextmanager
def half_kernel_errors(precision: str, device_type: str, strategy: str) -> Iterator[None]:
    """Under ``16-true``, turn torch's "no float16 kernel" errors into a :class:`PrecisionKernelError` that names
    the op and what to use instead; any other error goes through unchanged."""
    if precision != "16-true":
        yield
        return
    try:
        yield
    except (NotImplementedError, RuntimeError) as error:
        op = missing_half_kernel(error)
        if op is None:
            raise
        import torch

        raise PrecisionKernelError(
            strategy, precision, device_type, op, str(error), str(torch.__version__)
        ) from error

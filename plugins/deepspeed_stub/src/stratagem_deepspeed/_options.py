"""Converters and validators of the DeepSpeed strategies' options: each checks one value and names the option
and the value when it refuses it.

Cross-option rules (an NVMe device needs ``nvme_path``, a tuning option needs what it tunes) live in
:mod:`stratagem_deepspeed._rules`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from stratagem.errors import ConfigurationError

#: The stages DeepSpeed's ZeRO offers; 0 is plain data parallelism through DeepSpeed's engine.
STAGES = (0, 1, 2, 3)
#: Where ZeRO can keep offloaded parameters or optimizer state.
OFFLOAD_DEVICES = ("cpu", "nvme")


def fail(name: str, value: Any, advice: str) -> ConfigurationError:
    return ConfigurationError(f"DeepSpeed {name}={value!r}: {advice}")


def stage(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in STAGES:
        raise fail("stage", value, f"use one of {', '.join(map(str, STAGES))}.")
    return value


def _whole(value: Any) -> Any:
    # 5e8 is how these sizes are usually written; a float with no fraction is the integer it names.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(name: str, minimum: int, example: str):
    """A converter to an int of at least ``minimum`` (integral floats such as ``1e9`` accepted)."""

    def convert(value: Any) -> int:
        value = _whole(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            least = "a positive" if minimum == 1 else f"an integer of at least {minimum}, a"
            raise fail(name, value, f"give {least} number, e.g. {example}.")
        return value

    return convert


def bucket(value: Any) -> int:
    value = _whole(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(
            f"bucket size {value!r}: give a positive number of elements, e.g. 200_000_000."
        )
    return value


def number(name: str, *, positive: bool):
    """A converter to a float that is positive (or, with ``positive=False``, not negative)."""

    def convert(value: Any) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or value != value or (value <= 0 if positive else value < 0):
            wanted = "a positive number" if positive else "a number of at least 0"
            raise fail(name, value, f"give {wanted}.")
        return float(value)

    return convert


def flag(name: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            raise fail(name, value, "use True or False.")

    return check


def optional_flag(name: str, none_means: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if value is not None and not isinstance(value, bool):
            raise fail(name, value, f"use True, False, or None ({none_means}).")

    return check


def device(name: str):
    def convert(value: Any) -> str:
        if isinstance(value, str) and value.lower() in OFFLOAD_DEVICES:
            return value.lower()
        raise fail(
            name,
            value,
            "use 'cpu' (host memory) or 'nvme' (files under nvme_path, through DeepSpeed's asynchronous I/O).",
        )

    return convert


def remote_device(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in OFFLOAD_DEVICES:
        return value.lower()
    raise fail(
        "remote_device",
        value,
        "use None (the parameters' offload device, else the accelerator), 'cpu' or 'nvme'.",
    )


def path(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return str(Path(value).expanduser().absolute())
    raise fail("nvme_path", value, "give the path of a directory (a str or a pathlib.Path).")


def check_writable_directory(value: str) -> None:
    """Refuse an ``nvme_path`` DeepSpeed could not write its swap files into."""
    where = Path(value)
    if not where.exists():
        raise fail(
            "nvme_path",
            value,
            "no such directory. Create it on the NVMe drive (or any local disk) first: DeepSpeed writes its "
            "swap files under it and does not create the path.",
        )
    if not where.is_dir():
        raise fail(
            "nvme_path",
            value,
            "is not a directory. Give the directory DeepSpeed may write its swap files in.",
        )
    # Creating a file is the only test that holds for root and read-only mounts alike (os.access does not).
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as error:
        raise fail(
            "nvme_path",
            value,
            f"not writable ({error.strerror or error}). Give a directory this process can create files in.",
        ) from error


def logging_batch_size(value: Any) -> int:
    if value == "auto":
        raise fail(
            "logging_batch_size_per_gpu",
            value,
            "give the number of samples per process per step. stratagem's strategies never see the data "
            "loader (the Trainer sets it up), so the batch size cannot be read from it.",
        )
    return integer("logging_batch_size_per_gpu", 1, "32")(value)


def optional_positive(name: str):
    convert = integer(name, 1, "4")

    def check(value: Any) -> int | None:
        return None if value is None else convert(value)

    return check


def logging_level(value: Any) -> int:
    if isinstance(value, str):
        level = logging.getLevelName(value.upper())
        if isinstance(level, int):
            return level
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigurationError(
        f"DeepSpeed logging_level={value!r}: use a logging level such as logging.WARNING or 'INFO'."
    )


def load_config(value: Any) -> dict[str, Any] | None:
    """A DeepSpeed config as a dict: ``None``, a dict (copied), or the path of a JSON file."""
    if value is None:
        return None
    if isinstance(value, dict):
        return json.loads(json.dumps(value)) if jsonable(value) else dict(value)
    if isinstance(value, (str, os.PathLike)):
        file = Path(value).expanduser()
        if not file.is_file():
            raise ConfigurationError(
                f"DeepSpeed config={os.fspath(value)!r}: no such file. Give a dict or the path of a JSON file."
            )
        try:
            loaded = json.loads(file.read_text())
        except (OSError, ValueError) as error:
            raise ConfigurationError(f"DeepSpeed config {file}: not readable as JSON: {error}") from error
        if not isinstance(loaded, dict):
            raise ConfigurationError(
                f"DeepSpeed config {file}: the top level is a {type(loaded).__name__}, not an object."
            )
        return loaded
    raise ConfigurationError(
        f"DeepSpeed config={value!r}: give a dict or the path of a JSON file (a {type(value).__name__} is neither)."
    )


def jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True

"""A Module's constructor arguments (``save_hyperparameters``), kept as plain values so that every checkpoint
stays loadable with ``weights_only=True``, and the module rebuilt from a checkpoint (``load_from_checkpoint``):
its class called with them, its weights read offline in one process from whatever layout wrote them."""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

from stratagem.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:
    import torch

#: The key of a checkpoint's plain state that holds them.
STATE_KEY = "hyperparameters"
#: The Module's ``__dict__`` flag: its ``hparams`` come from ``save_hyperparameters`` (and go into checkpoints).
SAVED = "_stratagem_hparams_saved"
_PLAIN_LEAVES = (type(None), bool, int, float, str)


class HyperParameters(dict):
    """The saved arguments, as a dict whose keys read as attributes too (``self.hparams.lr``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyperparameter {name!r}; saved: {sorted(self)}") from None


def check_plain(value: Any, where: str) -> None:
    """Refuse what is not a plain value: ``None``, bool, int, float, str, and lists, tuples and dicts (with str
    keys) of them. Anything else would need pickled code to be read back."""
    if isinstance(value, _PLAIN_LEAVES):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigurationError(
                    f"save_hyperparameters(): {where} has the key {key!r} ({type(key).__name__}); "
                    "use str keys."
                )
            check_plain(item, f"{where}[{key!r}]")
        return
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise ConfigurationError(
        f"save_hyperparameters(): {where} is a {kind}. Checkpoints store plain values only (None, bool, int, "
        "float, str, and lists, tuples and dicts of them) so that they load without running pickled code. "
        f"Pass a plain value that names it instead (a string, a number), or leave the argument out with "
        f"save_hyperparameters(ignore=[{where.split('[')[0]!r}]) and pass it to load_from_checkpoint."
    )


def constructor_arguments(frame: FrameType) -> dict[str, Any]:
    """The arguments of the ``__init__`` running in ``frame`` (``self`` left out; ``**kwargs`` merged in)."""
    code = frame.f_code
    if code.co_name != "__init__":
        raise ConfigurationError(
            f"save_hyperparameters() was called from {code.co_name}(); call it in your module's __init__, "
            "where it reads the constructor's arguments."
        )
    local = frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    flags = code.co_flags
    star_args = code.co_varnames[count] if flags & inspect.CO_VARARGS else None
    star_kwargs = None
    if flags & inspect.CO_VARKEYWORDS:
        star_kwargs = code.co_varnames[count + (1 if star_args else 0)]
    if star_args and local.get(star_args):
        raise ConfigurationError(
            f"save_hyperparameters(): __init__ got positional *{star_args} {local[star_args]!r}, which cannot "
            "be passed back by name. Give them names in the signature."
        )
    found = {name: local[name] for name in names[1:] if name in local}
    if star_kwargs:
        found.update(local.get(star_kwargs) or {})
    return found


def collect(frame: FrameType, chosen: tuple[str, ...], ignore: Iterable[str] | str | None) -> HyperParameters:
    """What ``save_hyperparameters(*chosen, ignore=...)`` keeps of the arguments of ``frame``'s ``__init__``."""
    arguments = constructor_arguments(frame)
    ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
    for name in (*chosen, *ignored):
        if name not in arguments:
            raise ConfigurationError(
                f"save_hyperparameters(): {name!r} is not an argument of __init__; its arguments are "
                f"{sorted(arguments)}."
            )
    if chosen:
        arguments = {name: arguments[name] for name in chosen}
    kept = {name: value for name, value in arguments.items() if name not in ignored}
    for name, value in kept.items():
        check_plain(value, name)
    return HyperParameters(copy.deepcopy(kept))


# -------------------------------------------------------------------------------------------------
# load_from_checkpoint
# -------------------------------------------------------------------------------------------------


def build(cls: type, path: str | os.PathLike[str], overrides: dict[str, Any]) -> Any:
    """``cls`` made from the hyperparameters saved at ``path`` (``overrides`` win), with its weights loaded."""
    from stratagem.checkpoint import _weights

    state = _weights.read_plain_state(path)
    saved = state.get(STATE_KEY) or {}
    if not isinstance(saved, dict):
        raise CheckpointError(path, f"holds {STATE_KEY!r} of type {type(saved).__name__}, not a dict.")
    arguments = {**saved, **overrides}
    try:
        module = cls(**arguments)
    except TypeError as error:
        hint = (
            f"The checkpoint stores {sorted(saved)}"
            if saved
            else "The checkpoint stores no constructor arguments (call self.save_hyperparameters() in __init__)"
        )
        raise ConfigurationError(
            f"{cls.__name__}.load_from_checkpoint({os.fspath(path)!r}): {cls.__name__}(**{sorted(arguments)}) "
            f"failed: {error}. {hint}; pass the others as keyword arguments: "
            f"{cls.__name__}.load_from_checkpoint(path, name=value)."
        ) from error
    if not module.__dict__.get("_stratagem_configured", False):
        module.configure_model()
        # The Trainer must not build the layers again: that would replace the weights loaded below.
        module.__dict__["_stratagem_configured"] = True
    load_weights(module, _weights.read_module_weights(path, "model"), path)
    return module


def load_weights(module: torch.nn.Module, weights: dict[str, Any], path: Any) -> None:
    """Fill ``module`` with whole tensors; parameters still on the meta device (``init_module(empty_init=True)``)
    take the loaded tensors in their own dtype."""
    from stratagem.checkpoint._state_layout import describe_mismatch, mismatch_message

    expected = {name: tuple(value.shape) for name, value in module.state_dict().items()}
    missing, unexpected, mismatched = describe_mismatch(
        expected, {name: tuple(value.shape) for name, value in weights.items()}
    )
    if missing or unexpected or mismatched:
        message = mismatch_message("model", missing, unexpected, mismatched)
        raise CheckpointError(path, message.rsplit("\n", 1)[0])
    current = module.state_dict()
    meta = any(value.is_meta for value in current.values())
    if meta:
        weights = {name: value.to(current[name].dtype) for name, value in weights.items()}
    module.load_state_dict(weights, strict=True, assign=meta)

"""Saving and loading checkpoints for any strategy, through the strategy's state-dict conversions.

Every function here runs on every rank. A failure on any rank fails the call on all of them with that rank's
error, and the previous checkpoint under the target path stays whole.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _atomic, _dcp, _store
from stratagem.checkpoint._layout import (
    METADATA_FILE,
    STATE_FILE,
    Parts,
    PerRank,
    check_metadata,
    check_plain,
    classify,
    describe_mismatch,
    detect_format,
    metadata,
    mismatch_message,
    owner_of,
    pack_per_rank,
    read_json_metadata,
    sharded_data,
    unpack_per_rank,
)
from stratagem.errors import CheckpointError

# -------------------------------------------------------------------------------------------------
# agreement between ranks
# -------------------------------------------------------------------------------------------------


def _agree(strategy: Any, path: Path, error: BaseException | None) -> None:
    """Raise the same CheckpointError on every rank if any rank failed, naming each failing rank's error.

    Every rank must call this at the same point: it is a collective.
    """
    failed = strategy.all_reduce(torch.tensor([1.0 if error is not None else 0.0]), "max")
    if float(failed[0]) == 0.0:
        return
    if strategy.world_size == 1:
        assert error is not None
        if isinstance(error, CheckpointError) and error.path == str(path):
            raise error
        raise CheckpointError(
            path, f"failed: {_describe(error)}. The previous checkpoint at this path is untouched."
        ) from error
    mine = None if error is None else _describe(error)
    messages = [strategy.broadcast(mine, src) for src in range(strategy.world_size)]
    ranks_of: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message is not None:
            ranks_of.setdefault(message, []).append(rank)
    detail = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in ranks_of.items()
    )
    raise CheckpointError(
        path, f"failed ({detail}). The previous checkpoint at this path is untouched."
    ) from error


def _describe(error: BaseException) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _attempt(function: Any, *args: Any) -> tuple[Any, BaseException | None]:
    try:
        return function(*args), None
    except Exception as exc:  # reported on every rank by _agree
        return None, exc


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # DCP warns on every single-process call that it assumes a single process; that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _local_state(parts: Parts) -> dict[str, Any]:
    """The stateful objects' state dicts and the plain values, checked; no collective runs here."""
    state = {key: obj.state_dict() for key, obj in parts.stateful.items()}
    state.update(parts.plain)
    for key, value in state.items():
        check_plain(value.value if isinstance(value, PerRank) else value, f"state[{key!r}]")
    return state


def _gather_per_rank(strategy: Any, state: dict[str, Any]) -> dict[str, Any]:
    gathered = {}
    for key, value in state.items():
        if isinstance(value, PerRank):
            values = [strategy.broadcast(value.value, src) for src in range(strategy.world_size)]
            gathered[key] = pack_per_rank(value, values)
        else:
            gathered[key] = value
    return gathered


def _converted(strategy: Any, parts: Parts, full: bool) -> dict[str, Any]:
    return {
        "model": {k: strategy.module_state_dict(m, full=full) for k, m in parts.modules.items()},
        "optimizers": {
            k: strategy.optimizer_state_dict(owner_of(o, parts.modules), o, full=full)
            for k, o in parts.optimizers.items()
        },
    }


def _prepare_target(target: Path | str, fmt: str) -> None:
    """Rank 0, before writing: refuse a target of the other kind, finish an interrupted swap, clean up."""
    if isinstance(target, str):
        _prepare_remote_target(target, fmt)
        return
    if fmt == "full" and target.is_dir():
        raise CheckpointError(target, "is a directory; a full checkpoint is one file. Choose another path.")
    if fmt == "sharded" and target.is_file():
        raise CheckpointError(target, "is a file; a sharded checkpoint is a directory. Choose another path.")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(
                    target, f"cannot be created: {parent} is a file, not a directory. Choose another path."
                )
            break
    _atomic.recover(target)
    _atomic.remove_stale_temporaries(target)


def _prepare_remote_target(target: str, fmt: str) -> None:
    try:
        _store.check_bucket(target)
        if fmt == "full" and _store.exists(_store.join(target, METADATA_FILE)):
            raise CheckpointError(
                target, "holds a sharded checkpoint; a full checkpoint is one object. Choose another URL."
            )
        if fmt == "sharded" and _store.is_file(target):
            raise CheckpointError(
                target,
                "is an object (a full checkpoint); a sharded checkpoint is a prefix. Choose another URL.",
            )
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(target, _store.describe_error(target, error)) from error


def _remove_unpublished_data(target: str, keep: str) -> None:
    """After publishing: delete the data prefixes the manifest does not name (the previous version's,
    and those that crashed saves left)."""
    for name in _store.children(target):
        if name.startswith(_store.DATA_PREFIX) and name != keep:
            _store.remove_tree(_store.join(target, name))


# -------------------------------------------------------------------------------------------------
# save
# -------------------------------------------------------------------------------------------------
# Each save runs in phases separated by _agree: local work first (so that a rank failing there does not
# leave its peers inside a collective), then the strategy's conversions (which may be collectives), then
# the writes. Nothing reaches the target path until every rank has succeeded.


class StepFence:
    """Holds every optimizer's ``step`` until the background copy of what a step would change is taken.

    A background save must hold the state of the step it was taken at, yet copying all of it before
    ``save`` returns stalls training for the whole copy. Parameters and optimizer state change only in an
    optimizer step, so they are copied in the background while the next forward and backward run, and a
    global step pre-hook makes any optimizer's step wait for that copy. What a forward may change (buffers,
    such as batch-norm statistics) and the plain state are copied before ``save`` returns.
    """

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._staged = threading.Event()
        self._handle = register_optimizer_step_pre_hook(self._hold)

    def _hold(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._staged.wait()

    def release(self) -> None:
        """The copy is taken (or failed): steps go on. Any thread."""
        self._staged.set()

    def remove(self) -> None:
        """Training thread only: the hook table is not to be changed while a step iterates over it."""
        self._staged.wait()
        self._handle.remove()


def _storage(tensor: torch.Tensor) -> int:
    """The address of the memory ``tensor`` lives in (a DTensor's: its local shard's); 0 if it has none."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # meta, sparse: nothing to share
        return 0


def _step_storages(parts: Parts) -> set[int]:
    """The memory that only an optimizer step changes: the optimizers' parameters and their state."""
    addresses: set[int] = set()
    for optimizer in parts.optimizers.values():
        for group in getattr(optimizer, "param_groups", ()):
            addresses.update(_storage(p) for p in group.get("params", ()) if isinstance(p, torch.Tensor))
        for per_param in getattr(optimizer, "state", {}).values():
            if isinstance(per_param, dict):
                addresses.update(_storage(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    addresses.discard(0)
    return addresses


class PendingSave:
    """A save whose writes go on in the background (``blocking=False``); :func:`finish` ends it on every rank."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.fence: StepFence | None = None
        self._thread: threading.Thread | None = None
        self._future: Any = None

    def start(self, work: Any) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as error:  # kept, and raised on every rank by finish()
                self.error = error

        self._thread = threading.Thread(target=run, name="stratagem-checkpoint", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """True once this rank's part of the save has finished (written, or failed)."""
        if self._thread is not None and self._thread.is_alive():
            return False
        return self._future is None or self._future.done()

    def wait(self) -> BaseException | None:
        if self.fence is not None:
            self.fence.remove()
            self.fence = None
        if self._future is not None:
            try:
                self._future.result()
            except _dcp.ERRORS as error:
                self.error = self.error or error
        if self._thread is not None:
            self._thread.join()
        return self.error


def finish(strategy: Any, pending: PendingSave) -> None:
    """Wait for a background save on every rank; raise its failure (any rank's) on all of them, naming the path.

    A collective: every rank calls it at the same point (the next save, a load, the end of ``fit``)."""
    error = pending.wait()
    if error is not None and not isinstance(error, CheckpointError):
        if isinstance(error, _atomic.WriteError):
            error = CheckpointError(pending.path, f"the background save failed: {error}")
        else:
            error = CheckpointError(pending.path, f"the background save failed: {_describe(error)}")
    _agree(strategy, pending.path, error)


def save(
    strategy: Any,
    path: str | Path,
    state: dict[str, Any],
    fmt: str,
    *,
    blocking: bool = True,
    on_published: Any = None,
) -> PendingSave | None:
    """Save on every rank. With ``blocking=False``, return once the state is copied off the training path;
    the writes go on in the background (``on_published``, on the ranks that pass it, runs after they are
    published) and :func:`finish` waits for them."""
    target = _store.location(path)
    if fmt not in ("full", "sharded"):
        raise CheckpointError(target, f"unknown format {fmt!r}; use 'full' or 'sharded'.")
    parts = classify(state)
    if fmt == "full":
        return _save_full(strategy, target, parts, blocking, on_published)
    return _save_sharded(strategy, target, parts, blocking, on_published)


def _cpu_copy(value: Any, select: Any = None) -> Any:
    """A copy of ``value`` that training cannot change: tensors copied to CPU (those ``select`` accepts, if
    given; the others are kept as they are), containers rebuilt."""
    if isinstance(value, torch.Tensor):
        if select is not None and not select(value):
            return value
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v, select) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu_copy(v, select) for v in value]
    if isinstance(value, tuple):
        return tuple(_cpu_copy(v, select) for v in value)
    return value


def _async_group(strategy: Any) -> Any:
    """A gloo process group of its own for DCP's background collectives (training keeps the default one)."""
    if not _distributed():
        return None
    group = getattr(strategy, "_stratagem_checkpoint_group", None)
    if group is None:
        import torch.distributed as dist

        group = dist.new_group(backend="gloo")
        strategy._stratagem_checkpoint_group = group
    return group


def _stager(strategy: Any) -> Any:
    """DCP's stager for this strategy's background saves, kept from one save to the next: it copies into the
    CPU memory it allocated for the previous save (fresh memory for each save costs its page faults on the
    training's cores). Released by :func:`release_async_resources`."""
    stager = getattr(strategy, "_stratagem_stager", None)
    if stager is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        strategy._stratagem_stager = stager
    return stager


def release_async_resources(strategy: Any) -> None:
    """Free the CPU memory the stager kept for asynchronous saves (at teardown, after the last save)."""
    stager = getattr(strategy, "_stratagem_stager", None)
    if stager is not None:
        strategy._stratagem_stager = None
        stager.close()


def _save_full(
    strategy: Any, target: Path | str, parts: Parts, blocking: bool = True, on_published: Any = None
) -> PendingSave | None:
    local, error = _attempt(_local_state, parts)
    if error is None and strategy.is_global_zero:
        _, error = _attempt(_prepare_target, target, "full")
    _agree(strategy, target, error)

    def convert() -> dict[str, Any]:
        payload = _converted(strategy, parts, full=True)
        payload["state"] = _gather_per_rank(strategy, local)
        if strategy.is_global_zero:
            check_plain(payload["model"], "model", whole=True)
            check_plain(payload["optimizers"], "optimizers", whole=True)
            payload["stratagem"] = metadata(strategy, "full", parts)
        return payload

    payload, error = _attempt(convert)
    _agree(strategy, target, error)

    if not blocking:
        pending = PendingSave(target)
        if strategy.is_global_zero:
            # What a step changes is copied in the background, behind a StepFence; the rest now. A failure
            # (out of memory) is raised by finish(), everywhere.
            stepped = _step_storages(parts)
            staged, pending.error = _attempt(_cpu_copy, payload, lambda t: _storage(t) not in stepped)
            del payload
            fence = pending.fence = StepFence() if pending.error is None and stepped else None

            def write_in_background() -> None:
                try:
                    copy = _cpu_copy(staged, lambda t: _storage(t) in stepped) if stepped else staged
                finally:
                    if fence is not None:
                        fence.release()
                write_full(target, copy)
                if on_published is not None:
                    on_published()

            if pending.error is None:
                pending.start(write_in_background)
        return pending

    def write() -> None:
        write_full(target, payload)

    if strategy.is_global_zero:
        _, error = _attempt(write)
    _agree(strategy, target, error)
    if on_published is not None:
        on_published()
    return None


def write_full(target: Path | str, payload: dict[str, Any]) -> None:
    """Rank 0: the full checkpoint file, atomically (a renamed temporary; on a store, one upload)."""
    if isinstance(target, str):
        try:
            with _store.upload(target) as tmp:
                torch.save(payload, tmp)
        except Exception as error:
            raise _atomic.WriteError(_store.describe_error(target, error)) from error
        return
    with _atomic.atomic_file(target) as tmp:
        torch.save(payload, tmp)


def _save_sharded(
    strategy: Any, target: Path | str, parts: Parts, blocking: bool = True, on_published: Any = None
) -> PendingSave | None:
    import torch.distributed.checkpoint as dcp

    remote = isinstance(target, str)
    if remote:
        data_name = strategy.broadcast(_store.new_data_prefix(), 0)
        tmp: Path | str = _store.join(target, data_name)
    else:
        tmp = Path(strategy.broadcast(str(_atomic.temporary_sibling(target)), 0))
    local, error = _attempt(_local_state, parts)
    if error is None and strategy.is_global_zero:

        def make_directory() -> None:
            _prepare_target(target, "sharded")
            if isinstance(tmp, Path):
                tmp.mkdir(parents=True)

        _, error = _attempt(make_directory)
    _agree(strategy, target, error)
    try:
        tensors, error = _attempt(_converted, strategy, parts, False)
        if error is None:
            _, error = _attempt(check_plain, tensors, "sharded state")
        if error is None:
            plain, error = _attempt(_gather_per_rank, strategy, local)
        _agree(strategy, target, error)

        def write_shards() -> None:
            # DCP runs its own agreement inside save and raises on every rank if any rank failed.
            try:
                with _single_process_quiet():
                    dcp.save(tensors, storage_writer=_dcp.writer(tmp), no_dist=not _distributed())
            except _dcp.ERRORS as error:
                if isinstance(tmp, str):
                    raise _atomic.WriteError(_store.describe_error(tmp, error)) from error
                raise _atomic.WriteError(
                    _atomic.explain_write_failure(tmp, error, _dcp.describe(error))
                ) from error

        meta = metadata(strategy, "sharded", parts) if strategy.is_global_zero else {}
        if not blocking:
            return _save_sharded_in_background(
                strategy, target, tmp, tensors, plain, meta, on_published, _step_storages(parts)
            )

        _, error = _attempt(write_shards)
        _agree(strategy, target, error)

        if strategy.is_global_zero:
            _, error = _attempt(_publish_sharded, target, tmp, plain, meta)
        _agree(strategy, target, error)
        if on_published is not None:
            on_published()
        return None
    except BaseException:
        if strategy.is_global_zero:
            if isinstance(tmp, str):
                with contextlib.suppress(Exception):
                    _store.remove_tree(tmp)
            else:
                _atomic.remove(tmp)
        raise


def _publish_sharded(
    target: Path | str, tmp: Path | str, plain: dict[str, Any], meta: dict[str, Any]
) -> None:
    """Rank 0, once every rank's shards are written: the plain state and metadata, then publication."""
    if isinstance(tmp, str):
        publish_sharded_remote(target, _store.name_of(tmp), plain, meta)
        return
    assert isinstance(target, Path)
    try:
        torch.save(plain, tmp / STATE_FILE)
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2))
    except Exception as error:
        raise _atomic.WriteError(_atomic.explain_write_failure(tmp, error)) from error
    _atomic.publish_directory(tmp, target)


def _save_sharded_in_background(
    strategy: Any,
    target: Path | str,
    tmp: Path | str,
    tensors: dict[str, Any],
    plain: dict[str, Any],
    meta: dict[str, Any],
    on_published: Any,
    stepped: set[int],
) -> PendingSave:
    """``dcp.async_save``, which writes the shards in a thread (collectives on a group of their own) from a
    CPU copy; rank 0 publishes once its future says every rank has written. The shards a step changes are
    copied by DCP's stager in a thread of its own, behind a :class:`StepFence`; the rest before returning."""
    import torch.distributed.checkpoint as dcp

    pending = PendingSave(target)
    plain = _cpu_copy(plain)
    stager = None
    if stepped:
        tensors = _cpu_copy(tensors, lambda t: _storage(t) not in stepped)
        stager = _stager(strategy)
    try:
        with _single_process_quiet():
            response = dcp.async_save(
                tensors,
                storage_writer=_dcp.writer(tmp),
                process_group=_async_group(strategy),
                no_dist=not _distributed(),
                async_stager=stager,
            )
    except _dcp.ERRORS as error:
        future, failed = None, error
    else:
        failed = None
        future = response
        if stager is not None:
            fence = pending.fence = StepFence()
            response.staging_completion.add_done_callback(lambda _: fence.release())
            future = response.upload_completion
    if not strategy.is_global_zero:
        pending._future = future
        pending.error = failed
        return pending

    def publish_in_background() -> None:
        try:
            if failed is not None:
                raise failed
            try:
                future.result()
            except _dcp.ERRORS as error:
                raise _atomic.WriteError(_dcp.describe(error)) from error
            _publish_sharded(target, tmp, plain, meta)
        except BaseException:
            if isinstance(tmp, str):
                with contextlib.suppress(Exception):
                    _store.remove_tree(tmp)
            else:
                _atomic.remove(tmp)
            raise
        if on_published is not None:
            on_published()

    pending.start(publish_in_background)
    return pending


def publish_sharded_remote(target: Any, data_name: str, plain: dict[str, Any], meta: dict[str, Any]) -> None:
    """Rank 0, once every rank's shards and DCP's index are written under ``target/data_name``: the plain
    state, then the manifest (the checkpoint exists from that single PUT on), then old data is deleted."""
    data = _store.join(target, data_name)
    try:
        with _store.upload(_store.join(data, STATE_FILE)) as file:
            torch.save(plain, file)
        manifest = {**meta, "data": data_name}
        _store.write_bytes(_store.join(target, METADATA_FILE), json.dumps(manifest, indent=2).encode())
    except Exception as error:
        raise _atomic.WriteError(_store.describe_error(target, error)) from error
    _remove_unpublished_data(target, data_name)


# -------------------------------------------------------------------------------------------------
# load
# -------------------------------------------------------------------------------------------------


def read_full(path: Path | str) -> dict[str, Any]:
    """Read a full checkpoint file (or store object) without running any pickled code."""
    try:
        if isinstance(path, str):
            import io

            payload = torch.load(io.BytesIO(_store.read_bytes(path)), map_location="cpu", weights_only=True)
        else:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointError(
            path, f"cannot be read as a stratagem checkpoint (truncated, corrupt, or not one): {error}"
        ) from error
    if not isinstance(payload, dict):
        raise CheckpointError(path, "holds no stratagem checkpoint (the top level is not a dict).")
    check_metadata(payload.get("stratagem"), path)
    return payload


def load(strategy: Any, path: str | Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    target = _store.location(path)
    source = target if isinstance(target, str) else _atomic.recover(target)
    fmt = detect_format(source)
    parts = classify(state)
    if fmt == "full":
        return _load_full(strategy, source, parts, strict)
    return _load_sharded(strategy, source, parts, strict)


def _expected_shapes(strategy: Any, module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    # A DTensor's shape is the global one, so the sharded state dict gives full shapes without gathering.
    return {
        k: tuple(v.shape)
        for k, v in strategy.module_state_dict(module, full=False).items()
        if hasattr(v, "shape")
    }


def _reconcile(
    strategy: Any,
    key: str,
    module: torch.nn.Module,
    saved: dict[str, tuple[int, ...]],
    strict: bool,
    path: Path,
) -> set[str]:
    """Check saved keys and shapes against the model; return the saved keys to drop (``strict=False``)."""
    missing, unexpected, mismatched = describe_mismatch(_expected_shapes(strategy, module), saved)
    if not (missing or unexpected or mismatched):
        return set()
    message = mismatch_message(key, missing, unexpected, mismatched)
    if strict:
        raise CheckpointError(path, message)
    if strategy.is_global_zero:
        warnings.warn(
            f"Checkpoint {path}: loaded what fits; {message.splitlines()[0]}\n"
            + "\n".join(message.splitlines()[1:-1]),
            stacklevel=4,
        )
    return set(unexpected) | {name for name, _, _ in mismatched}


def _restore_plain(
    strategy: Any, parts: Parts, saved_state: dict[str, Any], strict: bool, path: Path
) -> dict[str, Any]:
    for key, obj in parts.stateful.items():
        if key not in saved_state:
            if strict:
                raise CheckpointError(
                    path, f"has no state for {key!r}; pass strict=False to keep its current state."
                )
            continue
        _apply(path, f"the state of {key!r}", obj.load_state_dict, saved_state[key])
    return {
        key: unpack_per_rank(value, strategy.rank)
        for key, value in saved_state.items()
        if key not in parts.stateful
    }


def _apply(path: Path, what: str, function: Any, *args: Any, **kwargs: Any) -> None:
    """Run a strategy's conversion, turning its failure into a CheckpointError that says what failed."""
    try:
        function(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(path, f"could not load {what}: {type(error).__name__}: {error}") from error


def _fitting_optimizer_state(
    strategy: Any, owner: Any, optimizer: Any, saved: dict[str, Any], dropped: set[str], full: bool
) -> dict[str, Any]:
    """With ``strict=False``: the saved optimizer state, except that parameters whose saved state does not
    fit (dropped from the model's load) or is missing keep the optimizer's current state."""
    current = strategy.optimizer_state_dict(owner, optimizer, full=full)
    if not isinstance(saved.get("state"), dict) or not isinstance(current.get("state"), dict):
        return saved
    state = {k: v for k, v in saved["state"].items() if k not in dropped and k in current["state"]}
    for name, value in current["state"].items():
        state.setdefault(name, value)
    groups = current.get("param_groups", [])
    if len(saved.get("param_groups", [])) == len(groups):
        # The current groups' keys (a scheduler adds some), the saved values where the checkpoint has them.
        groups = [
            {**c, **{k: v for k, v in s.items() if k in c and k != "params"}}
            for s, c in zip(saved["param_groups"], groups)
        ]
    return {**saved, "state": state, "param_groups": groups}


def _load_full(strategy: Any, path: Path | str, parts: Parts, strict: bool) -> dict[str, Any]:
    payload = read_full(path)
    models, optimizers = payload.get("model", {}), payload.get("optimizers", {})
    dropped: dict[int, set[str]] = {}
    for key, module in parts.modules.items():
        if key not in models:
            if strict:
                raise CheckpointError(path, f"has no module {key!r}; it holds {sorted(models)}.")
            warnings.warn(f"Checkpoint {path}: has no module {key!r}; it keeps its weights.", stacklevel=3)
            continue
        saved = dict(models[key])
        drop = _reconcile(strategy, key, module, {k: tuple(v.shape) for k, v in saved.items()}, strict, path)
        dropped[id(module)] = drop
        for name in drop:
            saved.pop(name, None)
        _apply(
            path, f"module {key!r}", strategy.load_module_state_dict, module, saved, full=True, strict=strict
        )
    for key, optimizer in parts.optimizers.items():
        if key not in optimizers:
            if strict:
                raise CheckpointError(path, f"has no optimizer {key!r}; it holds {sorted(optimizers)}.")
            continue
        owner = owner_of(optimizer, parts.modules)
        osd = optimizers[key]
        if not strict:
            osd = _fitting_optimizer_state(
                strategy, owner, optimizer, osd, dropped.get(id(owner), set()), True
            )
        _apply(
            path, f"optimizer {key!r}", strategy.load_optimizer_state_dict, owner, optimizer, osd, full=True
        )
    return _restore_plain(strategy, parts, payload.get("state", {}), strict, path)


def saved_tensor_shapes(path: Path | str) -> dict[str, tuple[int, ...]]:
    """Flattened key -> global shape of every tensor in a DCP directory, from its index alone."""
    return _dcp.tensor_shapes(_dcp.read_metadata(path))


def read_sharded_state(path: Path | str) -> dict[str, Any]:
    """The plain state (``state.pt``) of a sharded checkpoint, read without running pickled code.

    ``path``: the directory holding the DCP files (on a store, the data prefix the manifest names)."""
    try:
        if isinstance(path, str):
            import io

            try:
                raw = _store.read_bytes(_store.join(path, STATE_FILE))
            except FileNotFoundError:
                return {}
            saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        else:
            state_file = path / STATE_FILE
            if not state_file.exists():
                return {}
            saved = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            path, f"{STATE_FILE} is unreadable or holds more than plain data (refused): {error}"
        ) from error
    if not isinstance(saved, dict):
        raise CheckpointError(path, f"{STATE_FILE} holds a {type(saved).__name__}, not a dict.")
    return saved


def _load_sharded(strategy: Any, path: Path | str, parts: Parts, strict: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    data = sharded_data(path, read_json_metadata(path))
    shapes = saved_tensor_shapes(data)
    target: dict[str, Any] = {"model": {}, "optimizers": {}}
    dropped: dict[int, set[str]] = {}
    kept: dict[str, dict[str, Any]] = {}
    for key, module in parts.modules.items():
        prefix = f"model.{key}."
        saved = {k[len(prefix) :]: v for k, v in shapes.items() if k.startswith(prefix)}
        if not saved:
            if strict:
                raise CheckpointError(path, f"has no module {key!r}.")
            warnings.warn(f"Checkpoint {path}: has no module {key!r}; it keeps its weights.", stacklevel=3)
            continue
        drop = _reconcile(strategy, key, module, saved, strict, path)
        dropped[id(module)] = drop
        sd = strategy.module_state_dict(module, full=False)
        target["model"][key] = {k: v for k, v in sd.items() if k not in drop and k in saved}
    for key, optimizer in parts.optimizers.items():
        if not any(k.startswith(f"optimizers.{key}.") for k in shapes):
            if strict:
                raise CheckpointError(path, f"has no optimizer {key!r}.")
            continue
        owner = owner_of(optimizer, parts.modules)
        osd = strategy.optimizer_state_dict(owner, optimizer, full=False)
        drop = dropped.get(id(owner), set())
        if drop and isinstance(osd.get("state"), dict):
            # Read the saved state only of parameters that fit; the others keep their current state.
            kept[key] = {k: v for k, v in osd["state"].items() if k in drop}
            osd = {**osd, "state": {k: v for k, v in osd["state"].items() if k not in drop}}
        target["optimizers"][key] = osd
    try:
        with _single_process_quiet():
            dcp.load(
                target,
                storage_reader=_dcp.safe_reader(data),
                planner=_dcp.safe_load_planner(allow_partial_load=not strict),
                no_dist=not _distributed(),
            )
    except CheckpointError as error:
        raise CheckpointError(path, error.problem) from error
    except _dcp.ERRORS as error:
        raise CheckpointError(path, f"could not be read: {_dcp.describe(error)}") from error
    for key, module in parts.modules.items():
        if key in target["model"]:
            _apply(
                path,
                f"module {key!r}",
                strategy.load_module_state_dict,
                module,
                target["model"][key],
                full=False,
                strict=strict,
            )
    for key, state in kept.items():
        target["optimizers"][key]["state"].update(state)
    for key, optimizer in parts.optimizers.items():
        if key in target["optimizers"]:
            _apply(
                path,
                f"optimizer {key!r}",
                strategy.load_optimizer_state_dict,
                owner_of(optimizer, parts.modules),
                optimizer,
                target["optimizers"][key],
                full=False,
            )
    return _restore_plain(strategy, parts, read_sharded_state(data), strict, path)

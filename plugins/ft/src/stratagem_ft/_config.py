"""The options of the fault-tolerant strategies, checked when the strategy is built (in the launching process
under the ``replica_groups`` launcher, before anything starts), and where the replica group's identity comes
from when the options leave it out."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from stratagem.errors import ConfigurationError

#: torchft's own variable for the lighthouse's address (its Manager reads it too).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: What the ``replica_groups`` launcher (and torchft's own TorchX components) set in each replica group's workers.
REPLICA_ID_ENV = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"


def _fail(strategy: str, field: str, value: Any, advice: str) -> ConfigurationError:
    return ConfigurationError(f"{strategy}({field}={value!r}): {advice}")


def _is_count(minimum: int) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _fail(instance.strategy, attribute.name, value, f"give a whole number >= {minimum}.")

    return check


def _is_seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _fail(instance.strategy, attribute.name, value, "give a positive number of seconds.")


def _is_address(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not _split_address(value):
        raise _fail(
            instance.strategy,
            attribute.name,
            value,
            "give the lighthouse's address as http://HOST:PORT (what torchft_lighthouse prints), or leave it "
            f"out to use ${LIGHTHOUSE_ENV}.",
        )


def _split_address(address: str) -> tuple[str, int] | None:
    """``http://host:port`` -> ``(host, port)``; ``None`` when it is not one."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, _, port = rest.rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


@attrs.frozen(kw_only=True)
class FTConfig:
    """Options of every fault-tolerant strategy (``ft_ddp``, ``ft_hsdp``, ``diloco``).

    :param replica_id: this replica group's number, ``0`` to ``num_replica_groups - 1``; default: what the
        ``replica_groups`` launcher sets (``$REPLICA_GROUP_ID``), else 0 for a job of one replica group.
    :param num_replica_groups: how many replica groups the job has; it deals the data (each group feeds its
        share of the global batch) and says how many groups a fresh job waits for at its first step. Default:
        ``$NUM_REPLICA_GROUPS``, else 1.
    :param lighthouse: the torchft lighthouse's address, ``http://HOST:PORT``; default ``$TORCHFT_LIGHTHOUSE``.
        A job of one replica group with neither starts one of its own.
    :param quorum_timeout: seconds a step waits for its quorum (torchft's ``quorum_timeout``); a group lost
        mid-run costs the others at most the lighthouse's heartbeat timeout, well within it.
    :param timeout: seconds for each operation across replica groups: an all-reduce, a commit, a healing
        transfer (torchft's ``timeout``). A replica group cut off without a word costs the others this long.
    :param connect_timeout: seconds to reach the lighthouse and the other groups' managers.
    :param start_timeout: seconds a fresh job's first step waits for all ``num_replica_groups`` groups to join;
        the groups present then start, and a later one heals from them when it joins.
    :param heartbeat_timeout: seconds of silence after which a lighthouse that stratagem starts drops a group.
    """

    strategy: str = attrs.field(default="ft_ddp", repr=False)
    replica_id: int | None = attrs.field(default=None, validator=_is_count(0))
    num_replica_groups: int | None = attrs.field(default=None, validator=_is_count(1))
    lighthouse: str | None = attrs.field(default=None, validator=_is_address)
    quorum_timeout: float = attrs.field(default=60.0, validator=_is_seconds)
    timeout: float = attrs.field(default=60.0, validator=_is_seconds)
    connect_timeout: float = attrs.field(default=10.0, validator=_is_seconds)
    start_timeout: float = attrs.field(default=60.0, validator=_is_seconds)
    heartbeat_timeout: float = attrs.field(default=5.0, validator=_is_seconds)

    def __attrs_post_init__(self) -> None:
        # Checked here and not only where the workers start: a replica_id outside the job is refused before
        # anything launches, since its data share would be another group's or no one's.
        groups = self.num_replica_groups
        if self.replica_id is not None and groups is not None and self.replica_id >= groups:
            raise _fail(
                self.strategy,
                "replica_id",
                self.replica_id,
                f"the job has num_replica_groups={groups}: give 0 to {groups - 1}.",
            )
        if self.heartbeat_timeout >= self.quorum_timeout:
            raise _fail(
                self.strategy,
                "heartbeat_timeout",
                self.heartbeat_timeout,
                f"a lost group is noticed after the heartbeat timeout, which must be shorter than "
                f"quorum_timeout={self.quorum_timeout} or the survivors' quorum gives up first.",
            )

    def identity(self, environ: Mapping[str, str] | None = None) -> tuple[int, int]:
        """``(replica_id, num_replica_groups)`` of this process: the options, else what its launcher set."""
        env = os.environ if environ is None else environ
        groups = self._from_env(self.num_replica_groups, env, NUM_REPLICA_GROUPS_ENV, "num_replica_groups")
        replica = self._from_env(self.replica_id, env, REPLICA_ID_ENV, "replica_id")
        groups = 1 if groups is None else groups
        if replica is None:
            if groups > 1:
                raise ConfigurationError(
                    f"{self.strategy}(num_replica_groups={groups}): this process belongs to no replica group. "
                    "Start the groups with the replica_groups launcher (Trainer(launcher='replica_groups'), "
                    "`stratagem run --launcher replica_groups`), or give each group's launch its replica_id=..."
                )
            replica = 0
        if replica >= groups:
            raise _fail(self.strategy, "replica_id", replica, f"the job has {groups} replica group(s).")
        return replica, groups

    def _from_env(self, given: int | None, env: Mapping[str, str], name: str, option: str) -> int | None:
        text = env.get(name)
        if text is None or text == "":
            return given
        if not text.isdigit():
            raise ConfigurationError(f"{self.strategy}: ${name}={text!r} is not a whole number.")
        if given is not None and given != int(text):
            raise ConfigurationError(
                f"{self.strategy}({option}={given}): its launcher started this process with ${name}={text}. "
                f"Leave {option} out where the replica_groups launcher starts the groups."
            )
        return int(text)

    def lighthouse_address(self, environ: Mapping[str, str] | None = None) -> str | None:
        env = os.environ if environ is None else environ
        address = self.lighthouse or env.get(LIGHTHOUSE_ENV) or None
        if address is not None and _split_address(address) is None:
            raise ConfigurationError(
                f"{self.strategy}: ${LIGHTHOUSE_ENV}={address!r} is not an address: give http://HOST:PORT."
            )
        return address


#: The outer optimizers ``diloco`` builds by name (a callable ``params -> Optimizer`` is taken as it is).
OUTER_OPTIMIZERS = ("sgd", "nesterov")


def _is_outer_optimizer(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if callable(value) or value in OUTER_OPTIMIZERS:
        return
    raise _fail(
        instance.strategy,
        attribute.name,
        value,
        f"give one of {list(OUTER_OPTIMIZERS)} or a function params -> torch.optim.Optimizer.",
    )


def _is_fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise _fail(instance.strategy, attribute.name, value, "give a number from 0 up to (not including) 1.")


def _is_rate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _fail(instance.strategy, attribute.name, value, "give a positive learning rate.")


@attrs.frozen(kw_only=True)
class DiLoCoConfig:
    """What ``diloco`` adds: how often the replica groups synchronise and the outer optimizer that does it.

    :param sync_every: inner optimizer steps between two synchronisations of the replica groups.
    :param outer_optimizer: ``"nesterov"`` (SGD with Nesterov momentum, DiLoCo's), ``"sgd"`` (plain SGD with
        ``outer_momentum``), or a function ``params -> torch.optim.Optimizer``.
    :param outer_lr: the outer optimizer's learning rate (for the named ones).
    :param outer_momentum: its momentum (for the named ones).
    """

    strategy: str = attrs.field(default="diloco", repr=False)
    sync_every: int = attrs.field(default=100, validator=_is_count(1))
    outer_optimizer: Any = attrs.field(default="nesterov", validator=_is_outer_optimizer)
    outer_lr: float = attrs.field(default=0.7, validator=_is_rate)
    outer_momentum: float = attrs.field(default=0.9, validator=_is_fraction)

    def build_outer(self, params: list[Any]) -> Any:
        import torch

        if callable(self.outer_optimizer):
            return self.outer_optimizer(params)
        nesterov = self.outer_optimizer == "nesterov"
        if nesterov and self.outer_momentum == 0:
            raise _fail(self.strategy, "outer_momentum", 0, "Nesterov momentum needs outer_momentum > 0.")
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=nesterov)


def split_options(strategy: str, options: Mapping[str, Any], known: tuple[type, ...]) -> list[dict[str, Any]]:
    """``options`` dealt to the configuration classes ``known``; an unknown one is refused, naming the options
    the strategy takes and the closest one."""
    fields = [[f.name for f in attrs.fields(cls) if f.name != "strategy"] for cls in known]
    everything = [name for names in fields for name in names]
    for name in options:
        if name not in everything:
            close = difflib.get_close_matches(name, everything, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(
                f"{strategy}: unknown option {name!r}.{hint} Its options: {', '.join(everything)}."
            )
    return [{k: v for k, v in options.items() if k in names} for names in fields]

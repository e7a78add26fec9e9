"""One replica group's torchft Manager: the store it advertises to the other groups, the reconfigurable process
group across them, and a roster of which groups the quorums held and on which hosts.

Each replica group is a ``torch.distributed`` world of its own (its launcher's rendezvous, its own ranks 0 to
W-1). The Manager connects the groups: rank k of every group present joins a process group across the groups,
which torchft rebuilds at each change of the quorum (``ProcessGroupGloo.configure``) on the store of the
quorum's first group."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch.distributed as dist
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL, create_store_client

from stratagem.launchers.cluster import ClusterEnvironment
from stratagem_ft._config import FTConfig

#: The prefix of the replica ids torchft sees; torchft reads a group's number from the id's trailing digits.
REPLICA_ID_PREFIX = "replica_group_"


class _Roster:
    """A mixin for torchft's reconfigurable process groups: at each reconfiguration, every member writes its
    replica group's host into the quorum's store and reads the others', so a group can say which host a lost
    group was on. A few store operations per change of the quorum, none per step."""

    def setup_roster(self, replica: int, host: str, timeout: datetime.timedelta) -> None:
        self.replica, self.host, self.roster_timeout = replica, host, timeout
        self.members: tuple[int, ...] = ()
        self.hosts: dict[int, str] = {}

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        super().configure(  # type: ignore[misc]
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )
        size = group_world_size or 1
        members = tuple(sorted({g // size for g in global_ranks or ()})) or (self.replica,)
        store = create_store_client(f"{store_addr}/stratagem-roster", timeout=self.roster_timeout)
        store.set(str(self.replica), self.host)
        self.hosts.update({m: store.get(str(m)).decode() for m in members})
        self.members = members


class RosterGloo(_Roster, ProcessGroupGloo):
    """torchft's reconfigurable gloo group, with the roster."""


class RosterNCCL(_Roster, ProcessGroupNCCL):
    """torchft's reconfigurable NCCL group, with the roster."""


def create_manager(
    config: FTConfig,
    cluster: ClusterEnvironment,
    *,
    replica_id: int,
    lighthouse: str,
    use_async_quorum: bool,
) -> tuple[Manager, Any, Any]:
    """The Manager of this rank, its process group across the groups, and (on rank 0) the store it serves.

    Every rank of the group calls this at the same point: rank 0 opens the store and tells the others its port.
    A store of its own rather than the launcher's: torch's elastic agent keeps its store across restarts, with
    the last attempt's manager address in it, and the other groups must reach it by host name.
    """
    timeout = datetime.timedelta(seconds=config.timeout)
    host = socket.gethostname()
    store = None
    port = 0
    if cluster.rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        port = store.port
    if cluster.world_size > 1:
        box = [port]
        dist.broadcast_object_list(box, src=0)
        port = box[0]
    group_cls = RosterNCCL if cluster.backend == "nccl" else RosterGloo
    process_group = group_cls(timeout=timeout)
    process_group.setup_roster(replica_id, host, timeout)
    manager = Manager(
        pg=process_group,
        load_state_dict=None,
        state_dict=None,
        # One group is a quorum: the others go on when some are lost.
        min_replica_size=1,
        use_async_quorum=use_async_quorum,
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=config.quorum_timeout),
        connect_timeout=datetime.timedelta(seconds=config.connect_timeout),
        rank=cluster.rank,
        world_size=cluster.world_size,
        store_addr=host,
        store_port=port,
        lighthouse_addr=lighthouse,
        replica_id=f"{REPLICA_ID_PREFIX}{replica_id}",
        hostname=host,
    )
    if cluster.world_size == 1:
        _vote_alone(manager)
    return manager, process_group, store


class _LoneVoter:
    """torchft's ManagerClient for a replica group of one process, its commit vote answered in place.

    The Manager's ``should_commit`` asks the group's manager server, which waits for the votes of the group's
    ranks and answers whether all of them can commit: with one rank the answer is that rank's own vote. The
    round trip cost a millisecond of CPU and two to three of wall time a step on two loaded cores; everything
    else the Manager does at the commit (the step count, the healing state, the refusal of a failed step) is
    unchanged. The quorum and the healing still go through the client."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any) -> bool:
        return should_commit


def _vote_alone(manager: Manager) -> None:
    # The client is the Manager's own attribute (torchft 0.2): where a later torchft lacks it, every vote
    # keeps its round trip.
    client = getattr(manager, "_client", None)
    if client is not None and callable(getattr(client, "should_commit", None)):
        manager._client = _LoneVoter(client)

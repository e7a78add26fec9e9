"""Each round of the c10d rendezvous says where its workers' store is, so that a node joining a later round
finds it, and tells the workers its number, under which every node's workers keep their keys in that store.

torch's c10d rendezvous shares its TCPStore with the workers: in each round, the node of rank 0 writes the
store's address under the round's keys (``MASTER_ADDR``, ``MASTER_PORT``) and every other node reads it there.
But a node keeps what it learnt in its first round (torch 2.13, ``DynamicRendezvousHandler.next_rendezvous``)
and writes nothing in the later ones. A node that joins a later round (one that started late, or comes back
after a loss) then waits for keys that nobody writes, the nodes already there wait for its role in the round,
and after ``read_timeout`` (60 s) both fail with ``DistStoreError`` on a key of that round. So after each
round, the node of rank 0 writes the address again under the round's keys, which its first round had written
already: nothing changes for the others.

The workers share that store across restarts, so each group keeps its keys apart from those of the groups
before it (:class:`~stratagem.strategies.TorchDistributedStrategy`). The name must be the same on every node:
each agent's count of its own restarts is not (a node that joins late has restarted fewer times than those
already there, and its workers would read the departed workers' addresses while the others wait for its keys),
the round is. The agent hands it to its workers in ``STRATAGEM_RENDEZVOUS_ROUND``.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

ROUND_ENV = "STRATAGEM_RENDEZVOUS_ROUND"


def publish_each_round(handler: Any) -> Any:
    """Wrap a c10d handler's ``next_rendezvous`` (in place) so that rank 0 writes the store's address in every
    round and the workers learn the round; another handler is returned as it is."""
    os.environ.pop(ROUND_ENV, None)  # a previous launch's, in this process
    if handler.get_backend() != "c10d":
        return handler
    # The wrapper holds the handler weakly: a handler that held itself through its own attribute would keep its
    # TCPStore (listening on the master port) alive after the run, until a garbage collection happened to run.
    join = type(handler).next_rendezvous
    owner = weakref.ref(handler)

    def next_rendezvous() -> Any:
        handler = owner()
        info = join(handler)
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        if state is not None:
            os.environ[ROUND_ENV] = str(state.round)  # the workers inherit the agent's environment
        where = getattr(info, "bootstrap_store_info", None)
        if info.rank == 0 and where is not None:
            info.store.set(where.MASTER_ADDR_KEY, where.master_addr.encode())
            info.store.set(where.MASTER_PORT_KEY, str(where.master_port).encode())
        return info

    handler.next_rendezvous = next_rendezvous
    return handler


def forget() -> None:
    """The round belongs to the launch that formed it: once that launch ends, a process started later from this
    one (torchrun's workers, another launcher's) must not read it as its own, or its restarted group would name
    its keys as the failed one did."""
    os.environ.pop(ROUND_ENV, None)

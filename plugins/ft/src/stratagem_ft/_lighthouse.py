"""The torchft lighthouse a job's replica groups meet at: checking that a given one answers, or starting one."""

from __future__ import annotations

import socket
import time
from typing import Any

from stratagem.errors import ConfigurationError
from stratagem_ft._config import LIGHTHOUSE_ENV, _split_address

#: How long the lighthouse that stratagem starts waits for groups that heartbeat but have not asked to join yet
#: (torchft's join_timeout): only a fresh job meets it, whose groups all ask within moments of each other.
JOIN_TIMEOUT_S = 5.0
#: What a lighthouse should be started with, for the message of a lighthouse that does not answer.
LIGHTHOUSE_COMMAND = "torchft_lighthouse --min_replicas 1 --join_timeout_ms 5000 --heartbeat_timeout_ms 5000"


def check_reachable(address: str, timeout_s: float, strategy: str) -> None:
    """Return once a TCP connection to the lighthouse succeeds; after ``timeout_s`` seconds of failures, raise a
    ``ConfigurationError`` naming the address.

    A plain connection rather than a torchft call: a heartbeat from a prober would count as one more replica
    group alive for the lighthouse's split-brain rule until it timed out.
    """
    host_port = _split_address(address)
    assert host_port is not None, address
    deadline = time.monotonic() + timeout_s
    error: OSError | None = None
    while True:
        try:
            with socket.create_connection(host_port, timeout=min(2.0, timeout_s)):
                return
        except OSError as failed:
            error = failed
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise ConfigurationError(
        f"{strategy}: the torchft lighthouse at {address} cannot be reached ({error}; tried for {timeout_s:g} s). "
        f"Start one where every replica group can reach it ({LIGHTHOUSE_COMMAND}), and give its address as "
        f"lighthouse=... or ${LIGHTHOUSE_ENV}."
    )


def start(heartbeat_timeout_s: float, bind: str = "[::]:0") -> Any:
    """A lighthouse in this process (torchft's ``LighthouseServer``, which serves from threads of its own), for
    replica groups on this machine. Its ``address()`` names this host; ``shutdown()`` stops it."""
    import os

    from torchft.coordination import LighthouseServer

    # torchft's Rust side logs every quorum at INFO; its warnings and errors are what a run needs.
    os.environ.setdefault("RUST_LOG", "warn")

    return LighthouseServer(
        bind=bind,
        # One group is a quorum: the point is that the others go on when some are lost.
        min_replicas=1,
        join_timeout_ms=int(JOIN_TIMEOUT_S * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )

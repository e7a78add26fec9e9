"""Bad input to the fault-tolerant strategies is refused before anything trains, saying what was wrong and what
to do: an unknown option, a replica_id outside the job, a lighthouse that cannot be reached."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import torch.distributed

import stratagem as sg
from stratagem.errors import ConfigurationError

pytestmark = pytest.mark.timeout(120)


def never_run(engine: Any) -> None:
    raise AssertionError("the launch should have been refused")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["ft_ddp", "ft_hsdp", "diloco"])
def test_an_unknown_option_names_the_closest(name: str) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown option 'num_replica_group'.*'num_replica_groups'"):
        sg.Engine(strategy=f"{name}[num_replica_group=2]", accelerator="cpu")


def test_an_unknown_option_is_refused_before_the_replica_groups_start() -> None:
    engine = sg.Engine(strategy="ft_ddp[quorum_timout=5]", accelerator="cpu", launcher="replica_groups")
    assert engine.needs_launch  # the launcher always launches, even one process per group
    with pytest.raises(ConfigurationError, match="'quorum_timeout'"):
        engine.launch(never_run)


def test_a_diloco_option_is_refused_under_ft_ddp() -> None:
    with pytest.raises(ConfigurationError, match="unknown option 'sync_every'"):
        sg.Engine(strategy="ft_ddp[sync_every=5]", accelerator="cpu")


@pytest.mark.parametrize("replica_id", [2, 5])
def test_a_replica_id_out_of_range(replica_id: int) -> None:
    label = f"ft_ddp[replica_id={replica_id},num_replica_groups=2]"
    with pytest.raises(ConfigurationError, match=rf"replica_id={replica_id}\).*give 0 to 1"):
        sg.Engine(strategy=label, accelerator="cpu")
    with pytest.raises(ConfigurationError, match="whole number >= 0"):
        sg.Engine(strategy="ft_ddp[replica_id=-1,num_replica_groups=2]", accelerator="cpu")


def test_an_unreachable_lighthouse_is_named_within_the_timeout() -> None:
    address = f"http://127.0.0.1:{closed_port()}"
    label = f"ft_ddp[replica_id=0,num_replica_groups=2,lighthouse={address},connect_timeout=1]"
    # The launcher checks it before it starts the group.
    engine = sg.Engine(strategy=label, accelerator="cpu", launcher="replica_groups")
    began = time.monotonic()
    with pytest.raises(ConfigurationError, match=f"lighthouse at {address} cannot be reached.*tried for 1 s"):
        engine.launch(never_run)
    assert time.monotonic() - began < 1 + 3
    # A process that joins on its own (here, one replica group of one process) checks it as it sets up.
    engine = sg.Engine(strategy=label, accelerator="cpu")
    began = time.monotonic()
    with pytest.raises(ConfigurationError, match=f"lighthouse at {address} cannot be reached"):
        engine.setup_environment()
    assert time.monotonic() - began < 1 + 3
    assert not torch.distributed.is_initialized(), "a refused set-up left its process group behind"
    engine.teardown()


def test_a_lighthouse_that_is_not_an_address() -> None:
    with pytest.raises(ConfigurationError, match="http://HOST:PORT"):
        sg.Engine(strategy="ft_ddp[lighthouse=nowhere]", accelerator="cpu")


def test_a_group_of_several_without_the_launcher_or_a_lighthouse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    engine = sg.Engine(strategy="ft_ddp[replica_id=1,num_replica_groups=2]", accelerator="cpu")
    with pytest.raises(ConfigurationError, match=r"no lighthouse.*replica_groups launcher"):
        engine.setup_environment()
    assert not torch.distributed.is_initialized(), "a refused set-up left its process group behind"
    engine.teardown()

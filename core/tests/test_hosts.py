"""The hosts fixture (stratagem.contract.hosts): hosts that resolve and reach each other by name, a host cut off
and reconnected, a host killed, and teardown that leaves nothing (with checks that fail when something is
left). One set of two hosts serves the module; the teardown test makes a set of its own to tear down."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stratagem.contract import _namespaces as ns
from stratagem.contract.hosts import Host, Hosts, LeftBehindError, why_unavailable

pytestmark = pytest.mark.timeout(120)
PORT = "7711"
#: Answers every connection with this host's name, on what the host name resolves to (as gloo binds).
SERVE = """
import socket, sys
server = socket.create_server((socket.gethostbyname(socket.gethostname()), int(sys.argv[1])))
while True:
    connection, _ = server.accept()
    connection.sendall(socket.gethostname().encode())
    connection.close()
"""
#: Asks a host's server for its name: the name, or the error's type.
ASK = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print(c.recv(64).decode())
except OSError as error:
    print(type(error).__name__)
"""


def _ask(host: Host, name: str, timeout: float = 2.0) -> str:
    return host.run([sys.executable, "-c", ASK, name, PORT, str(timeout)], timeout=30).stdout.strip()


def _serve(host: Host) -> subprocess.Popen:
    server = host.popen([sys.executable, "-c", SERVE, PORT])
    deadline = time.monotonic() + 20
    while _ask(host, host.name) != host.name:
        assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
    return server


def _wait_for(host: Host, *commands: str) -> None:
    """Until each of ``commands`` runs on ``host`` (a command started through the host's wrapper is not yet
    itself while the wrapper sets the host name)."""
    deadline = time.monotonic() + 20
    while not all(any(c == running for running in host.pids().values()) for c in commands):
        assert time.monotonic() < deadline, host.pids()
        time.sleep(0.05)


def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=10)


def test_each_host_has_its_name_address_and_folders_and_reaches_the_others_by_name(
    stratagem_hosts: Hosts,
) -> None:
    h0, h1 = stratagem_hosts
    probe = "import socket, tempfile; n = socket.gethostname(); print(n, socket.gethostbyname(n), tempfile.gettempdir())"
    for host in (h0, h1):
        assert host.run([sys.executable, "-c", probe], timeout=30).stdout.split() == [
            host.name,
            host.address,
            str(host.local),
        ]
    assert h0.local != h1.local and h0.shared == h1.shared
    h0.run(["sh", "-c", f"echo from-h0 > {h0.shared}/note"], timeout=10, check=True)
    assert h1.run(["cat", f"{h1.shared}/note"], timeout=10).stdout == "from-h0\n"
    server = _serve(h1)
    try:
        assert _ask(h0, "h1") == "h1"
        assert _ask(h0, h1.address) == "h1"
    finally:
        _stop(server)


def test_a_cut_off_host_cannot_be_reached_and_comes_back(stratagem_hosts: Hosts) -> None:
    h0, h1 = stratagem_hosts
    servers = [_serve(h0), _serve(h1)]
    try:
        assert _ask(h0, "h1") == "h1"
        h1.cut()
        try:
            # Dropped, not refused: the asker waits out its timeout, in both directions.
            assert _ask(h0, "h1", timeout=1.0) == "TimeoutError"
            assert _ask(h1, "h0", timeout=1.0) == "TimeoutError"
            assert all(s.poll() is None for s in servers), "a cut leaves the host's processes running"
        finally:
            h1.reconnect()
        deadline = time.monotonic() + 20
        while (answer := _ask(h0, "h1")) != "h1":
            assert time.monotonic() < deadline, f"h1 did not come back: {answer}"
        assert _ask(h1, "h0") == "h0"
    finally:
        for server in servers:
            _stop(server)


def test_killing_a_host_ends_every_process_in_it_and_only_there(stratagem_hosts: Hosts) -> None:
    h0, h1 = stratagem_hosts
    survivor = h0.popen(["sleep", "300"])
    # A child in a session of its own, which a kill of the parent's group or session would miss.
    h1.popen(["sh", "-c", "setsid sleep 301 & sleep 302"])
    _wait_for(h0, "sleep 300")
    _wait_for(h1, "sleep 301", "sleep 302")
    h1.kill()
    assert h1.pids() == {}
    assert survivor.poll() is None and list(h0.pids()) == [survivor.pid]
    assert h1.run(["hostname"], timeout=10).stdout == "h1\n", "a killed host runs new commands"
    h0.kill()
    assert survivor.wait(timeout=10) == -9


def test_the_check_after_a_test_names_what_it_left_and_kills_it(stratagem_hosts: Hosts) -> None:
    left = stratagem_hosts[1].popen(["sleep", "303"])
    with pytest.raises(LeftBehindError, match=rf"{left.pid} \(h1: .*sleep 303\)"):
        stratagem_hosts.check(grace=0.5)
    assert left.wait(timeout=10) == -9 and stratagem_hosts.left_behind(0) == {}
    # A daemon's helper, counted as the daemon, is not left behind.
    helper = stratagem_hosts[0].popen(["sleep", "306"])
    stratagem_hosts[0].add_daemon(helper.pid)
    stratagem_hosts.check(grace=0.5)
    helper.kill()
    helper.wait(timeout=10)
    # A scratch entry of stratagem's in a host's temporary folder (a run that did not clean up after itself).
    h0 = stratagem_hosts[0]
    h0.run(["sh", "-c", 'mkdir "$TMPDIR"/stratagem-agent-x && touch "$TMPDIR"/other'], timeout=10, check=True)
    assert stratagem_hosts.scratch_left() == ["h0: stratagem-agent-x"]
    with pytest.raises(
        LeftBehindError, match=r"scratch in the hosts' temporary folders .*h0: stratagem-agent-x"
    ):
        stratagem_hosts.check(grace=0.5)
    assert (
        stratagem_hosts.scratch_left() == [] and (h0.local / "other").exists()
    )  # not stratagem's: left alone
    (h0.local / "other").unlink()


def test_teardown_removes_namespaces_links_and_processes(tmp_path: Path) -> None:
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    hosts = Hosts(2, tmp_path).start()
    try:
        daemon = hosts[0].popen(["sleep", "304"], daemon=True)
        escaped = hosts[1].popen(["sh", "-c", "setsid sleep 305 & wait"])
        hosts[1].cut()
        _wait_for(hosts[0], "sleep 304")
        _wait_for(hosts[1], "sleep 305", "sh -c setsid sleep 305 & wait")
        found = hosts.leftovers()
        # What the check looks for is there while the hosts are: three namespaces, three processes.
        assert sum(item.startswith("namespace ") for item in found) == 3
        assert sum(item.startswith("process ") for item in found) == 3, found
        pids = [int(item.split()[1].rstrip(":")) for item in found if item.startswith("process ")]
    finally:
        assert hosts.close() == []
    assert hosts.leftovers() == [] and ns.names(hosts.base) == []
    assert daemon.poll() == -9 and escaped.poll() == -9
    for pid in pids:  # the reparented one too (a zombie until its new parent reaps it has no namespace)
        assert not os.path.exists(f"/proc/{pid}/ns/net")
    assert hosts.close() == []


def test_the_fixture_fails_a_test_that_leaves_a_process_on_a_host(tmp_path: Path) -> None:
    if why_unavailable():
        pytest.skip(why_unavailable())
    (tmp_path / "test_leaves.py").write_text(
        textwrap.dedent(
            """
            def test_leaves_a_process(stratagem_hosts):
                stratagem_hosts[0].popen(["sleep", "306"])

            def test_next_starts_clean(stratagem_hosts):
                assert stratagem_hosts.left_behind(0) == {}
            """
        )
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "test_leaves.py",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "the test left processes on the hosts (now killed)" in out and "sleep 306" in out, out
    assert "2 passed, 1 error" in out, out

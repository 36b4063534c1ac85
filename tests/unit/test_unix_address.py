"""files.unix_address: unix sockets in folders deeper than sun_path's 107 bytes (a host's run
and warm-sandbox folders, a pool's folder under a deep ROLLOUT_LOCAL_ROOT) bind and connect."""

from __future__ import annotations

import socket

import pytest

from rollout_worker.backends.local.files import unix_address


def test_a_socket_deeper_than_sun_path_binds_and_takes_connections(tmp_path):
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 5)
    deep.mkdir(parents=True)
    path = deep / "pool.sock"
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as plain,
        pytest.raises(OSError, match="too long"),
    ):
        plain.bind(str(path))  # why unix_address exists
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
        with unix_address(path) as address:
            server.bind(address)
        server.listen(1)
        assert path.is_socket()  # at the path asked, not under /proc
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
            client.settimeout(5)
            with unix_address(path) as address:
                client.connect(address)
            conn, _ = server.accept()
            with conn:
                client.send(b"take")
                assert conn.recv(16) == b"take"


def test_a_short_path_is_used_as_it_is(tmp_path):
    with unix_address(tmp_path / "s.sock") as address:
        assert address == str(tmp_path / "s.sock")

"""The launcher's port choice: a port it hands out must not be one the kernel may give to any
socket in the meantime (in CI one was taken before the decode node bound its metrics port)."""
from __future__ import annotations

import socket

from harness import local_daemons
from harness.local_daemons import _ephemeral_range, free_port


def test_free_ports_lie_outside_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    ephemeral = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert not [port for port in ports if port in ephemeral]
    assert len(set(ports)) == len(ports)


def test_a_free_port_binds() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_an_ephemeral_range_that_covers_every_port_falls_back_to_the_kernels_choice(monkeypatch) -> None:
    monkeypatch.setattr(local_daemons, "_ephemeral_range", lambda: range(1024, 65536))
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20

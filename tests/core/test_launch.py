"""``free_port``: ports that no other socket on this machine will be handed while we hold them."""

from __future__ import annotations

import socket

from refit_core.kit.launch import _ephemeral_range, free_port


def test_free_ports_are_distinct_bindable_and_below_the_kernels_ephemeral_range() -> None:
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(port < low for port in ports), ports
    for port in ports[:8]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_taken_by_a_listener_is_never_handed_out() -> None:
    low, _ = _ephemeral_range()
    listeners = []
    try:
        for port in range(10000, low):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            listeners.append(sock)
            if len(listeners) == 2000:
                break
        taken = {sock.getsockname()[1] for sock in listeners}
        assert not {free_port() for _ in range(64)} & taken
    finally:
        for sock in listeners:
            sock.close()

"""``free_port``: ports that no other socket on this machine will be handed while we hold them; ``spawn``:
a rank that crashes is named with its signal, not reported as slow."""

from __future__ import annotations

import os
import socket
import time

import pytest

from refit_core.kit.launch import RankFailure, free_port, spawn
from refit_core.net.ports import _ephemeral_range


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


def _rank_1_aborts(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()
    time.sleep(30)
    return rank


def test_a_rank_that_crashes_is_named_with_its_signal_at_once():
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        spawn(_rank_1_aborts, 2, timeout_s=60)
    assert time.monotonic() - start < 20
    message = str(caught.value)
    assert "rank 1: died of SIGABRT" in message and "rank 0: killed by the launcher" in message, message
    assert "did not finish" not in message

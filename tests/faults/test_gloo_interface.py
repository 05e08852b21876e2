"""Where the gloo transport listens, and what stray connections to it cost.

gloo's listeners follow the interface this rank reaches the rendezvous through (loopback for a
local job), not the hostname's. Each connection to a gloo listener that never completes gloo's
handshake keeps one descriptor open in the listening process for the life of the process group: that
is gloo's own listener (it ignores a failed read of the peer's sequence number without closing the
socket), not refit's code, so it is an expected failure here; binding to the rendezvous interface
limits who can reach the listener to those who can reach the rendezvous (only local processes for
a ``127.0.0.1`` rendezvous).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from refit_core.contract.options import TransportKind
from refit_core.apps import same_bytes
from refit_core.net.transport import Transport, open_transport
from refit_core.net.transport.gloo import interface_toward

STRAY = 200


def _listening() -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    text = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    text = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                found.add((text, int(port, 16)))
    return found


def _open_pair(rendezvous: str) -> list[Transport]:
    """Two gloo transports of one refit in this process (threads), on an in-memory store."""
    store = dist.HashStore()
    out: list[Transport | BaseException] = [RuntimeError("not opened")] * 2

    def open_one(rank: int) -> None:
        try:
            out[rank] = open_transport(TransportKind.GLOO, store, rank, 2, torch.device("cpu"), 20,
                                       rendezvous=rendezvous)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out[rank] = exc

    threads = [threading.Thread(target=open_one, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for item in out:
        if isinstance(item, BaseException):
            raise item
    return out  # type: ignore[return-value]


def _non_loopback_address() -> str | None:
    try:
        address = interface_toward("198.51.100.1", 9)  # a documentation address: only the route is looked up
    except OSError:
        return None
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("where", ["loopback", "other"])
def test_gloo_listens_only_on_the_rendezvous_interface(where):
    host = "127.0.0.1" if where == "loopback" else _non_loopback_address()
    if host is None:
        pytest.skip("this machine has no non-loopback interface with a route")
    before = _listening()
    transports = _open_pair(f"{host}:29999")
    try:
        opened = _listening() - before
        assert opened, "gloo opened no listener"
        assert {address for address, _ in opened} == {host}, opened
        exchange = [transports[0].exchange([(1, torch.arange(4.0))], []),
                    transports[1].exchange([], [(0, received := torch.zeros(4))])]
        for fence in exchange:
            fence.synchronize(10)
        assert same_bytes(received, torch.arange(4.0))
    finally:
        for t in transports:
            t.close()


@pytest.mark.xfail(strict=True, reason="gloo's own listener keeps a descriptor per stray connection "
                                       "(a failed handshake read is ignored, the socket never closed)")
def test_stray_connections_to_gloo_leak_no_descriptor():
    before = _listening()
    transports = _open_pair("127.0.0.1:29999")
    try:
        address, port = sorted(_listening() - before)[0]
        descriptors = len(os.listdir("/proc/self/fd"))
        for _ in range(STRAY):
            socket.create_connection((address, port), timeout=5).close()
        time.sleep(0.5)
        grown = len(os.listdir("/proc/self/fd")) - descriptors
        assert grown < STRAY // 10, f"{grown} descriptors more after {STRAY} stray connections"
    finally:
        for t in transports:
            t.close()

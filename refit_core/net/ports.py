"""Free TCP ports for refit's own listeners (the demo's and tests' rendezvous, a fleet's replica jobs)."""

from __future__ import annotations

import os
import random
import socket
import time

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 10000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _is_free(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host``'s interface that is free now and that the kernel will not hand to anyone else.

    Ports come from below the kernel's ephemeral range: a port that ``bind(0)`` returned and we released
    can be given to the next socket that binds or connects (a gloo listener, an outgoing connection)
    before our program listens on it. Each port is handed out once per process.
    """
    low, _ = _ephemeral_range()
    if low - _LOWEST_PORT >= 1000:
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        for _ in range(200):
            port = rng.randrange(_LOWEST_PORT, low)
            if port not in _handed_out and _is_free(port, host):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:  # no room below the
        sock.bind((host, 0))  # ephemeral range: take the kernel's choice
        return int(sock.getsockname()[1])


def free_address(host: str) -> str:
    """``host:port`` (``[host]:port`` for IPv6) with a port of :func:`free_port` on ``host``'s interface."""
    port = free_port(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["free_address", "free_port"]

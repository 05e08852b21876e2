"""What the store's host and clients share: its bounds in bytes and seconds, addresses, values on the wire."""

from __future__ import annotations

import base64
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from refit_core.contract.errors import RendezvousError
from refit_core.contract.options import StoreLimits
from refit_core.net.wire import WireError

HANDSHAKE_BYTES = 2048  # before a peer is authenticated it may not make us allocate more
FRAME_SLACK_BYTES = 64 << 10  # a request's key and JSON around its value
WAIT_SLICE_S = 0.25  # a blocking read returns this often so the client can check for failures
ANSWER_S = 30.0
"""The longest a client waits for the host's answer to one request (capped at its ``timeout_s``), on
top of the time the request holds a read open."""
MIN_ANSWER_S = 1.0  # a wait's last request still gets this long, however little of its deadline is left
CLOSE_S = 2.0
"""The longest a client waits for the answer to its goodbye."""
SEND_S = 30.0
"""The longest the host waits for a reply to leave (a stopped client stops reading)."""
ERROR_KEY = "error"


@dataclass(frozen=True)
class Endpoint:
    """A parsed ``HOST:PORT``."""

    host: str
    port: int

    @classmethod
    def parse(cls, address: str) -> Endpoint:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise RendezvousError(f"rendezvous {address!r}: expected HOST:PORT")
        return cls(host.strip("[]") or "127.0.0.1", int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def request_frame_bytes(limits: StoreLimits) -> int:
    """The largest frame a request may be: one value of ``limits.max_value_bytes`` in base64, and its key."""
    return 4 * -(-limits.max_value_bytes // 3) + FRAME_SLACK_BYTES


def encode_value(value: bytes) -> str:
    return base64.b64encode(value).decode()


def decode_value(value: Any) -> bytes:
    if not isinstance(value, str):
        raise WireError("a store value is not a string")
    return base64.b64decode(value, validate=True)


def wake_socket(conn: socket.socket) -> None:
    """Make every read and write of ``conn`` end at once, in whichever thread; its owner closes it (closing
    it here could let the descriptor be reused under a thread still using it)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def shutdown_socket(conn: socket.socket) -> None:
    """End and close ``conn``; only the thread that uses it may."""
    wake_socket(conn)
    conn.close()


def started_note(greeting: dict[str, Any]) -> str:
    """When the store that answered ``greeting`` says it started (unauthenticated: for the reader only)."""
    started = greeting.get("started")
    if isinstance(started, bool) or not isinstance(started, (int, float)) or not 0 < started < 1e11:
        return "its start time unknown"
    at = datetime.fromtimestamp(started, timezone.utc)
    return f"its store started at {at:%Y-%m-%d %H:%M:%S} UTC, {max(0.0, time.time() - started):.0f} s ago"

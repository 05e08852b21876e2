"""How values travel between ranks during setup: length-prefixed JSON frames, never pickle.

Every value refit reads from the network is JSON, decoded strictly (no NaN or infinities) and then
parsed into typed objects by a schema that checks every field's type and range (piece metadata:
:mod:`refit_core.plan.codec`; each rank's plan: :mod:`refit_core.plan.rankplan`), so a hostile or confused
peer can make a setup fail with a :class:`~refit_core.contract.errors.WireError`, never run code.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from refit_core.contract.errors import WireError

_LENGTH = struct.Struct(">I")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def encode(value: Any) -> bytes:
    """``value`` (JSON types only) as compact UTF-8 JSON."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes | str, what: str) -> Any:
    """Strict JSON (no NaN / Infinity) back to Python; a :class:`WireError` naming ``what`` otherwise."""
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"{what}: not refit data ({exc})") from None


def send_frame(sock: socket.socket, value: Any) -> None:
    """One frame: a 4-byte big-endian length, then the JSON body."""
    body = encode(value)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by the peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, max_bytes: int, what: str) -> Any:
    """Read one frame of at most ``max_bytes``; oversized or malformed frames raise :class:`WireError`."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > max_bytes:
        raise WireError(f"{what}: a frame of {length} bytes exceeds the limit of {max_bytes}")
    return decode(_recv_exactly(sock, length), what)


__all__ = ["WireError", "decode", "encode", "recv_frame", "send_frame"]

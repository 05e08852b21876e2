"""How values travel between ranks during setup: length-prefixed JSON frames, never pickle.

Every value refit reads from the network is JSON, decoded strictly (no NaN or infinities, at most
:data:`MAX_DEPTH` levels of nesting) and then parsed into typed objects by a schema that checks every
field's type and range (piece metadata: :mod:`refit_core.plan.codec`; each rank's plan:
:mod:`refit_core.plan.rankplan`), so a hostile or confused peer can make a setup fail with a
:class:`~refit_core.contract.errors.WireError`, never run code nor exhaust the interpreter's stack.

A frame is a 4-byte big-endian length, the JSON body and, once a connection is authenticated, a
:class:`FrameSeal`'s tag over the body (the length counts the body only).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Protocol

from refit_core.contract.errors import WireError

_LENGTH = struct.Struct(">I")
MAX_DEPTH = 32
"""Most levels of nested lists and objects a value may have (refit's own values have at most 5)."""
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')


class FrameSeal(Protocol):
    """Authenticates the frames of one connection (:class:`refit_core.net.auth.SessionMac`)."""

    tag_bytes: int

    def seal(self, body: bytes) -> bytes:
        """The tag of the next frame this side sends."""
        ...

    def check(self, body: bytes, tag: bytes, what: str) -> None:
        """Accept the next frame received, or raise :class:`WireError` naming ``what``."""
        ...


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def encode(value: Any) -> bytes:
    """``value`` (JSON types only) as compact UTF-8 JSON."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def nested_deeper_than(data: bytes, limit: int) -> bool:
    """Whether the JSON text ``data`` nests lists and objects more than ``limit`` deep.

    Brackets inside strings do not count. Costs a few C-speed passes over ``data`` (about a tenth of
    decoding it); malformed JSON may get either answer (the decoder refuses it anyway)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    if b"\\" in data:  # escaped backslashes and quotes must not pair up with a string's quotes
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    tokens = data.translate(None, _NOT_STRUCTURE).replace(b'""', b"")  # most strings hold no bracket
    if b'"' in tokens:
        tokens = b"".join(tokens.split(b'"')[::2])
    for _ in range(limit):
        peeled = tokens.replace(b"[]", b"").replace(b"{}", b"")  # one level off every innermost pair
        if not peeled or peeled == tokens:
            return False
        tokens = peeled
    return True


def decode(data: bytes | str, what: str) -> Any:
    """Strict JSON (no NaN / Infinity, at most :data:`MAX_DEPTH` deep) back to Python; a
    :class:`WireError` naming ``what`` otherwise."""
    raw = data.encode() if isinstance(data, str) else data
    if nested_deeper_than(raw, MAX_DEPTH):
        raise WireError(f"{what}: not refit data (nested more than {MAX_DEPTH} levels deep)")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"{what}: not refit data ({exc})") from None
    except RecursionError:  # the depth check above should have caught it; never let it escape
        raise WireError(f"{what}: not refit data (nested too deep)") from None


def send_frame(sock: socket.socket, value: Any, seal: FrameSeal | None = None) -> None:
    """One frame: a 4-byte big-endian length, the JSON body, then ``seal``'s tag when given."""
    body = encode(value)
    sock.sendall(_LENGTH.pack(len(body)) + body + (seal.seal(body) if seal is not None else b""))


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            sock.settimeout(left)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by the peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, max_bytes: int, what: str, *, seal: FrameSeal | None = None,
               deadline: float | None = None) -> Any:
    """Read one frame of at most ``max_bytes``, checked by ``seal`` when given, by ``deadline``
    (``time.monotonic()``; None: the socket's own timeout per read). Oversized, malformed or
    unauthenticated frames raise :class:`WireError`; a late one ``socket.timeout``."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, deadline))
    if length > max_bytes:
        raise WireError(f"{what}: a frame of {length} bytes exceeds the limit of {max_bytes}")
    body = _recv_exactly(sock, length, deadline)
    if seal is not None:
        seal.check(body, _recv_exactly(sock, seal.tag_bytes, deadline), what)
    return decode(body, what)


__all__ = ["MAX_DEPTH", "FrameSeal", "WireError", "decode", "encode", "nested_deeper_than", "recv_frame",
           "send_frame"]

"""What travels between ranks during setup, and how: length-prefixed JSON frames, never pickle.

Every value refit reads from the network is JSON, decoded strictly (no NaN or infinities) and then
parsed into typed objects by a schema that checks every field's type and range, so a hostile or
confused peer can make a setup fail with a :class:`~refit_core.errors.RefitError`, never run code.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Sequence
from typing import Any

import torch

from .errors import RefitError
from .pieces import PieceMeta
from .spec import Box, TensorSpec, dtype_from_name

_LENGTH = struct.Struct(">I")
MAX_DIMS = 8
MAX_EXTENT = 1 << 48  # elements along one dimension: far beyond any real tensor, far below overflow


class WireError(RefitError):
    """A peer sent something that is not well-formed refit data."""


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


# -- schema: piece metadata ----------------------------------------------------------------------

def _int_list(value: Any, what: str, *, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise WireError(f"{what}: expected a list of at most {MAX_DIMS} integers, got {value!r:.80}")
    for v in value:
        if type(v) is not int or not minimum <= v <= MAX_EXTENT:
            raise WireError(f"{what}: {v!r:.40} is not an integer in [{minimum}, 2**48]")
    return tuple(value)


def meta_to_wire(meta: PieceMeta) -> dict[str, Any]:
    spec = meta.spec
    return {"name": spec.name, "shape": list(spec.shape), "dtype": str(spec.dtype).removeprefix("torch."),
            "offsets": list(meta.box.offsets), "sizes": list(meta.box.sizes)}


def meta_from_wire(value: Any, what: str) -> PieceMeta:
    """One piece's metadata, every field checked: a name, a shape, a known dtype, a box inside it."""
    if not isinstance(value, dict) or set(value) != {"name", "shape", "dtype", "offsets", "sizes"}:
        raise WireError(f"{what}: expected a piece record, got {value!r:.120}")
    name = value["name"]
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise WireError(f"{what}: the tensor name {name!r:.80} is not a non-empty string")
    shape = _int_list(value["shape"], f"{what} {name} shape", minimum=0)
    offsets = _int_list(value["offsets"], f"{what} {name} offsets", minimum=0)
    sizes = _int_list(value["sizes"], f"{what} {name} sizes", minimum=0)
    if not isinstance(value["dtype"], str):
        raise WireError(f"{what} {name}: dtype {value['dtype']!r:.40} is not a name")
    try:
        dtype = dtype_from_name(value["dtype"])
    except ValueError as exc:
        raise WireError(f"{what} {name}: {exc}") from None
    if math.prod(shape) > MAX_EXTENT:
        raise WireError(f"{what} {name}: shape {shape} has more than 2**48 elements")
    try:
        box = Box(offsets, sizes)
    except ValueError as exc:
        raise WireError(f"{what} {name}: {exc}") from None
    if not box.within(shape):
        raise WireError(f"{what} {name}: box {box} lies outside shape {shape}")
    return PieceMeta(TensorSpec(name, shape, dtype), box)


def metas_to_wire(metas: Sequence[PieceMeta]) -> list[dict[str, Any]]:
    return [meta_to_wire(m) for m in metas]


def metas_from_wire(value: Any, what: str) -> list[PieceMeta]:
    if not isinstance(value, list):
        raise WireError(f"{what}: expected a list of pieces, got {type(value).__name__}")
    return [meta_from_wire(v, f"{what} piece {i}") for i, v in enumerate(value)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

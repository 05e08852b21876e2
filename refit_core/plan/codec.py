"""Piece metadata and quantizations as JSON records, and back, every field checked (the setup's schema).

A rank publishes its pieces' metadata (:func:`metas_to_wire`); every rank parses what the others published
(:func:`metas_from_wire`): a name, a shape, a known dtype, a box inside the shape and, for a quantized
(FP8) tensor, a quantization that fits it, or a :class:`~refit_core.contract.errors.WireError` naming the
piece. The frames these records travel in are :mod:`refit_core.net.wire`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from refit_core.contract.errors import WireError
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import FP8_DTYPES, Box, Quantization, QuantScheme, TensorSpec, dtype_from_name, dtype_name

MAX_DIMS = 8
"""Most dimensions a tensor of a record may have."""
MAX_EXTENT = 1 << 48
"""Most elements along one dimension (and in one tensor): far beyond any real tensor, far below overflow."""


def _int_list(value: Any, what: str, *, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise WireError(f"{what}: expected a list of at most {MAX_DIMS} integers, got {value!r:.80}")
    for v in value:
        if type(v) is not int or not minimum <= v <= MAX_EXTENT:
            raise WireError(f"{what}: {v!r:.40} is not an integer in [{minimum}, 2**48]")
    return tuple(value)


_PIECE_FIELDS = frozenset({"name", "shape", "dtype", "offsets", "sizes"})
_QUANT_FIELDS = frozenset({"scheme", "block", "scale_name", "dtype", "scale_dtype"})
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def meta_to_wire(meta: PieceMeta) -> dict[str, Any]:
    """A piece's metadata as a JSON record; a quantized (FP8) tensor's record adds ``quant``."""
    spec = meta.spec
    out: dict[str, Any] = {"name": spec.name, "shape": list(spec.shape), "dtype": dtype_name(spec.dtype),
                           "offsets": list(meta.box.offsets), "sizes": list(meta.box.sizes)}
    if spec.quant is not None:
        out["quant"] = quant_to_wire(spec.quant)
    return out


def quant_to_wire(quant: Quantization) -> dict[str, Any]:
    """A quantization as a JSON record (:func:`quant_from_wire` reads it back)."""
    return {"scheme": quant.scheme.value, "block": list(quant.block), "scale_name": quant.scale_name,
            "dtype": dtype_name(quant.dtype), "scale_dtype": dtype_name(quant.scale_dtype)}


def dtype_from_wire(value: Any, allowed: Sequence[torch.dtype] | None, what: str) -> torch.dtype:
    """A dtype's name back to the dtype, one of ``allowed`` (None: any known dtype); a :class:`WireError` naming
    ``what`` otherwise."""
    if not isinstance(value, str):
        raise WireError(f"{what}: dtype {value!r:.40} is not a name")
    try:
        dtype = dtype_from_name(value)
    except ValueError as exc:
        raise WireError(f"{what}: {exc}") from None
    if allowed is not None and dtype not in allowed:
        raise WireError(f"{what}: dtype {value} is not one of {[dtype_name(d) for d in allowed]}")
    return dtype


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise WireError(f"{what}: the tensor name {value!r:.80} is not a non-empty string")
    return value


def quant_from_wire(value: Any, what: str) -> Quantization:
    """A destination tensor's quantization, every field checked (scheme, block sizes >= 1, FP8 dtype)."""
    if not isinstance(value, dict) or set(value) != _QUANT_FIELDS:
        raise WireError(f"{what}: expected a quantization record with {sorted(_QUANT_FIELDS)}, got {value!r:.120}")
    if value["scheme"] not in {s.value for s in QuantScheme}:
        raise WireError(f"{what}: unknown quantization scheme {value['scheme']!r:.40}")
    block = _int_list(value["block"], f"{what} block", minimum=1)
    return Quantization(QuantScheme(value["scheme"]), block, _name(value["scale_name"], f"{what} scale"),
                        dtype_from_wire(value["dtype"], FP8_DTYPES, f"{what} values"),
                        dtype_from_wire(value["scale_dtype"], _SCALE_DTYPES, f"{what} scales"))


def meta_from_wire(value: Any, what: str) -> PieceMeta:
    """One piece's metadata, every field checked: a name, a shape, a known dtype, a box inside it,
    and for a quantized tensor a quantization that fits it."""
    if not isinstance(value, dict) or set(value) - {"quant"} != _PIECE_FIELDS:
        raise WireError(f"{what}: expected a piece record, got {value!r:.120}")
    name = _name(value["name"], what)
    shape = _int_list(value["shape"], f"{what} {name} shape", minimum=0)
    offsets = _int_list(value["offsets"], f"{what} {name} offsets", minimum=0)
    sizes = _int_list(value["sizes"], f"{what} {name} sizes", minimum=0)
    dtype = dtype_from_wire(value["dtype"], None, f"{what} {name}")
    quant = quant_from_wire(value["quant"], f"{what} {name} quant") if "quant" in value else None
    if math.prod(shape) > MAX_EXTENT:
        raise WireError(f"{what} {name}: shape {shape} has more than 2**48 elements")
    try:
        box = Box(offsets, sizes)
    except ValueError as exc:
        raise WireError(f"{what} {name}: {exc}") from None
    if not box.within(shape):
        raise WireError(f"{what} {name}: box {box} lies outside shape {shape}")
    try:
        spec = TensorSpec(name, shape, dtype, quant)
    except ValueError as exc:  # the quantization's dtype or block rank does not fit the tensor
        raise WireError(f"{what} {name}: {exc}") from None
    return PieceMeta(spec, box)


def metas_to_wire(metas: Sequence[PieceMeta]) -> list[dict[str, Any]]:
    """A rank's pieces' metadata as JSON records, in order."""
    return [meta_to_wire(m) for m in metas]


def metas_from_wire(value: Any, what: str) -> list[PieceMeta]:
    """A rank's pieces' metadata back from :func:`metas_to_wire`'s records, each checked (:func:`meta_from_wire`)."""
    if not isinstance(value, list):
        raise WireError(f"{what}: expected a list of pieces, got {type(value).__name__}")
    return [meta_from_wire(v, f"{what} piece {i}") for i, v in enumerate(value)]



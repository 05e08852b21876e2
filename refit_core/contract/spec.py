"""Tensor specs and boxes: the shared language of both sides, in HuggingFace checkpoint space."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from refit_core.contract.quantization import Quantization


@dataclass(frozen=True)
class TensorSpec:
    """A logical tensor of the HF checkpoint: its name, full (global) shape and dtype.

    Grouped MoE experts are one logical tensor: ``model.layers.0.mlp.experts.gate_proj.weight``
    of shape ``[E, I, H]`` stands for the checkpoint's ``...experts.{e}.gate_proj.weight``.

    ``quant`` is set on a destination tensor that holds quantized (FP8) values: ``dtype`` is then
    the FP8 dtype and ``quant.scale_name`` names the tensor holding its scales (see
    :mod:`refit_core.contract.quantization`); None means the tensor holds plain values.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant: Quantization | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.quant is not None:
            if self.quant.dtype != self.dtype:
                raise ValueError(f"{self.name}: dtype {self.dtype} differs from its quantization's "
                                 f"{self.quant.dtype}")
            self.quant.scale_shape(self.shape)  # the block fits the tensor's rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)

    def full_box(self) -> Box:
        return Box.full(self.shape)


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle ``[offsets, offsets + sizes)`` of a logical tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ends: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        offsets, sizes = tuple(map(int, self.offsets)), tuple(map(int, self.sizes))
        if len(offsets) != len(sizes):
            raise ValueError(f"box rank mismatch: offsets {offsets}, sizes {sizes}")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "ends", tuple(o + s for o, s in zip(offsets, sizes)))

    def __hash__(self) -> int:
        """The dataclass' hash (of offsets and sizes), kept after the first call: the planner hashes
        the same box objects over and over (layout signatures)."""
        fields = self.__dict__
        cached = fields.get("_hash")
        if cached is None:
            cached = fields["_hash"] = hash((self.offsets, self.sizes))
        return cached

    @classmethod
    def of(cls, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
        """A box from tuples of ints of equal length that are known good, without re-checking them.

        The planner's inner loops build millions of boxes from boxes already checked; this skips
        the conversions ``Box(...)`` makes (same result, a fraction of the cost).
        """
        box = object.__new__(cls)
        fields = box.__dict__
        fields["offsets"] = offsets
        fields["sizes"] = sizes
        fields["ends"] = tuple([o + s for o, s in zip(offsets, sizes)])
        return box

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def is_empty(self) -> bool:
        return any(s <= 0 for s in self.sizes)

    def within(self, shape: tuple[int, ...]) -> bool:
        """Whether this box lies inside a tensor of ``shape``."""
        if len(shape) != len(self.sizes):
            return False
        for o, e, n in zip(self.offsets, self.ends, shape):
            if o < 0 or e > n:
                return False
        return True

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when they do not overlap."""
        lo, hi = [], []
        for a, b, ea, eb in zip(self.offsets, other.offsets, self.ends, other.ends):
            start = a if a > b else b
            end = ea if ea < eb else eb
            if end <= start:
                return None
            lo.append(start)
            hi.append(end)
        box = object.__new__(Box)
        fields = box.__dict__
        fields["offsets"] = tuple(lo)
        fields["sizes"] = tuple([e - s for s, e in zip(lo, hi)])
        fields["ends"] = tuple(hi)
        return box

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box.of(tuple([o - p for o, p in zip(self.offsets, outer.offsets)]), self.sizes)

    def slice_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of ``tensor`` this box selects (a strided view, never a copy)."""
        view = tensor
        for dim, (o, s) in enumerate(zip(self.offsets, self.sizes)):
            if o != 0 or s != view.shape[dim]:
                view = view.narrow(dim, o, s)
        return view

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


@functools.cache
def contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a contiguous (row-major) tensor of ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(sizes[d + 1], 1)
    return tuple(strides)


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16",
               "float": "float32"}
    key = aliases.get(key, key)
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[key]

"""Tensor specs, boxes and quantization: the data model both sides speak, in HuggingFace checkpoint space.

A :class:`TensorSpec` names a logical tensor; a :class:`Box` is a hyper-rectangle of it. A quantized
destination tensor's spec carries a :class:`Quantization`: FP8 values in blocks, each block with one scale.

Every scheme is a grid of blocks over the logical tensor, one scale per block (edge blocks may be
smaller): block-FP8 (DeepSeek-V3 / vLLM / SGLang ``weight_block_size: [128, 128]``) has 128 x 128
blocks, per-channel FP8 one block per output row ``(1, C)``, per-tensor FP8 one block for the whole
tensor. Stacked MoE experts ``[E, R, C]`` add a leading block size of 1 (one grid per expert).

The scale is the *dequantization* multiplier, as vLLM's ``weight_scale_inv`` (block) and
``weight_scale`` (per-tensor / per-channel) hold it: ``value ~= fp8 * scale``, with
``scale = max(amax, EPS) / FP8_MAX`` over the block. The scale tensor is a logical tensor of its own
(``Quantization.scale_name``, shape :meth:`Quantization.scale_shape`, fp32), so it travels, is
planned and is checked like any other tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from refit_core.contract.records import unchecked


@dataclass(frozen=True)
class TensorSpec:
    """A logical tensor of the HF checkpoint: its name, full (global) shape and dtype.

    Grouped MoE experts are one logical tensor: ``model.layers.0.mlp.experts.gate_proj.weight``
    of shape ``[E, I, H]`` stands for the checkpoint's ``...experts.{e}.gate_proj.weight``.

    ``quant`` is set on a destination tensor that holds quantized (FP8) values: ``dtype`` is then
    the FP8 dtype and ``quant.scale_name`` names the tensor holding its scales (see
    :class:`Quantization`); None means the tensor holds plain values.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant: Quantization | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not isinstance(self.dtype, torch.dtype):
            known = _DTYPES.get(str(self.dtype).removeprefix("torch."))
            hint = f" (torch.{dtype_name(known)})" if known is not None else ""
            raise TypeError(f"TensorSpec {self.name!r}: dtype {self.dtype!r} is a {type(self.dtype).__name__}, "
                            f"not a torch.dtype{hint}")
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
        return _box(offsets, sizes, tuple([o + s for o, s in zip(offsets, sizes)]))

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
        return _box(tuple(lo), tuple([e - s for s, e in zip(lo, hi)]), tuple(hi))

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


_box = unchecked(Box)


EPS = 1e-10
"""Smallest amax a scale is computed from (an all-zero block gets a tiny scale, never a division by 0)."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK_SCALE_SUFFIX = "_scale_inv"
"""A block-FP8 checkpoint's scale tensor of ``X.weight`` is ``X.weight_scale_inv`` (DeepSeek-V3, Qwen3-FP8,
vLLM, SGLang and transformers' ``FP8Linear`` alike)."""


class QuantScheme(Enum):
    """How scales are laid over a tensor."""

    BLOCK = "block"
    """One scale per ``block`` (128 x 128 for block-FP8)."""
    PER_CHANNEL = "per-channel"
    """One scale per output row."""
    PER_TENSOR = "per-tensor"
    """One scale for the whole tensor (per expert for stacked experts)."""


class QuantSite(Enum):
    """Where a quantized destination's values and scales are computed from high-precision weights."""

    SENDER = "sender"
    """In the sender's pack step: FP8 values and scales travel (every transfer holds whole blocks)."""
    RECEIVER = "receiver"
    """On the gen rank after the high-precision bytes landed (transfers split blocks)."""


@dataclass(frozen=True)
class Quantization:
    """A destination tensor's quantization: FP8 ``dtype`` values, one ``scale_dtype`` scale per block.

    ``block`` has one entry per dimension of the tensor (a dimension's block size may exceed the
    tensor: it is clipped). ``scale_name`` is the logical tensor holding the scales, of shape
    :meth:`scale_shape`; a destination declares pieces for it like for any tensor.
    """

    scheme: QuantScheme
    block: tuple[int, ...]
    scale_name: str
    dtype: torch.dtype = torch.float8_e4m3fn
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        if self.dtype not in FP8_DTYPES:
            raise ValueError(f"{self.scale_name}: quantized dtype must be one of {FP8_DTYPES}, got {self.dtype}")
        if any(b < 1 for b in self.block):
            raise ValueError(f"{self.scale_name}: block sizes must be >= 1, got {self.block}")

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def block_fp8(cls, scale_name: str, block: tuple[int, ...] = (128, 128), *, experts: bool = False,
                  dtype: torch.dtype = torch.float8_e4m3fn) -> Quantization:
        """Block-FP8 (``weight_scale_inv``), 128 x 128 by default; ``experts`` for stacked ``[E, R, C]``."""
        return cls(QuantScheme.BLOCK, ((1,) if experts else ()) + tuple(block), scale_name, dtype)

    @classmethod
    def per_channel(cls, scale_name: str, shape: tuple[int, ...], *,
                    dtype: torch.dtype = torch.float8_e4m3fn) -> Quantization:
        """One scale per output row (the last dim is reduced): scales of shape ``[..., R, 1]``."""
        return cls(QuantScheme.PER_CHANNEL, (1,) * (len(shape) - 1) + (shape[-1],), scale_name, dtype)

    @classmethod
    def per_tensor(cls, scale_name: str, shape: tuple[int, ...], *, experts: bool = False,
                   dtype: torch.dtype = torch.float8_e4m3fn) -> Quantization:
        """One scale for the tensor (per expert if ``experts``): scales of shape ``[1, 1]`` / ``[E, 1, 1]``."""
        block = ((1,) + tuple(shape[1:])) if experts else tuple(shape)
        return cls(QuantScheme.PER_TENSOR, block, scale_name, dtype)

    # -- geometry -------------------------------------------------------------------------------

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a tensor of ``shape`` (blocks per dim, rounded up)."""
        self._check_rank(shape)
        return tuple(-(-n // b) for n, b in zip(shape, self.block))

    def scale_spec(self, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(self.scale_name, self.scale_shape(shape), self.scale_dtype)

    def aligned(self, box: Box, shape: tuple[int, ...]) -> bool:
        """Whether ``box`` (of a tensor of ``shape``) consists of whole blocks only."""
        self._check_rank(shape)
        return all(o % b == 0 and (e % b == 0 or e == n)
                   for o, e, b, n in zip(box.offsets, box.ends, self.block, shape))

    def scale_box(self, box: Box) -> Box:
        """The scales of the blocks ``box`` covers; ``box`` must start on block boundaries."""
        if any(o % b for o, b in zip(box.offsets, self.block)):
            raise ValueError(f"{self.scale_name}: box {box} does not start on a block boundary {self.block}")
        starts = tuple(o // b for o, b in zip(box.offsets, self.block))
        ends = tuple(-(-e // b) for e, b in zip(box.ends, self.block))
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))

    def scale_nbytes(self, sizes: tuple[int, ...]) -> int:
        """Bytes of the scales of a block-aligned box of ``sizes``."""
        return math.prod(-(-n // b) for n, b in zip(sizes, self.block)) * self.scale_dtype.itemsize

    def stacked(self, scale_name: str) -> Quantization:
        """This quantization for a stack of such tensors (grouped experts ``[E, ...]``)."""
        return Quantization(self.scheme, (1, *self.block), scale_name, self.dtype, self.scale_dtype)

    def describe(self) -> str:
        return f"{self.scheme.value} {str(self.dtype).removeprefix('torch.')} blocks {self.block}"

    def _check_rank(self, shape: tuple[int, ...]) -> None:
        if len(shape) != len(self.block):
            raise ValueError(f"{self.scale_name}: block {self.block} does not fit a tensor of shape {shape}")


@dataclass(frozen=True)
class QuantizeStep:
    """A transfer that quantizes: how, where, and which destination piece gets the scales."""

    quant: Quantization
    site: QuantSite
    scale_piece: int
    """Index of the gen rank's piece of the scale tensor whose box is the scales of this transfer's piece."""


@functools.cache
def contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a contiguous (row-major) tensor of ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(sizes[d + 1], 1)
    return tuple(strides)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (:func:`dtype_from_name` reads it back)."""
    return str(dtype).removeprefix("torch.")


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


_DTYPES = {dtype_name(d): d for d in (
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

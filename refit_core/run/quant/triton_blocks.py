"""Block-FP8 quantization of many boxes in one Triton launch (CUDA).

The launch has one program per quantization block. A per-block ``int32`` index names the block's
segment; a per-segment ``int64`` row of :data:`FIELDS` holds the source's offset (from an aligned
anchor tensor, so that Triton can prove alignment and vectorize) and strides, its ``[G, R, C]``
extent, its block grid, its first block, and the offsets and strides of its values and scales (in
the staging buffer, or addresses). Those tables are built once at bind time; a step passes only the
staging buffer. Memory: 4 bytes per block plus 136 bytes per segment.

Per block the arithmetic is :mod:`.reference`'s: ``amax`` over the block (zero-padded at clipped
edges), ``clamped = max(amax, EPS)`` in fp32, ``scale = clamped / FP8_MAX`` and
``reciprocal = FP8_MAX / clamped`` divided in fp64 and rounded to fp32, values
``clamp(x * reciprocal, -FP8_MAX, FP8_MAX)`` rounded to nearest even. The results are bitwise those
of the reference quantizer (tested on the GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.contract.spec import EPS
from refit_core.run.quant.boxes import BoxToQuantize, QuantBatch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every box goes through the box-by-box quantizer
    triton = None

FIELDS = 17
"""Per-segment table row: source offset (elements from the source anchor), its strides along G, R
and C; G, R, C; blocks along R and C; first block; values offset (bytes) and strides along G and R;
scales offset (fp32 elements) and strides along G, R and C."""
MAX_BLOCK_NUMEL = 128 * 128
"""Largest block one program quantizes in registers."""
VECTOR_BYTES = 16
"""Loads and stores are vectorized to this many bytes when a group's boxes are aligned to it."""
_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GroupKey:
    """What one compiled kernel variant (and one launch per step) covers."""

    source_dtype: torch.dtype
    fp8_dtype: torch.dtype
    bn: int
    bk: int
    aligned: bool
    """Every box reads whole 16-byte vectors: inner stride 1, rows, values and addresses 16-byte aligned."""


def group_key(box: BoxToQuantize) -> GroupKey | None:
    """The kernel variant that can quantize ``box``, or None when the batched kernel can't."""
    quant, source = box.quant, box.source
    if triton is None or source.device.type != "cuda" or source.dtype not in _SOURCE_DTYPES:
        return None
    if source.ndim not in (2, 3) or any(b != 1 for b in quant.block[:-2]) or box.scales_offset % 4:
        return None
    bn, bk = quant.block[-2:]
    if bn & (bn - 1) or bk & (bk - 1) or bn * bk > MAX_BLOCK_NUMEL:
        return None
    return GroupKey(source.dtype, quant.dtype, bn, bk, vector_aligned(box))


def _as_3d(source: torch.Tensor) -> torch.Tensor:
    return source if source.ndim == 3 else source.unsqueeze(0)


def vector_aligned(box: BoxToQuantize) -> bool:
    """Whether ``box`` reads and writes whole 16-byte vectors (the kernel's fast variant)."""
    source = _as_3d(box.source)
    size = source.element_size()
    stride_g, stride_r, stride_c = source.stride()
    values_g, values_r = _values_strides(box)
    return (stride_c == 1 and source.data_ptr() % VECTOR_BYTES == 0 and (stride_r * size) % VECTOR_BYTES == 0
            and (stride_g * size) % VECTOR_BYTES == 0 and source.shape[-1] % VECTOR_BYTES == 0
            and box.values_offset % VECTOR_BYTES == 0 and values_g % VECTOR_BYTES == 0
            and values_r % VECTOR_BYTES == 0)


def _values_strides(box: BoxToQuantize) -> tuple[int, int]:
    if box.values_strides is not None:
        return box.values_strides
    _, n_rows, n_cols = _as_3d(box.source).shape
    return n_rows * n_cols, n_cols


def _scales_strides(box: BoxToQuantize, blocks_r: int, blocks_c: int) -> tuple[int, int, int]:
    return box.scales_strides if box.scales_strides is not None else (blocks_r * blocks_c, blocks_c, 1)


def _segment_table(boxes: Sequence[BoxToQuantize], bn: int, bk: int, anchor: int
                   ) -> tuple[list[list[int]], list[int]]:
    """The per-segment table rows (source offsets from address ``anchor``) and each segment's block count."""
    rows, counts = [], []
    first = 0
    for box in boxes:
        source = _as_3d(box.source)
        groups, n_rows, n_cols = source.shape
        blocks_r, blocks_c = -(-n_rows // bn), -(-n_cols // bk)
        count = groups * blocks_r * blocks_c
        rows.append([(source.data_ptr() - anchor) // source.element_size(), *source.stride(), groups, n_rows,
                     n_cols, blocks_r, blocks_c, first, box.values_offset, *_values_strides(box),
                     box.scales_offset // 4, *_scales_strides(box, blocks_r, blocks_c)])
        counts.append(count)
        first += count
    return rows, counts


class TritonBlockBatch(QuantBatch):
    """Boxes of one :class:`GroupKey`, quantized by one launch per step.

    The values and scales offsets of the boxes are bytes into the staging buffer given to
    :meth:`run`, or addresses for :meth:`run_at_addresses`.
    """

    def __init__(self, boxes: Sequence[BoxToQuantize], key: GroupKey) -> None:
        self.boxes = list(boxes)  # holds the sources' storage alive: the table has their addresses
        self.key = key
        self.fp8_max = float(torch.finfo(key.fp8_dtype).max)
        device = self.boxes[0].source.device
        self.anchor = torch.empty(VECTOR_BYTES, dtype=torch.uint8, device=device)
        """Source and absolute-address offsets count from here (a tensor argument Triton knows aligned)."""
        rows, counts = _segment_table(self.boxes, key.bn, key.bk, self.anchor.data_ptr())
        self.blocks = sum(counts)
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.block_segment = torch.repeat_interleave(
            torch.arange(len(counts), dtype=torch.int32, device=device),
            torch.tensor(counts, dtype=torch.int64, device=device))

    def run(self, buffer: torch.Tensor) -> None:
        self._launch(buffer, 0)

    def run_at_addresses(self) -> None:
        """Quantize with the boxes' values and scales offsets taken as addresses."""
        self._launch(self.anchor, -self.anchor.data_ptr())

    def warm_up(self, warmed: set[object]) -> None:
        """Compile this variant on one synthetic box (the same specialization as the real launches)."""
        if self.key in warmed:
            return
        warmed.add(self.key)
        bn, bk = self.key.bn, self.key.bk
        cols = bk * -(-VECTOR_BYTES // bk)
        device = self.boxes[0].source.device
        source = torch.zeros(bn, cols, dtype=self.key.source_dtype, device=device)
        quant = self.boxes[0].quant
        scratch = torch.empty(bn * cols + 2 * VECTOR_BYTES * 4, dtype=torch.uint8, device=device)
        TritonBlockBatch([BoxToQuantize(source, quant, 0, bn * cols)], self.key).run(scratch)  # contiguous
        torch.cuda.current_stream(device).synchronize()

    def _launch(self, out: torch.Tensor, shift: int) -> None:
        if self.blocks == 0:
            return
        key = self.key
        out = out[:out.numel() // 4 * 4]
        source_size = key.source_dtype.itemsize
        _quantize_blocks[(self.blocks,)](
            self.table, self.block_segment, self.anchor.view(key.source_dtype), out,
            out.view(torch.float32), shift, shift // 4,
            BN=key.bn, BK=key.bk, FP8_MAX=self.fp8_max, EPSILON=EPS, OUT=_TL_DTYPES[key.fp8_dtype],
            WIDTH=FIELDS, ALIGNED=key.aligned, VECTOR=VECTOR_BYTES // source_size,
            num_warps=8 if key.bn * key.bk >= 128 * 64 else 4)


_TL_DTYPES: dict[torch.dtype, Any] = {}
_quantize_blocks: Any = None

if triton is not None:
    _TL_DTYPES.update({torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5})

    @triton.jit
    def _quantize_blocks_kernel(table, block_segment, source_anchor, out_bytes, out_floats, shift_bytes,
                                shift_floats, BN: tl.constexpr, BK: tl.constexpr, FP8_MAX: tl.constexpr,
                                EPSILON: tl.constexpr, OUT: tl.constexpr, WIDTH: tl.constexpr,
                                ALIGNED: tl.constexpr, VECTOR: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        row = table + tl.load(block_segment + block).to(tl.int64) * WIDTH
        source_offset = tl.load(row)
        stride_g, stride_r, stride_c = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
        n_rows, n_cols = tl.load(row + 5), tl.load(row + 6)
        blocks_r, blocks_c = tl.load(row + 7), tl.load(row + 8)
        local = block - tl.load(row + 9)
        values_offset = tl.load(row + 10) + shift_bytes
        values_g, values_r = tl.load(row + 11), tl.load(row + 12)
        scales_offset = tl.load(row + 13) + shift_floats
        scales_g, scales_r, scales_c = tl.load(row + 14), tl.load(row + 15), tl.load(row + 16)

        col_block = local % blocks_c
        row_block = (local // blocks_c) % blocks_r
        group = local // (blocks_c * blocks_r)
        row0, col0 = row_block * BN, col_block * BK
        source_start = source_offset + group * stride_g + row0 * stride_r + col0 * stride_c
        values_start = values_offset + group * values_g + row0 * values_r + col0
        if ALIGNED:
            source_start = tl.multiple_of(source_start, VECTOR)
            stride_r = tl.multiple_of(stride_r, VECTOR)
            values_start = tl.multiple_of(values_start, 16)
            values_r = tl.multiple_of(values_r, 16)
            n_cols = tl.multiple_of(n_cols, 16)
        rr = tl.arange(0, BN)[:, None]
        cc = tl.arange(0, BK)[None, :]
        if ALIGNED:
            sources = source_anchor + source_start + rr * stride_r + cc
        else:
            sources = source_anchor + source_start + rr * stride_r + cc * stride_c
        values = out_bytes + values_start + rr * values_r + cc
        full = (row0 + BN <= n_rows) & (col0 + BK <= n_cols)
        if full:
            x = tl.load(sources).to(tl.float32)
        else:
            x = tl.load(sources, mask=(row0 + rr < n_rows) & (col0 + cc < n_cols), other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        clamped = tl.maximum(amax, EPSILON).to(tl.float64)
        scale = (clamped / FP8_MAX).to(tl.float32)
        reciprocal = (FP8_MAX / clamped).to(tl.float32)
        quantized = tl.minimum(tl.maximum(x * reciprocal, -FP8_MAX), FP8_MAX).to(OUT).to(tl.uint8, bitcast=True)
        if full:
            tl.store(values, quantized)
        else:
            tl.store(values, quantized, mask=(row0 + rr < n_rows) & (col0 + cc < n_cols))
        tl.store(out_floats + scales_offset + group * scales_g + row_block * scales_r + col_block * scales_c, scale)

    _quantize_blocks = _quantize_blocks_kernel


__all__ = ["FIELDS", "MAX_BLOCK_NUMEL", "GroupKey", "TritonBlockBatch", "group_key"]

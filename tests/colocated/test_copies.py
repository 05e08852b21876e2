"""The colocated receiver's copy program: merged, stacked, widened and batched copies move exactly the
bytes of the copies asked for (bit for bit, NaN payloads included), in few launches."""

from __future__ import annotations

import random

import pytest
import torch

from refit_core.contract.options import StridedCopy
from refit_core.apps import same_bytes
from refit_core.run.copies import CopyProgram, blocks, coalesce, pitched, widen


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is possible, NaNs with payloads and negative zeros among them."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def _expected(dst: torch.Tensor, pairs, pair_of) -> torch.Tensor:
    """The destination after one plain ``copy_`` per pair (on a clone)."""
    out = dst.clone()
    for d, s in pairs:
        pair_of(out, d).copy_(s)
    return out


def _same_view(base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    return base.as_strided(view.shape, view.stride(), view.storage_offset())


def test_expert_gate_and_up_halves_become_one_contiguous_copy():
    """vLLM's ``w13[:, :I]`` / ``w13[:, I:]`` from Megatron's ``fc1[:, :I]`` / ``fc1[:, I:]``: neighbours
    along dim 1 on both sides, so one copy of the whole stack (a plain memcpy), not two strided ones."""
    experts, inter, hidden = 8, 6, 16
    fc1 = _random_bits((experts, 2 * inter, hidden), torch.bfloat16, 1)
    w13 = torch.zeros_like(fc1)
    pairs = [(w13[:, inter:], fc1[:, inter:]), (w13[:, :inter], fc1[:, :inter])]  # any order
    merged = coalesce(pairs)
    assert len(merged) == 1 and merged[0][0].shape == (experts, 2 * inter, hidden)
    assert merged[0][0].is_contiguous() and merged[0][1].is_contiguous()
    program = CopyProgram(pairs)
    program.run()
    assert same_bytes(w13, fc1)
    assert program.counts.launches == 1 and program.counts.strided == 0


def test_halves_that_are_not_neighbours_in_the_source_become_one_strided_copy():
    """A TP-2 engine's ``[gate_0; up_0]`` rows come from ``fc1[:, :I/2]`` and ``fc1[:, I:I + I/2]``: equal
    blocks at constant distances on both sides, stacked on a new leading dimension."""
    experts, inter, hidden = 4, 8, 8
    fc1 = _random_bits((experts, 2 * inter, hidden), torch.bfloat16, 2)
    w13 = torch.zeros(experts, inter, hidden, dtype=torch.bfloat16)
    half = inter // 2
    pairs = [(w13[:, :half], fc1[:, :half]), (w13[:, half:], fc1[:, inter:inter + half])]
    merged = coalesce(pairs)
    assert len(merged) == 1 and merged[0][1].shape == (2, experts, half, hidden)
    CopyProgram(pairs).run()
    assert same_bytes(w13, torch.cat([fc1[:, :half], fc1[:, inter:inter + half]], dim=1))


def test_strided_same_dtype_copies_move_as_wide_words_bit_for_bit():
    groups, q, kv, hidden = 4, 6, 2, 16
    qkv = _random_bits((groups, q + 2 * kv, hidden), torch.bfloat16, 3)
    dst = torch.zeros(groups, q, hidden, dtype=torch.bfloat16)
    wide_dst, wide_src = widen(dst, qkv[:, :q])
    assert wide_dst.dtype == wide_src.dtype == torch.int64 and wide_src.shape == (groups, q, hidden // 4)
    wide_dst.copy_(wide_src)
    assert same_bytes(dst, qkv[:, :q])
    odd = torch.zeros(3, 5, dtype=torch.bfloat16)  # 10-byte rows: 2-byte words only, left alone
    assert widen(odd, torch.ones(3, 5, dtype=torch.bfloat16))[0].dtype == torch.bfloat16
    cast = widen(torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(4, 8))  # a cast is never reinterpreted
    assert cast[0].dtype == torch.bfloat16 and cast[1].dtype == torch.float32
    columns = torch.zeros(8, 8, dtype=torch.bfloat16)[:, :1]  # last stride 8: no wider word fits
    assert widen(columns, torch.zeros(8, 1, dtype=torch.bfloat16))[0].dtype == torch.bfloat16


def test_small_copies_are_batched_per_dtype_pair_and_large_ones_run_alone():
    experts, rows, hidden = 16, 4, 32
    src = _random_bits((experts, rows, hidden), torch.bfloat16, 4)
    # per-expert source tensors (separate allocations, as Megatron's SequentialMLP) into one stack
    sources = [src[e].clone() for e in range(experts)]
    dst = torch.zeros_like(src)
    norms_src, norms_dst = torch.randn(64), torch.zeros(64, dtype=torch.bfloat16)  # a cast
    pairs = [(dst[e], sources[e]) for e in range(experts)] + [(norms_dst, norms_src)]
    program = CopyProgram(pairs, batch_below=1 << 20)
    assert program.counts.launches == 2  # one batch of same-dtype expert copies, one of the cast
    assert program.counts.batched == experts + 1 and program.counts.segments == experts + 1
    program.run()
    assert same_bytes(dst, src) and same_bytes(norms_dst, norms_src.to(torch.bfloat16))
    alone = CopyProgram(pairs, batch_below=1)
    assert alone.counts.launches == experts + 1 and alone.counts.batched == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_land_exactly_as_plain_copies(seed):
    """Random boxes of a source buffer (rows, row blocks at random strides, casts) into random places
    of a destination buffer: the program writes exactly what one ``copy_`` per pair writes."""
    rng = random.Random(seed)
    dtype = rng.choice([torch.bfloat16, torch.float32, torch.float16])
    rows, cols = rng.choice([(24, 16), (36, 8), (48, 12)])
    src = _random_bits((rows, cols), dtype, seed)
    cast = rng.random() < 0.3
    dst = torch.zeros(rows, cols, dtype=torch.float32 if cast and dtype != torch.float32 else dtype)
    # destination rows in blocks of `block`, a random permutation of source blocks, cut in columns too
    block = rng.choice([1, 2, 3, 4])
    order = list(range(rows // block))
    rng.shuffle(order)
    if rng.random() < 0.5:  # a strided source: group g's block at a constant distance, as fused qkv
        order = sorted(order)
    cut = rng.choice([cols, cols // 2])
    pairs = []
    for i, j in enumerate(order):
        for c in range(0, cols, cut):
            pairs.append((dst[i * block:(i + 1) * block, c:c + cut], src[j * block:(j + 1) * block, c:c + cut]))
    rng.shuffle(pairs)
    expected = _expected(dst, pairs, _same_view)
    program = CopyProgram(pairs, batch_below=rng.choice([1, 64, 1 << 20]))
    program.run()
    assert same_bytes(dst, expected)
    assert program.counts.segments == len(pairs) and program.counts.copies <= len(pairs)


def test_a_copy_between_different_shapes_is_refused():
    with pytest.raises(ValueError, match=r"a copy from shape \(4,\) into shape \(2, 2\)"):
        CopyProgram([(torch.zeros(2, 2), torch.zeros(4))])


def _qkv_pairs(dtype: torch.dtype, seed: int):
    """Megatron's ``linear_qkv`` (per query group ``[q; k; v]``) into vLLM's ``[Q; K; V]``, NaN payloads
    and all: three stacks of equal blocks at constant distances."""
    groups, q, kv, hidden = 4, 8, 2, 16
    qkv = _random_bits((groups, q + 2 * kv, hidden), dtype, seed)
    out = torch.zeros(groups * (q + 2 * kv), hidden, dtype=dtype)
    Q, K = groups * q, groups * kv
    pairs = []
    for g in range(groups):
        pairs += [(out[g * q:(g + 1) * q], qkv[g, :q]), (out[Q + g * kv:Q + (g + 1) * kv], qkv[g, q:q + kv]),
                  (out[Q + K + g * kv:Q + K + (g + 1) * kv], qkv[g, q + kv:])]
    return out, pairs


@pytest.mark.parametrize("strided", list(StridedCopy))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_every_strided_variant_moves_the_same_bits(strided, dtype):
    """Each :class:`StridedCopy` moves exactly the bytes of one plain ``copy_`` per pair (random bit
    patterns: NaNs with payloads, negative zeros), large strided copies included (``batch_below=1``)."""
    out, pairs = _qkv_pairs(dtype, seed=7)
    expected = _expected(out, pairs, _same_view)
    assert torch.isnan(expected.float()).any()  # the test data holds NaN bit patterns
    program = CopyProgram(pairs, batch_below=1, strided=strided, min_block_bytes=1)
    program.run()
    assert same_bytes(out, expected)
    assert program.counts.strided == 3 and program.counts.strided_bytes == out.numel() * dtype.itemsize
    launches = {StridedCopy.KERNEL: 3, StridedCopy.BLOCKS: 12, StridedCopy.FOREACH: 1, StridedCopy.MEMCPY2D: 3,
                StridedCopy.TRITON: 1}
    assert program.counts.launches == launches[strided]  # memcpy2d, triton: CUDA only (kernel, foreach on CPU)


@pytest.mark.parametrize("strided", [StridedCopy.BLOCKS, StridedCopy.FOREACH])
def test_blocks_below_the_minimum_stay_one_strided_copy(strided):
    out, pairs = _qkv_pairs(torch.bfloat16, seed=8)
    program = CopyProgram(pairs, batch_below=1, strided=strided, min_block_bytes=1 << 20)
    assert program.counts.launches == 3  # 256-byte blocks: not worth a launch (or a foreach entry) each
    program.run()
    assert same_bytes(out, _expected(torch.zeros_like(out), pairs, _same_view))


def test_blocks_split_a_copy_into_contiguous_pairs_or_refuse():
    src = torch.arange(4 * 6 * 8, dtype=torch.float32).view(4, 6, 8)
    dst = torch.zeros(4, 3, 8)
    split = blocks(dst, src[:, :3])
    assert split is not None and len(split) == 4
    assert all(d.is_contiguous() and s.is_contiguous() and d.shape == (3, 8) for d, s in split)
    assert blocks(dst, src[:, :3], min_bytes=3 * 8 * 4 + 1) is None  # 96-byte blocks: below the minimum
    assert blocks(torch.zeros(4, 6, 4), src[:, :, :4]) is not None  # rows of 16 bytes: split to rows
    assert blocks(torch.zeros(6), src[0, :, 0]) is None  # single elements at a stride: no contiguous block
    whole = torch.zeros(4, 6, 8)
    assert blocks(whole, src) == [(whole, src)]


def test_pitched_describes_a_stack_of_contiguous_blocks():
    src = torch.zeros(4, 6, 8, dtype=torch.bfloat16)
    dst = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    shape = pitched(dst, src[:, 4:])
    assert shape is not None
    assert (shape.width, shape.height, shape.dst_pitch, shape.src_pitch) == (32, 4, 32, 96)
    assert shape.src == src[0, 4].data_ptr() and shape.dst == dst.data_ptr()
    assert pitched(torch.zeros(4, 2, 4, dtype=torch.bfloat16), src[:, :2, :4]) is None  # blocks not contiguous
    assert pitched(dst, src[:, 4:].float()) is None  # a cast is not a memcpy


def test_pitched_refuses_pitches_beyond_what_a_2d_memcpy_takes():
    meta = torch.empty(0, dtype=torch.uint8, device="meta")  # views' geometry only: no memory
    src = meta.as_strided((2, 16), (16, 1))
    assert pitched(meta.as_strided((2, 16), (1 << 31, 1)), src) is None
    assert pitched(meta.as_strided((2, 16), (32, 1)), src) is not None


@pytest.mark.parametrize("into_buffer", [True, False], ids=["pack", "unpack"])
def test_staging_copies_move_a_round_of_many_blocks_in_few_launches_into_any_buffer(into_buffer):
    """A staged round of per-query-group ``k`` / ``v`` blocks (FP8 values and their fp32 scales, one
    segment each): planned once against a template buffer, then run against other buffers of the same
    layout, bit for bit as one copy per segment, in a few launches."""
    from refit_core.run.copies import StagingCopies

    groups, rows, cols = 8, 16, 64
    k = _random_bits((groups * rows, cols), torch.float8_e4m3fn, 1)
    v = _random_bits((groups * rows, cols), torch.float8_e4m3fn, 2)
    scales = _random_bits((groups, 4), torch.float32, 3)
    local, layout, offset = [], [], 0
    for g in range(groups):  # the message interleaves k_g, v_g, scales_g
        for tensor in (k[g * rows:(g + 1) * rows], v[g * rows:(g + 1) * rows], scales[g:g + 1]):
            local.append(tensor)
            layout.append((tensor.dtype, tuple(tensor.shape), offset))
            offset += tensor.numel() * tensor.element_size()

    def views_of(buffer):
        return [buffer[o:o + torch.Size(s).numel() * d.itemsize].view(d).view(s) for d, s, o in layout]

    template = torch.empty(offset, dtype=torch.uint8)
    copies = StagingCopies(local, views_of(template), into_buffer=into_buffer)
    assert copies.launches < len(local) // 4, copies.launches
    buffer = _random_bits((offset,), torch.uint8, 4)
    if into_buffer:
        copies.run(buffer)
        for view, staged in zip(local, views_of(buffer)):
            assert same_bytes(staged, view)
    else:
        expected = [s.clone() for s in views_of(buffer)]
        copies.run(buffer)
        for view, want in zip(local, expected):
            assert same_bytes(view, want)

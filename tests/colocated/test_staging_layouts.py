"""A bind plans staging copies from layouts (:meth:`StagingCopies.of_layouts`): the same copies, bit for bit,
as planned from views, for strided halves of fused stacks, casts and small contiguous blocks alike."""

from __future__ import annotations

import pytest
import torch

from refit_core.apps import same_bytes
from refit_core.run.copies import BufferView, StagingCopies
from refit_core.run.copy_merging import Strided
from refit_core.plan.items import align


def _bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    size = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def _round() -> tuple[list[torch.Tensor], list[BufferView], int]:
    """A round as a train rank packs it: ``gate_e`` / ``up_e`` halves of a fused ``[E, 2I, H]`` stack, expert by
    expert (strided source, equal blocks at constant distances), then a few small whole tensors; each
    segment contiguous in the buffer at an aligned offset."""
    experts, inter, hidden = 6, 4, 24
    fused = _bits((experts, 2 * inter, hidden), torch.bfloat16, 1)
    local = [half for e in range(experts) for half in (fused[e:e + 1, :inter], fused[e:e + 1, inter:])]
    local += [_bits((3, 5), torch.float32, 2), _bits((7,), torch.bfloat16, 3), _bits((40, 1024), torch.float32, 4)]
    staged, offset = [], 0
    for view in local:
        shape = tuple(view.shape)
        strides = torch.empty(shape, device="meta").stride()
        staged.append(BufferView(view.dtype, shape, strides, offset // view.element_size()))
        offset = align(offset + view.numel() * view.element_size())
    return local, staged, offset


@pytest.mark.parametrize("into_buffer", [True, False], ids=["pack", "unpack"])
@pytest.mark.parametrize("batch_below", [1 << 10, 8 << 20], ids=["large-alone", "all-batched"])
def test_copies_planned_from_layouts_move_the_bytes_of_copies_planned_from_views(into_buffer, batch_below):
    local, staged, nbytes = _round()
    template = torch.empty(nbytes, dtype=torch.uint8)
    from_views = StagingCopies(local, [s.on(template) for s in staged], into_buffer=into_buffer,
                               batch_below=batch_below)
    from_layouts = StagingCopies.of_layouts([Strided.of(v) for v in local], local,
                                            [Strided.of(s.on(template)) for s in staged], template,
                                            into_buffer=into_buffer, batch_below=batch_below)
    assert from_layouts.launches == from_views.launches < len(local)
    if into_buffer:
        buffers = [_bits((nbytes,), torch.uint8, 9) for _ in range(2)]
        from_views.run(buffers[0])
        from_layouts.run(buffers[1])
        assert same_bytes(buffers[0], buffers[1])
        for view, s in zip(local, staged):
            assert same_bytes(s.on(buffers[1]), view)
    else:
        buffer = _bits((nbytes,), torch.uint8, 9)
        expected = [s.on(buffer).clone() for s in staged]
        from_layouts.run(buffer)
        for view, want in zip(local, expected):
            assert same_bytes(view, want)

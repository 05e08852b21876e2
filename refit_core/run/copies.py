"""Many (destination view, source view) copies run as few copy kernels: the colocated receiver's step.

A colocated gen rank copies every segment straight from a view of the trainer's memory into a view
of the engine's memory; nothing is staged on either side. :class:`CopyProgram` resolves those copies
once, at bind time, into the fewest launches that move exactly the same bytes:

1. :func:`coalesce` merges copies that are neighbours in memory on both sides: into one flat copy
   (consecutive rows), along a dimension (an expert stack's ``[:, :I]`` gate and ``[:, I:]`` up
   halves: one ``[E, 2I, H]`` copy), and runs of equal-layout copies at constant distances into one
   strided copy with a new leading dimension (Megatron's per-query-group ``q``/``k``/``v`` blocks of
   ``linear_qkv`` into vLLM's ``[Q; K; V]``: one copy each per layer).
2. :func:`widen` moves a same-dtype copy as the same bytes in the widest integer words both views
   allow (a strided bf16 copy then moves 8 bytes per element instead of 2; integers copy bit for bit).
3. Copies of at least ``batch_below`` bytes run one by one, largest first: contiguous ones (a plain
   device memcpy) first, then strided ones, moved as :class:`StridedCopy` says (one strided kernel,
   one memcpy per block, the blocks in one multi-tensor copy, one 2-D memcpy, or all of them in one
   Triton launch); smaller ones run as one ``torch._foreach_copy_`` per dtype pair, contiguous and
   strided apart (a list of dense equal-stride pairs takes torch's single-kernel multi-tensor route
   on CUDA: a model's many small experts and norms cost a few launches, not thousands).

Casts (a destination dtype other than the source's) are copies too: ``copy_`` reads the source dtype
and writes the destination's, so they need no staging either.

This module is the face of four rooms: :mod:`~refit_core.run.copy_merging` (steps 1 and 2),
:mod:`~refit_core.run.strided_copies` (the ways a large strided copy moves), :mod:`~refit_core.run.copy_program`
(:class:`CopyProgram`, step 3) and :mod:`~refit_core.run.staging_copies` (the executor's pack and unpack).
"""

from refit_core.contract.options import StridedCopy
from refit_core.run.copy_merging import Pair, coalesce, widen
from refit_core.run.copy_program import BATCH_BELOW, CATEGORIES, CopyCounts, CopyProgram
from refit_core.run.staging_copies import BufferView, StagingCopies
from refit_core.run.strided_copies import MAX_PITCH, MIN_BLOCK_BYTES, Pitched, blocks, cuda_memcpy2d, pitched

__all__ = ["BATCH_BELOW", "CATEGORIES", "MAX_PITCH", "MIN_BLOCK_BYTES", "BufferView", "CopyCounts", "CopyProgram",
           "Pair", "Pitched", "StagingCopies", "StridedCopy", "blocks", "coalesce", "cuda_memcpy2d", "pitched", "widen"]

"""A large strided copy moved another way than one strided kernel: contiguous blocks, or one 2-D memcpy."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.run.copy_merging import Pair, view_nbytes


MIN_BLOCK_BYTES = 1 << 20
"""Blocks smaller than this stay inside one strided copy (``blocks`` / ``foreach`` variants)."""


def blocks(dst: torch.Tensor, src: torch.Tensor, min_bytes: int = 0) -> list[Pair] | None:
    """A copy split along its leading dimensions into pairs that are contiguous on both sides
    (exactly the same bytes), or None if that needs blocks smaller than ``min_bytes`` (or a split
    below the last dimension)."""
    if dst.is_contiguous() and src.is_contiguous():
        return [(dst, src)]
    if dst.dim() < 2 or dst.shape[0] == 0 or view_nbytes(dst[0]) < max(min_bytes, 1):
        return None
    out: list[Pair] = []
    for i in range(dst.shape[0]):
        part = blocks(dst[i], src[i], min_bytes)
        if part is None:
            return None
        out += part
    return out


MAX_PITCH = (1 << 31) - 1
"""The largest pitch ``cudaMemcpy2DAsync`` is sure to take (``cudaDevAttrMaxPitch`` on current GPUs);
wider stacks keep the strided kernel."""


@dataclass(frozen=True)
class Pitched:
    """A stacked copy as ``height`` contiguous blocks of ``width`` bytes, ``dst_pitch`` / ``src_pitch``
    bytes apart (the arguments of ``cudaMemcpy2DAsync``)."""

    dst: int
    src: int
    dst_pitch: int
    src_pitch: int
    width: int
    height: int


def pitched(dst: torch.Tensor, src: torch.Tensor) -> Pitched | None:
    """``(dst, src)`` as a :class:`Pitched` copy if both are ``[n, ...]`` stacks of contiguous blocks at
    positive distances (same dtype); else None."""
    if dst.dtype != src.dtype or dst.dim() < 2 or dst.shape[0] < 1:
        return None
    if not (dst[0].is_contiguous() and src[0].is_contiguous()):
        return None
    size = dst.element_size()
    width = view_nbytes(dst[0])
    dst_pitch, src_pitch = dst.stride(0) * size, src.stride(0) * size
    if dst.shape[0] > 1 and (dst_pitch < width or src_pitch < width):
        return None
    if max(dst_pitch, src_pitch, width) > MAX_PITCH:
        return None
    return Pitched(dst.data_ptr(), src.data_ptr(), max(dst_pitch, width), max(src_pitch, width), width,
                   dst.shape[0])


def memcpy2d_launch(shape: Pitched, device: torch.device) -> Callable[[], None]:
    copy = cuda_memcpy2d()

    def launch() -> None:
        stream = torch.cuda.current_stream(device).cuda_stream
        status = copy(shape.dst, shape.dst_pitch, shape.src, shape.src_pitch, shape.width, shape.height,
                      _DEVICE_TO_DEVICE, stream)
        if status:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {status} "
                               f"({shape.height} blocks of {shape.width} bytes)")
    return launch


_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


@functools.cache
def cuda_memcpy2d() -> Any:
    """``cudaMemcpy2DAsync`` of the CUDA runtime torch has loaded (found in this process's mappings, so
    the same runtime and context as torch's); RuntimeError naming what is missing."""
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if "libcudart" in os.path.basename(name):
                path = name
                break
    if path is None:
        raise RuntimeError("StridedCopy.MEMCPY2D needs the CUDA runtime library (libcudart) that torch "
                           "loads; none is loaded in this process")
    function = ctypes.CDLL(path).cudaMemcpy2DAsync
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return function

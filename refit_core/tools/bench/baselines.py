"""The two baselines of ``refit bench``: every HF tensor broadcast on its own, and NeMo-RL's packed broadcast.

Both are written generously: the name-to-memory mapping of every HF tensor is computed once at setup,
where real code walks names and loaders every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch

from refit_core.contract.spec import TensorSpec
from refit_core.tools.bench.hftensors import Parts, hf_tensors, materialize, scatter
from refit_core.tools.bench.method import Method, current_stream

PACKED_TARGET_BYTES = 1 << 30
PACKED_BUFFERS = 2


class PerTensor(Method):
    """Baseline A: broadcast every HF tensor on its own, then copy it into place."""

    name = "per-tensor"

    def setup(self) -> None:
        self.tensors = hf_tensors(self.ctx.model)
        self.info["tensors"] = len(self.tensors)

    def step(self, index: int) -> None:
        c = self.ctx
        stream = current_stream(c.device)
        for spec, parts in self.tensors:
            if c.is_train:
                c.comm.broadcast(materialize(spec, parts, c.device), 0, stream)
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=c.device)
                c.comm.broadcast(buffer, 0, stream)
                scatter(buffer, parts)


def _chunks(tensors: list[tuple[TensorSpec, Parts]], target: int) -> Iterator[list[tuple[TensorSpec, Parts]]]:
    """NeMo-RL's packing rule: add tensors until the buffer is *over* the target size."""
    chunk, size = [], 0
    for item in tensors:
        chunk.append(item)
        size += item[0].nbytes
        if size > target:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class Packed(Method):
    """Baseline B: HF tensors packed into ~1 GiB buffers, two in flight, broadcast, unpacked."""

    name = "packed"

    def setup(self) -> None:
        self.tensors = hf_tensors(self.ctx.model)
        self.chunks = list(_chunks(self.tensors, PACKED_TARGET_BYTES))
        dev = self.ctx.device
        self.streams = [torch.cuda.Stream(dev) if dev.type == "cuda" else None for _ in range(PACKED_BUFFERS)]
        self.info.update(tensors=len(self.tensors), buffers=len(self.chunks))

    def step(self, index: int) -> None:
        c = self.ctx
        keep: list[torch.Tensor | None] = [None] * PACKED_BUFFERS
        for i, chunk in enumerate(self.chunks):
            slot = i % PACKED_BUFFERS
            stream = self.streams[slot]
            if stream is not None:
                stream.synchronize()
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                if c.is_train:
                    flat = [materialize(spec, parts, c.device).reshape(-1).view(torch.uint8)
                            for spec, parts in chunk]
                    packed = torch.cat(flat)
                    c.comm.broadcast(packed, 0, stream)
                else:
                    packed = torch.empty(sum(spec.nbytes for spec, _ in chunk), dtype=torch.uint8, device=c.device)
                    c.comm.broadcast(packed, 0, stream)
                    offset = 0
                    for spec, parts in chunk:
                        full = packed[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)
                        offset += spec.nbytes
                        scatter(full, parts)
                keep[slot] = packed
        for stream in self.streams:
            if stream is not None:
                stream.synchronize()
        del keep


__all__ = ["PACKED_BUFFERS", "PACKED_TARGET_BYTES", "Packed", "PerTensor"]

"""The ping-pong baseline of today's colocated RL stacks: HF tensors packed through two shared buffers.

NeMo-RL ``stream_weights_via_ipc_zmq``, verl, slime: the trainer gathers HF tensors into two 1 GiB buffers
shared once through IPC (or larger, if one tensor needs it), alternately, synchronizes and signals; the
engine unpacks each into its layout (what ``load_weights`` does), synchronizes and acknowledges.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from refit_core.net.transport.memory import SharedStorage, export_storage, open_storage
from refit_core.tools.bench.colocated_sync import PairSync
from refit_core.tools.bench.copybound import sync_device
from refit_core.tools.bench.hftensors import hf_tensors, scatter

GiB = 1 << 30


def _buckets(tensors: list, buffer_bytes: int) -> list[list[tuple[int, int]]]:
    """HF tensors (by index) packed in order into buffers: ``[(tensor index, byte offset)]`` per fill."""
    buckets: list[list[tuple[int, int]]] = [[]]
    used = 0
    for i, (spec, _) in enumerate(tensors):
        size = (spec.nbytes + 255) // 256 * 256
        if buckets[-1] and used + size > buffer_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((i, used))
        used += size
    return buckets


class PingPong:
    """Two shared buffers; the trainer packs HF tensors, the engine unpacks them (both Python-driven)."""

    def __init__(self, model: Any, sync: PairSync, device: torch.device, train: bool, buffer_bytes: int = GiB) -> None:
        self.tensors = hf_tensors(model)
        largest = max(spec.nbytes for spec, _ in self.tensors)
        self.buffer_bytes = max(buffer_bytes, (largest + 255) // 256 * 256)
        self.buckets = _buckets(self.tensors, self.buffer_bytes)
        self.sync, self.device, self.train = sync, device, train
        self.step_index = 0
        if train:
            self.buffers = [torch.empty(self.buffer_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
            shared = [export_storage(b.untyped_storage()) for b in self.buffers]
            sync.signal("pingpong/buffers", json.dumps([s.__dict__ for s in shared]).encode())
        else:
            shared = [SharedStorage(**s) for s in json.loads(sync.take("pingpong/buffers").decode())]
            self._opened = [open_storage(s, device) for s in shared]
            self.buffers = [torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (self.buffer_bytes,), (1,))
                            for st in self._opened]

    @property
    def shared_bytes(self) -> int:
        return 2 * self.buffer_bytes

    def _view(self, buffer: torch.Tensor, index: int, offset: int) -> torch.Tensor:
        spec = self.tensors[index][0]
        return buffer[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)

    def step(self) -> None:
        step, self.step_index = self.step_index, self.step_index + 1
        for k, bucket in enumerate(self.buckets):
            buffer = self.buffers[k % 2]
            key = f"pingpong/{step}/{k}"
            if self.train:
                if k >= 2:
                    self.sync.take(f"{key}/ack-{k - 2}")
                for index, offset in bucket:
                    spec, parts = self.tensors[index]
                    out = self._view(buffer, index, offset)
                    for box, view in parts:
                        box.slice_of(out).copy_(view)
                sync_device(self.device)
                self.sync.signal(key)
            else:
                self.sync.take(key)
                for index, offset in bucket:
                    scatter(self._view(buffer, index, offset), self.tensors[index][1])
                sync_device(self.device)
                if k + 2 < len(self.buckets):
                    self.sync.signal(f"pingpong/{step}/{k + 2}/ack-{k}")
        if self.train:
            self.sync.take(f"pingpong/{step}/done")
        else:
            self.sync.signal(f"pingpong/{step}/done")


__all__ = ["PingPong"]

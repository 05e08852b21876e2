"""The executor: runs this rank's part of the schedule every step.

Per round, the sender packs its segments (casting to the wire dtype) into a contiguous staging
buffer with one batched copy, then posts the round's sends as one grouped exchange; the receiver
posts its receives, then unpacks with one batched copy. With ``num_buffers`` staging buffers the
packing of round k+1 overlaps the transfer of round k (and unpacking of k-1) on CUDA, and staging
memory never exceeds ``num_buffers x bucket_bytes``. Buffers live for one step only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import TransferError
from .lanes import Lane, lane_for
from .schedule import Message, Segment
from .spec import dtype_size
from .transport import Fence, Transport

MAGIC = 0x52454649  # "REFI"
HEADER_WORDS = 4


@dataclass
class StepStats:
    """What one step moved and how long it took on this rank."""

    version: int
    bytes: int
    seconds: float
    staging_bytes: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def _layout(msgs: list[Message]) -> tuple[list[int], int]:
    """Byte offsets of a round's messages in its staging buffer (16-byte aligned), and its size."""
    bases, used = [], 0
    for m in msgs:
        bases.append(used)
        used = _align(used + m.nbytes)
    return bases, used


def _buffer_views(buffer: torch.Tensor, segments: Sequence[tuple[Segment, int]]) -> list[torch.Tensor]:
    """Typed, shaped views of ``buffer`` for ``(segment, message base)`` pairs."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for seg, base in segments:
        flat = typed.get(seg.dtype)
        if flat is None:
            flat = typed[seg.dtype] = buffer.view(seg.dtype)
        size = dtype_size(seg.dtype)
        sizes = seg.box.sizes
        strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * sizes[d + 1]
        views.append(flat.as_strided(sizes, strides, (base + seg.offset) // size))
    return views


class _RoundRunner:
    """State shared by both directions: rounds, peers, buffers, header checks."""

    def __init__(self, rounds: list[list[Message]], transport: Transport, peer_offset: int, *,
                 own_offset: int, bucket_bytes: int, num_buffers: int, fingerprint: str,
                 timeout_s: float) -> None:
        self.rounds = rounds
        self.transport = transport
        self.device = transport.device
        self.peer_offset = peer_offset
        self.own_offset = own_offset
        self.num_buffers = max(1, num_buffers)
        self.timeout_s = timeout_s
        self.fingerprint = int(fingerprint[:15], 16)
        layouts = [_layout(msgs) for msgs in rounds]
        self.bases = [bases for bases, _ in layouts]
        self.payload_bytes = sum(m.nbytes for msgs in rounds for m in msgs)
        self.buffer_bytes = max((size for _, size in layouts), default=0)
        if self.buffer_bytes > bucket_bytes:
            raise TransferError(f"refit bug: a round needs {self.buffer_bytes} staging bytes "
                                f"but the bucket is {bucket_bytes}")
        self.lane: Lane = lane_for(self.device, "refit copies")
        self.step = 0

    def peers(self) -> list[int]:
        return sorted({self._peer(m) for msgs in self.rounds for m in msgs})

    def _peer(self, m: Message) -> int:
        raise NotImplementedError

    def _exchange_headers(self, version: int) -> int:
        """Both sides send ``[magic, fingerprint, version, step]`` to each peer and check theirs."""
        peers = self.peers()
        if not peers:
            return version
        mine = torch.tensor([MAGIC, self.fingerprint, version, self.step], dtype=torch.int64, device=self.device)
        theirs = {p: torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device) for p in peers}
        fence = self.transport.exchange([(p + self.peer_offset, mine) for p in peers],
                                        [(p + self.peer_offset, t) for p, t in theirs.items()])
        fence.synchronize(self.timeout_s)
        versions = set()
        for peer, header in theirs.items():
            magic, fp, peer_version, step = header.tolist()
            if magic != MAGIC or fp != self.fingerprint or step != self.step:
                raise TransferError(
                    f"peer rank {peer + self.peer_offset} runs a different refit plan or step "
                    f"(fingerprint {fp:x} step {step} vs ours {self.fingerprint:x} step {self.step}); "
                    "both sides must call setup() with the same models and options")
            versions.add(peer_version)
        return versions.pop() if len(versions) == 1 else version

    def _finish(self, fences: list[Fence]) -> None:
        for fence in fences:
            fence.synchronize(self.timeout_s)


class SendExecutor(_RoundRunner):
    """Runs a train rank's rounds: pack, send."""

    def bind(self, views: list[torch.Tensor]) -> None:
        """Precompute the source slices of every segment (views of the model's parameters)."""
        self.sources = [[seg.box.slice_of(views[seg.piece]) for m in msgs for seg in m.src_segments]
                        for msgs in self.rounds]

    def _peer(self, m: Message) -> int:
        return m.dst

    def run(self, version: int) -> StepStats:
        start = time.perf_counter()
        self._exchange_headers(version)
        buffers = [self.lane.allocate(self.buffer_bytes, self.device)
                   for _ in range(min(self.num_buffers, len(self.rounds)))]
        free: list[Fence | None] = [None] * len(buffers)
        for index, msgs in enumerate(self.rounds):
            slot = index % len(buffers)
            buffer = buffers[slot]
            bases = self.bases[index]
            targets = _buffer_views(buffer, [(s, b) for m, b in zip(msgs, bases) for s in m.src_segments])
            sources = self.sources[index]
            packed = self.lane.run(lambda t=targets, s=sources: torch._foreach_copy_(t, s),
                                   after=[f for f in (free[slot],) if f is not None])
            sends = [(m.dst + self.peer_offset, buffer[b:b + m.nbytes]) for m, b in zip(msgs, bases)]
            free[slot] = self.transport.exchange(sends, [], after=[packed])
        self._finish([f for f in free if f is not None])
        staging = len(buffers) * self.buffer_bytes
        del buffers
        self.step += 1
        return StepStats(version, self.payload_bytes, time.perf_counter() - start, staging)


class ReceiveExecutor(_RoundRunner):
    """Runs a gen rank's rounds: receive, unpack into destination views."""

    def bind(self, views: list[torch.Tensor]) -> None:
        self.targets = [[seg.box.slice_of(views[seg.piece]) for m in msgs for seg in m.dst_segments]
                        for msgs in self.rounds]

    def _peer(self, m: Message) -> int:
        return m.src

    def run(self, version_hint: int = -1) -> StepStats:
        start = time.perf_counter()
        version = self._exchange_headers(version_hint)
        buffers = [self.lane.allocate(self.buffer_bytes, self.device)
                   for _ in range(min(self.num_buffers, len(self.rounds)))]
        free: list[Fence | None] = [None] * len(buffers)
        for index, msgs in enumerate(self.rounds):
            slot = index % len(buffers)
            buffer = buffers[slot]
            bases = self.bases[index]
            recvs = [(m.src + self.peer_offset, buffer[b:b + m.nbytes]) for m, b in zip(msgs, bases)]
            received = self.transport.exchange([], recvs, after=[f for f in (free[slot],) if f is not None])
            sources = _buffer_views(buffer, [(s, b) for m, b in zip(msgs, bases) for s in m.dst_segments])
            targets = self.targets[index]
            free[slot] = self.lane.run(lambda t=targets, s=sources: torch._foreach_copy_(t, s), after=[received])
        self._finish([f for f in free if f is not None])
        staging = len(buffers) * self.buffer_bytes
        del buffers
        self.step += 1
        return StepStats(version, self.payload_bytes, time.perf_counter() - start, staging)

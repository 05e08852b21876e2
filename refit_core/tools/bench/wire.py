"""The wire, the bound every bench method is measured against: one p2p of contiguous bytes per pair.

Also the checksum that checks what it moved (the wire moves the trainer's bytes in its own layout, so
no value check applies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from refit_core.tools.bench.comms import open_bench_comm
from refit_core.tools.bench.copybound import CopyBound
from refit_core.tools.bench.method import Method, current_stream


def checksum(data: torch.Tensor) -> int:
    """A position-weighted sum of the bytes' 32-bit words, 256 MiB at a time (no big temporaries)."""
    words = data[:data.numel() // 4 * 4].view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for i, chunk in enumerate(words.split(64 << 20)):
        total += chunk.sum(dtype=torch.int64) * (i + 1)
    return int(total.item())


def payload(device: torch.device, is_sender: bool, sizes: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer for a baseline's lanes of ``sizes`` bytes, and each lane's view of it: a sender sends random
    bytes, every lane a prefix of one buffer of the largest size; a receiver lands each lane in its own slice
    of one zeroed buffer."""
    buffer = torch.empty(max(sizes, default=0) if is_sender else sum(sizes), dtype=torch.uint8, device=device)
    if is_sender:
        return buffer.random_(0, 256), [buffer[:n] for n in sizes]
    buffer.zero_()
    views, offset = [], 0
    for n in sizes:
        views.append(buffer[offset:offset + n])
        offset += n
    return buffer, views


def verify_checksums(store: Any, is_sender: bool, lanes: Sequence[tuple[torch.Tensor, str]],
                     checksum: Callable[[torch.Tensor], int]) -> str | None:
    """A sender publishes each lane's checksum under its key; a receiver compares its own bytes' (None on a
    sender)."""
    if is_sender:
        for data, key in lanes:
            store.set(key, str(checksum(data)))
        return None
    bad = [key for data, key in lanes if int(store.get(key).decode()) != checksum(data)]
    return "checksum ok" if not bad else f"CHECKSUM MISMATCH ({', '.join(bad)})"


class Wire(Method):
    """The bound: the bytes refit moves, over the same (train rank, gen rank) pairs, all pairs at once,
    each pair one p2p of one contiguous buffer (``wire@ops=N``: cut into N operations of one NCCL
    group). A one-to-one run moves the model's bytes over its pair; a multi-rank run the
    :class:`~refit_core.tools.bench.wireplan.WirePlan` of refit's schedule (``ctx.wire_plan``). A
    sender keeps one buffer (its largest pair's bytes), a receiver one region per pair; pairs on one
    device (NCCL cannot pair a device with itself) are left out and named in ``info``."""

    name = "wire"
    ops = 1
    checked_by_checksum = True

    buffer: torch.Tensor | None = None

    def setup(self) -> None:
        c = self.ctx
        plan = c.wire_plan()
        rank_of = c.extra.get("devices", {})
        self.lanes: list[tuple[Any, torch.Tensor, Any, str]] = []  # (comm, tensor, stream, checksum key)
        mine = [p for p in plan.of_rank(c.rank)
                if c.device.type != "cuda" or rank_of.get(p.src) != rank_of.get(p.dst)]
        skipped = [p for p in plan.pairs
                   if c.device.type == "cuda" and rank_of.get(p.src) == rank_of.get(p.dst)]
        self.buffer, views = payload(c.device, c.is_train, [p.nbytes for p in mine])
        for p, view in zip(mine, views):
            comm = c.comm if c.comm is not None and len(plan.pairs) == 1 else \
                open_bench_comm(c.store, f"{self.name}/{p.src}-{p.dst}", 2, 0 if c.is_train else 1, c.device)
            stream = torch.cuda.Stream(c.device) if c.device.type == "cuda" and len(mine) > 1 else None
            self.lanes.append((comm, view, stream, f"{self.name}/checksum/{p.src}-{p.dst}"))  # one key per method
        self.info["wire_bytes"] = plan.nbytes - sum(p.nbytes for p in skipped)
        self.info["wire_pairs"] = len(plan.pairs) - len(skipped)
        if skipped:
            self.info["wire_skipped_pairs"] = [(p.src, p.dst) for p in skipped]

    def close(self) -> None:
        for comm, _, _, _ in self.lanes:
            if comm is not self.ctx.comm:
                comm.close()
        self.lanes = []
        self.buffer = None
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()

    def step(self, index: int) -> None:
        c = self.ctx
        current = current_stream(c.device)
        for comm, data, stream, _ in self.lanes:
            if stream is not None:
                stream.wait_stream(current)
            parts = list(data.tensor_split(self.ops)) if self.ops > 1 else [data]
            if c.is_train:
                comm.post([(1, p) for p in parts], [], stream or current)
            else:
                comm.post([], [(0, p) for p in parts], stream or current)
        for _, _, stream, _ in self.lanes:
            if stream is not None:
                current.wait_stream(stream)

    def verify(self, checksum: Callable[[torch.Tensor], int]) -> str | None:
        """Senders publish each pair's checksum; receivers compare theirs (None on a sender)."""
        return verify_checksums(self.ctx.store, self.ctx.is_train, [(data, key) for _, data, _, key in self.lanes],
                                checksum)


class WireThenCopy(Wire):
    """``wire@copy``, the bound of staged mode (``refit@mode=staged``): the wire, then on each receiver a
    device copy of every byte it received (:class:`~refit_core.tools.bench.copybound.CopyBound`, through two
    buffers of at most 1 GiB), as a staged commit copies the landed step into the engine's weights."""

    name = "wire@copy"
    CHUNK = 1 << 30

    bound: CopyBound | None = None

    def setup(self) -> None:
        super().setup()
        if not self.ctx.is_train and self.buffer is not None:
            self.bound = CopyBound(self.buffer.numel(), self.ctx.device, self.CHUNK)

    def step(self, index: int) -> None:
        super().step(index)
        if self.bound is not None:
            self.bound.copy()

    def close(self) -> None:
        self.bound = None
        super().close()


__all__ = ["Wire", "WireThenCopy", "checksum", "verify_checksums"]

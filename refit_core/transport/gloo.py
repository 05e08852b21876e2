"""The CPU transport: a private gloo process group built from the refit's own store."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import TransferError
from .base import Fence, Transport, _check_contiguous


class _WorkFence(Fence):
    def __init__(self, works: list[dist.Work], peers: list[int]) -> None:
        self._works = works
        self._peers = peers

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.synchronize(timeout_s=0)

    def synchronize(self, timeout_s: float) -> None:
        try:
            for work in self._works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses on peer loss
            raise TransferError(f"gloo exchange with ranks {sorted(set(self._peers))} failed "
                                f"(a peer died or timed out): {exc}") from exc
        self._works = []


class GlooTransport(Transport):
    """Point-to-point over gloo; never the process's default group (trainers and engines own theirs)."""

    name = "gloo"

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
        self.device = torch.device("cpu")
        self.rank = rank
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size,
                                         timedelta(seconds=timeout_s))

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = ()) -> Fence:
        _check_contiguous(sends)
        _check_contiguous(recvs)
        for fence in after:
            fence.wait()
        works = [self._pg.recv([t], peer, 0) for peer, t in recvs]
        works += [self._pg.send([t], peer, 0) for peer, t in sends]
        return _WorkFence(works, [p for p, _ in (*sends, *recvs)])

    def close(self) -> None:
        self._pg = None

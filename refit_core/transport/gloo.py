"""The CPU transport: a private gloo process group built from the refit's own store."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import TransferError
from ..options import TransportKind
from .base import Fence, Transport, check_contiguous


def _failure(peers: Sequence[int], rank: int, exc: BaseException) -> TransferError:
    return TransferError(f"gloo exchange between rank {rank} and rank(s) {sorted(set(peers))} failed "
                         f"(a peer died or timed out): {exc}")


class _WorkFence(Fence):
    def __init__(self, works: list[dist.Work], peers: list[int], rank: int) -> None:
        self._works = works
        self._peers = peers
        self._rank = rank

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.synchronize(timeout_s=0)

    def synchronize(self, timeout_s: float) -> None:
        try:
            for work in self._works:
                work.wait()
        except Exception as exc:  # gloo raises RuntimeError subclasses on peer loss
            raise _failure(self._peers, self._rank, exc) from exc
        self._works = []


class GlooTransport(Transport):
    """Point-to-point over gloo; never the process's default group (trainers and engines own theirs)."""

    kind = TransportKind.GLOO

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
        self.device = torch.device("cpu")
        self.rank = rank
        self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo/", store), rank, world_size, timedelta(seconds=timeout_s))

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = ()) -> Fence:
        check_contiguous(sends)
        check_contiguous(recvs)
        for fence in after:
            fence.wait()
        peers = [p for p, _ in (*sends, *recvs)]
        if self._pg is None:
            raise TransferError(f"the gloo transport of rank {self.rank} is closed")
        try:  # posting can fail too: gloo reports a peer that already closed its connection here
            works = [self._pg.recv([t], peer, 0) for peer, t in recvs]
            works += [self._pg.send([t], peer, 0) for peer, t in sends]
        except Exception as exc:  # every transport failure is a TransferError
            raise _failure(peers, self.rank, exc) from exc
        return _WorkFence(works, peers, self.rank)

    def close(self) -> None:
        self._pg = None

"""The CPU transport: a private gloo process group built from the refit's own store."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.errors import TransferError
from refit_core.contract.options import TransportKind
from refit_core.net.transport.base import Fence, Transport, check_contiguous


def _failure(rank: int, peer: int, what: str, exc: BaseException) -> TransferError:
    text = str(exc)
    cause = ("timed out: a peer is stopped, hung or much slower" if "imed out" in text
             else "a peer died or closed its connection")
    return TransferError(f"gloo {what} between rank {rank} and rank {peer} failed "
                         f"({cause}): {text.splitlines()[0] if text else type(exc).__name__}")


class _WorkFence(Fence):
    """Completion of the posted operations, each with the peer it talks to."""

    def __init__(self, works: list[tuple[int, dist.Work]], rank: int) -> None:
        self._works = works
        self._rank = rank

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.synchronize(timeout_s=0)

    def synchronize(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` (0: the process group's own timeout). A peer that exited or was
        killed is noticed as soon as its connection closes."""
        limit = timedelta(seconds=timeout_s) if timeout_s > 0 else timedelta(0)
        while self._works:
            peer, work = self._works[0]
            try:
                work.wait(limit)
            except Exception as exc:  # gloo raises RuntimeError subclasses on peer loss
                raise _failure(self._rank, peer, "exchange", exc) from exc
            self._works.pop(0)


class GlooTransport(Transport):
    """Point-to-point over gloo; never the process's default group (trainers and engines own theirs)."""

    kind = TransportKind.GLOO

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
        self.device = torch.device("cpu")
        self.rank = rank
        self._pg: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo/", store), rank, world_size, timedelta(seconds=timeout_s))

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = ()) -> Fence:
        check_contiguous(sends)
        check_contiguous(recvs)
        for fence in after:
            fence.wait()
        pg = self._pg
        if pg is None:
            raise TransferError(f"the gloo transport of rank {self.rank} is closed")
        works: list[tuple[int, dist.Work]] = []
        for peer, tensor in recvs:
            works.append((peer, self._post(pg.recv, tensor, peer)))
        for peer, tensor in sends:
            works.append((peer, self._post(pg.send, tensor, peer)))
        return _WorkFence(works, self.rank)

    def _post(self, operation: Callable[[list[torch.Tensor], int, int], dist.Work], tensor: torch.Tensor,
              peer: int) -> dist.Work:
        try:  # posting fails too: gloo reports a peer that already closed its connection here
            return operation([tensor], peer, 0)
        except Exception as exc:  # every transport failure is a TransferError
            raise _failure(self.rank, peer, "post", exc) from exc

    def close(self) -> None:
        """Drop the process group (and its connections); safe after a failed or timed-out step."""
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - already broken: dropping it is all that is left
                pass

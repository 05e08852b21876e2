"""The communicator between two benchmark ranks: NCCL on CUDA, a gloo stand-in on CPU."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class GlooComm:
    """The CPU stand-in for :class:`~refit_core.net.transport.nccl.NcclComm` (benchmark smoke runs)."""

    backend = "gloo"

    def __init__(self, store: dist.Store, key: str, nranks: int, rank: int, device: torch.device,
                 timeout_s: float = 300.0) -> None:
        self.pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/", store), rank, nranks,
                                             timedelta(seconds=timeout_s))

    def post(self, sends, recvs, stream=None) -> None:
        works = [self.pg.recv([t], p, 0) for p, t in recvs] + [self.pg.send([t], p, 0) for p, t in sends]
        for work in works:
            work.wait()

    def broadcast(self, tensor: torch.Tensor, root: int, stream=None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        self.pg = None


def open_bench_comm(store: dist.Store, key: str, nranks: int, rank: int, device: torch.device) -> Any:
    """An NCCL communicator between the two benchmark ranks on CUDA, a gloo stand-in on CPU."""
    if device.type == "cuda":
        from refit_core.net.transport.nccl import open_comm
        return open_comm(store, key, nranks, rank, device)
    return GlooComm(store, key, nranks, rank, device)


__all__ = ["GlooComm", "open_bench_comm"]

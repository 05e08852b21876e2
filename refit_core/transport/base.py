"""The transport interface: post a grouped set of sends and receives, get a fence back.

Ranks are global within one refit: train ranks ``0..S-1``, gen ranks ``S..S+D-1``. A transport
only ever receives contiguous tensors (refit packs everything into contiguous buffers first).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..errors import RefitError


class Fence(ABC):
    """Completion of posted work (an exchange, or a batch of copies)."""

    @abstractmethod
    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` wait for the work (CUDA), or block the host until it is done (CPU)."""

    @abstractmethod
    def synchronize(self, timeout_s: float) -> None:
        """Block the host until done; raise :class:`~refit_core.errors.TransferError` on timeout."""


class DoneFence(Fence):
    """Work that is already complete."""

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        pass

    def synchronize(self, timeout_s: float) -> None:
        pass


class Transport(ABC):
    """Grouped point-to-point exchange among the ranks of one refit."""

    name: str
    device: torch.device

    @abstractmethod
    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = ()) -> Fence:
        """Post all ``(peer, tensor)`` sends and receives at once, once ``after`` completed."""

    @abstractmethod
    def close(self) -> None:
        """Release the communicator."""


def _check_contiguous(pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
    for peer, tensor in pairs:
        if not tensor.is_contiguous():
            raise RefitError(f"refit bug: non-contiguous buffer for peer {peer} handed to a collective")


def open_transport(kind: str, store: torch.distributed.Store, rank: int, world_size: int,
                   device: torch.device, timeout_s: float) -> Transport:
    """Create the transport ``kind`` (``auto``, ``gloo`` or ``nccl``) from the refit's store."""
    if kind == "auto":
        kind = "nccl" if device.type == "cuda" else "gloo"
    if kind == "gloo":
        from .gloo import GlooTransport
        return GlooTransport(store, rank, world_size, timeout_s)
    if kind == "nccl":
        from .nccl import NcclTransport
        return NcclTransport(store, rank, world_size, device, timeout_s)
    raise RefitError(f"unknown transport {kind!r}: use 'auto', 'gloo' or 'nccl'")

"""Open the transport a refit's options name: gloo or NCCL, imported only when chosen."""

from __future__ import annotations

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.options import NcclOptions, TransportKind
from refit_core.net.transport.base import Transport


def resolve_kind(kind: TransportKind, device: torch.device) -> TransportKind:
    """``auto`` becomes NCCL for a rank on CUDA, gloo otherwise."""
    if kind == TransportKind.AUTO:
        return TransportKind.NCCL if device.type == "cuda" else TransportKind.GLOO
    return kind


def open_transport(kind: TransportKind, store: torch.distributed.Store, rank: int, world_size: int,
                   device: torch.device, timeout_s: float, nccl: NcclOptions | None = None) -> Transport:
    """Create the transport ``kind`` from the refit's store; collective over all ranks of the refit."""
    kind = resolve_kind(TransportKind(kind), device)
    if kind == TransportKind.GLOO:
        from refit_core.net.transport.gloo import GlooTransport
        return GlooTransport(store, rank, world_size, timeout_s)
    if kind == TransportKind.NCCL:
        from refit_core.net.transport.nccl import NcclTransport
        return NcclTransport(store, rank, world_size, device, timeout_s, nccl or NcclOptions())
    raise RefitError(f"unknown transport {kind!r}: use one of {', '.join(k.value for k in TransportKind)}")


__all__ = ["open_transport", "resolve_kind"]

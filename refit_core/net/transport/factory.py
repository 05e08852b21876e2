"""Open the transport a refit's options name: gloo or NCCL, imported only when chosen."""

from __future__ import annotations

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.options import NcclOptions, TransportKind
from refit_core.net.transport.base import Transport
from refit_core.net.transport.watch import PeerWatch


def resolve_kind(kind: TransportKind, device: torch.device) -> TransportKind:
    """``auto`` becomes NCCL for a rank on CUDA, gloo otherwise."""
    if kind == TransportKind.AUTO:
        return TransportKind.NCCL if device.type == "cuda" else TransportKind.GLOO
    return kind


def open_transport(kind: TransportKind, store: torch.distributed.Store, rank: int, world_size: int,
                   device: torch.device, timeout_s: float, nccl: NcclOptions | None = None, *,
                   watch: PeerWatch | None = None, rendezvous: str | None = None) -> Transport:
    """Create the transport ``kind`` from the refit's store; collective over all ranks of the refit.

    ``watch`` (None: none) tells a slow wait that a peer is gone or gave up
    (:mod:`refit_core.net.transport.watch`); gloo listens on the interface that reaches the
    ``rendezvous`` address (``host:port``; None: on gloo's default, the hostname's).
    """
    kind = resolve_kind(TransportKind(kind), device)
    if kind == TransportKind.GLOO:
        from refit_core.net.transport.gloo import GlooTransport, interface_toward
        host, _, port = (rendezvous or "").rpartition(":")
        interface = interface_toward(host.strip("[]"), int(port)) if rendezvous else None
        return GlooTransport(store, rank, world_size, timeout_s, watch, interface)
    if kind == TransportKind.NCCL:
        from refit_core.net.transport.nccl import NcclTransport
        return NcclTransport(store, rank, world_size, device, timeout_s, nccl or NcclOptions(), watch)
    raise RefitError(f"unknown transport {kind!r}: use one of {', '.join(k.value for k in TransportKind)}")


__all__ = ["open_transport", "resolve_kind"]

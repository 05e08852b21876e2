"""Transports: grouped point-to-point exchange between all train and gen ranks of one refit."""

from refit_core.net.transport.base import (
    DoneFence,
    Fence,
    SpanRecorder,
    Transport,
    TransportCounters,
    check_contiguous,
)
from refit_core.net.transport.kind import TransportContext, TransportType
from refit_core.net.transport.registry import (
    open_transport,
    register_transport,
    resolve_kind,
    transport_names,
    transport_type,
)
from refit_core.net.transport.watch import PeerWatch, StoreWatch

__all__ = ["DoneFence", "Fence", "PeerWatch", "SpanRecorder", "StoreWatch", "Transport", "TransportContext",
           "TransportCounters", "TransportType", "check_contiguous", "open_transport", "register_transport",
           "resolve_kind", "transport_names", "transport_type"]

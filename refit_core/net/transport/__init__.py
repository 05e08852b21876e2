"""Transports: grouped point-to-point exchange between all train and gen ranks of one refit."""

from refit_core.net.transport.base import DoneFence, Fence, SpanRecorder, Transport, check_contiguous
from refit_core.net.transport.factory import open_transport, resolve_kind
from refit_core.net.transport.watch import PeerWatch, StoreWatch

__all__ = ["DoneFence", "Fence", "PeerWatch", "SpanRecorder", "StoreWatch", "Transport", "check_contiguous",
           "open_transport", "resolve_kind"]

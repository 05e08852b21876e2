"""Transports: grouped point-to-point exchange between all train and gen ranks of one refit."""

from .base import DoneFence, Fence, Transport, check_contiguous, open_transport, resolve_kind
from .placement import refuse_shared_gpus

__all__ = ["DoneFence", "Fence", "Transport", "check_contiguous", "open_transport", "refuse_shared_gpus",
           "resolve_kind"]

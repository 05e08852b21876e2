"""Transports: grouped point-to-point exchange between all train and gen ranks of one refit."""

from .base import Fence, Transport, open_transport

__all__ = ["Fence", "Transport", "open_transport"]

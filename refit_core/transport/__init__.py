"""Transports: grouped point-to-point exchange between all train and gen ranks of one refit."""

from .base import DoneFence, Fence, Transport, check_contiguous, open_transport, resolve_kind
from .placement import Link, Placement, choose_link, pair_links, placement_of

__all__ = ["DoneFence", "Fence", "Link", "Placement", "Transport", "check_contiguous", "choose_link",
           "open_transport", "pair_links", "placement_of", "resolve_kind"]

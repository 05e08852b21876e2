"""The shape every timed ``refit bench`` method has: ``setup()`` untimed, ``step(i)`` timed, ``close()``."""

from __future__ import annotations

from typing import Any

import torch


class Method:
    """One way of moving the weights, run on every rank in lockstep (``ctx``: the rank's context);
    ``info`` is what it reports beside its times."""

    name = ""
    checked_by_checksum = False
    """True for a method that moves raw bytes (the wire, the broadcast): checked by ``verify(checksum)``,
    not by the engine's values."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.info: dict[str, Any] = {}

    def setup(self) -> None:
        """Untimed preparation (buffers, communicators, plans)."""

    def step(self, index: int) -> None:
        """Move the weights once (step ``index``); timed."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what :meth:`setup` made."""


def current_stream(device: torch.device) -> Any:
    """``device``'s current CUDA stream (None on CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


__all__ = ["Method", "current_stream"]

"""The NCCL transport's own settings (:class:`NcclOptions`), owned by that transport and carried in
``RefitOptions.nccl``: both sides must agree on them (they build the communicators together).

They live in the contract, beside :class:`~refit_core.contract.options.RefitOptions` which holds them as a
typed field, and are the options class the nccl transport registers with
(:mod:`refit_core.net.transport.nccl`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from refit_core.contract.errors import OptionError
from refit_core.contract.settings import _setting, _tracks_explicit
from refit_core.contract.transport_options import TransportOptions


class NcclBackend(StrEnum):
    """Which NCCL binding the nccl transport uses."""

    AUTO = "auto"
    """nccl4py where it imports, torch's ProcessGroupNCCL otherwise."""
    NCCL4PY = "nccl4py"
    TORCH = "torch"


@_tracks_explicit
@dataclass(frozen=True)
class NcclOptions(TransportOptions):
    """The nccl transport's communicators; both sides must agree (they build them together).

    - ``backend``: :class:`NcclBackend` (``auto``: nccl4py, else torch's ProcessGroupNCCL).
    - ``comms_per_link``: NCCL communicators per pair of ranks, each on its own stream; consecutive
      operations to a peer alternate between them, so one's fill and drain hide behind the next.
    - ``max_ctas``: NCCL's ``maxCTAs`` for each of them (0: NCCL's own, 32): the thread blocks one
      operation may use, which also bound the buffers a communicator keeps on the GPU.

    None (the default of both) takes :data:`DEFAULT_CHOICE` (:meth:`choice`). More communicators hide more
    of NCCL's per-operation cost, and each keeps buffers outside torch's allocator for every peer it has
    moved bytes with (about 0.25 / 0.5 GiB, sender / receiver, with one peer at NCCL's own size;
    ``max_ctas=16`` halves that for about 1% of the wire). The measurements behind the choice, plain and
    FP8 plans alike: docs/benchmarks.md (2 x H200, one peer, 2026-11-26 and 2026-11-27). Several ranks per
    GPU under MPS, each exchanging with two peers at once: 4 deadlocked, 2 ran at the wire (2026-11-27).
    """

    kind: ClassVar[str] = "nccl"

    backend: NcclBackend = _setting(NcclBackend.AUTO, NcclBackend)
    comms_per_link: int | None = _setting(None, int)
    max_ctas: int | None = _setting(None, int)

    def __post_init__(self) -> None:
        self._coerce()
        if self.comms_per_link is not None and self.comms_per_link < 1:
            raise OptionError(f"NcclOptions.comms_per_link={self.comms_per_link}: must be >= 1")
        if self.max_ctas is not None and not 0 <= self.max_ctas <= 32:
            raise OptionError(f"NcclOptions.max_ctas={self.max_ctas}: must be 0 (NCCL's default) to 32")

    def choice(self) -> NcclChoice:
        """The communicators to build: these settings, each None taken from :data:`DEFAULT_CHOICE`."""
        return NcclChoice(DEFAULT_CHOICE.comms_per_link if self.comms_per_link is None else self.comms_per_link,
                          DEFAULT_CHOICE.max_ctas if self.max_ctas is None else self.max_ctas)


@dataclass(frozen=True)
class NcclChoice:
    """The communicators a refit builds: :class:`NcclOptions` with every None filled in."""

    comms_per_link: int
    max_ctas: int
    """0: NCCL's own."""


DEFAULT_CHOICE = NcclChoice(comms_per_link=4, max_ctas=0)
"""What :class:`NcclOptions` leaves open gets these (plans whose senders quantize included: with their messages
cut to a quarter of the bucket, 4 beat 2 on both FP8 shapes, docs/benchmarks.md)."""


__all__ = ["DEFAULT_CHOICE", "NcclBackend", "NcclChoice", "NcclOptions"]

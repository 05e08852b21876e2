"""What a transport registers (:class:`TransportType`) and what it is opened with (:class:`TransportContext`).

A transport kind is one frozen record: its name, its options class (a
:class:`~refit_core.contract.transport_options.TransportOptions`, owned by the transport) and how to open it.
The registry (:mod:`refit_core.net.transport.registry`) finds records by name, through the entry-point group
``refit.transports``; refit's own gloo, nccl and colocated ``ipc`` kinds register exactly that way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refit_core.contract.transport_options import TransportOptions
from refit_core.net.transport.base import Transport
from refit_core.net.transport.watch import PeerWatch


@dataclass(frozen=True)
class TransportContext:
    """Everything a transport is opened with; opening is collective over all ``world_size`` ranks.

    - ``store``: the refit's rendezvous store (every rank's, authenticated); put keys under a prefix of
      the transport's own (``dist.PrefixStore(f"{name}/", store)``).
    - ``rank`` / ``world_size``: this rank's global rank (train ranks ``0..S-1``, then gen ranks) and the
      number of ranks of the refit.
    - ``device``: where this rank's pieces live (``cpu`` or a CUDA device).
    - ``timeout_s``: setup waits fail after this long; so does a step's wait.
    - ``options``: the kind's options (an instance of :attr:`TransportType.options`, defaults filled in), or
      None for a kind without options.
    - ``watch``: asked while a wait is slow whether a peer is gone or gave up (None: no watch).
    - ``rendezvous``: the refit's ``host:port`` (None: unknown): a listener should bind to the interface
      that reaches it.
    """

    store: dist.Store
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    options: TransportOptions | None = None
    watch: PeerWatch | None = None
    rendezvous: str | None = None


@dataclass(frozen=True)
class TransportType:
    """One transport kind, as registered under the entry-point group ``refit.transports``.

    - ``name``: what ``RefitOptions(transport=...)`` says (lowercase letters, digits, ``.``, ``_``, ``-``);
      the entry point's name must be the same.
    - ``open``: ``open(context) -> Transport``, collective over the refit's ranks; None for a path that is no
      network transport (the colocated ``ipc`` path, which the plan picks per pair).
    - ``options``: the kind's options class (None: it has none); ``RefitOptions.nccl`` for ``nccl``, an entry
      of ``RefitOptions.transport_options`` for any other.
    - ``summary``: one line for listings and errors.
    """

    name: str
    open: Callable[[TransportContext], Transport] | None
    options: type[TransportOptions] | None = None
    summary: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", str(self.name))  # a TransportKind member becomes its plain name

    @property
    def network(self) -> bool:
        """True when this kind opens a network transport (``RefitOptions.transport`` may name it)."""
        return self.open is not None


__all__ = ["TransportContext", "TransportType"]

"""What a transport author needs: the interface, the registered record, its context and options.

A transport moves a refit's packed messages between its ranks. Write a :class:`Transport` (``exchange``,
``close``; optionally ``abort``, ``register`` and :class:`TransportCounters`), describe it as a
:class:`TransportType` (its name, how to open it from a :class:`TransportContext`, its
:class:`TransportOptions`), and register that record under the entry-point group ``refit.transports`` of
your distribution::

    [project.entry-points."refit.transports"]
    toy-tcp = "refit_toy.tcp:TCP"

``RefitOptions(transport="toy-tcp", transport_options={"toy-tcp": TcpOptions(...)})`` then selects it on
every rank. :func:`register_transport` registers a kind in this process only (tests, notebooks).
``refit_core.testing.check_transport(name)`` checks an installed transport in real processes;
``docs/writing-a-transport.md`` walks through the example TCP transport of ``tests/example_plugin``.
"""

from __future__ import annotations

from refit_core.contract.transport_options import TransportOptions
from refit_core.net.transport.base import (
    DoneFence,
    Fence,
    Transport,
    TransportCounters,
    check_contiguous,
    spin_until,
)
from refit_core.net.transport.kind import TransportContext, TransportType
from refit_core.net.transport.registry import register_transport
from refit_core.net.transport.watch import PeerWatch

__all__ = ["DoneFence", "Fence", "PeerWatch", "Transport", "TransportContext", "TransportCounters", "TransportOptions",
           "TransportType", "check_contiguous", "register_transport", "spin_until"]

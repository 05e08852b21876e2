"""The colocated path (CUDA IPC / shared memory) as a registered transport kind, ``ipc``.

It is no network transport: the plan picks it per pair (``RefitOptions.colocate``,
:mod:`refit_core.plan.links`), and its two ends are :class:`~refit_core.run.colocated.ColocatedSender` and
:class:`~refit_core.run.colocated.ColocatedReceiver`, built here. It registers under the entry-point group
``refit.transports`` as any kind does (refit-core's ``pyproject.toml``), so that the endpoints reach it
through the registry (``transport_type("ipc")``), never by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from refit_core.contract.options import StridedCopy
from refit_core.net.transport.kind import TransportType
from refit_core.plan.items import Message
from refit_core.run.colocated import ColocatedReceiver, ColocatedSender


@dataclass(frozen=True)
class ColocatedPath(TransportType):
    """A transport kind whose pairs read each other's memory: it builds the two ends of a rank's colocated
    pairs instead of opening an exchange (``open`` is None)."""

    def sender(self, messages: dict[int, list[Message]], store: dist.Store, rank: int, device: torch.device,
               fingerprint: str, timeout_s: float, *, trace: bool = False) -> ColocatedSender:
        """A train rank's colocated pairs (``messages`` by gen rank), as :class:`ColocatedSender` takes them."""
        return ColocatedSender(messages, store, rank, device, fingerprint, timeout_s, trace=trace)

    def receiver(self, messages: dict[int, list[Message]], store: dist.Store, rank: int, device: torch.device,
                 fingerprint: str, timeout_s: float, *, strided: StridedCopy = StridedCopy.TRITON,
                 trace: bool = False) -> ColocatedReceiver:
        """A gen rank's colocated pairs (``messages`` by train rank), as :class:`ColocatedReceiver` takes them."""
        return ColocatedReceiver(messages, store, rank, device, fingerprint, timeout_s, strided=strided, trace=trace)


IPC = ColocatedPath("ipc", None, summary="colocated pairs: the receiver copies out of the trainer's memory "
                                         "(CUDA IPC on one GPU, shared memory on one host)")
"""The colocated kind, registered under ``refit.transports`` by refit-core's ``pyproject.toml``."""

__all__ = ["IPC", "ColocatedPath"]

"""Which pairs of ranks a transport can connect, checked at setup before any collective."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import PlanError
from ..options import TransportKind


def refuse_shared_gpus(kind: TransportKind, train_devices: Sequence[str], gen_devices: Sequence[str],
                       pairs: Iterable[tuple[int, int]]) -> None:
    """NCCL cannot connect two ranks on one GPU: raise :class:`PlanError` for such a plan.

    ``*_devices`` are device identities per side-local rank (``cuda:<uuid>`` or ``cpu``, equal on
    every process that uses the device); ``pairs`` are the ``(train rank, gen rank)`` that exchange
    weights. Only ``auto`` and ``nccl`` transports are checked (gloo connects anything).
    """
    if kind not in (TransportKind.AUTO, TransportKind.NCCL):
        return
    shared = sorted({(s, d) for s, d in pairs
                     if train_devices[s].startswith("cuda") and train_devices[s] == gen_devices[d]})
    if shared:
        listed = ", ".join(f"train {s} -> gen {d}" for s, d in shared[:5])
        raise PlanError(f"{len(shared)} transfer(s) would connect two ranks on the same GPU ({listed}); "
                        "NCCL cannot do that: place the train and gen ranks that exchange weights "
                        "on different GPUs")

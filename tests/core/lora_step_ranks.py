"""Rank program for the adapter-step cost test: an adapter-only LoRA refit of tiny-llama's adapters over gloo
(rank 0 trains, rank 1 serves), counting what one step asks of the transport and of torch."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from refit_core import LoraSpec, RefitOptions, RefitReceiver, RefitSender, SourcePiece
from refit_core.contract.pieces import DestinationPiece
from refit_core.kit.models import PRESETS
from refit_core.kit.verify import same_bytes
from refit_core.tools.bench.lora import Holder, model_tensors, register


ADDRESS_CHECKS = frozenset({"data_ptr", "untyped_storage"})
"""What the endpoints' per-step check that the bound memory has not moved calls per tensor (a C call each,
no copy work): left out of the count."""


class TorchCalls(TorchFunctionMode):
    """Counts every torch function and tensor method called from Python while active, by name (but
    :data:`ADDRESS_CHECKS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in ADDRESS_CHECKS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def adapter_step_ranks(rank: int, world: int, refits: list[tuple[str, int]], steps: int) -> list[dict[str, Any]]:
    """One side of each refit of ``refits`` (rendezvous address, layers), one after the other."""
    return [adapter_refit(rank, address, layers, steps) for address, layers in refits]


def adapter_refit(rank: int, address: str, layers: int, steps: int) -> dict[str, Any]:
    """One side of one refit; returns per step the transport's operations and the torch calls, and on the
    gen rank whether every adapter tensor landed bit for bit."""
    register()
    train = rank == 0
    _, adapters = model_tensors({**PRESETS["tiny-llama"], "num_hidden_layers": layers},
                                LoraSpec.parse("r=8,targets=q,k,v,o,gate,up,down"))
    specs = [spec for pair in adapters.values() for spec in pair]
    values = {s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i)).to(s.dtype)
              for i, s in enumerate(specs)}
    if train:
        holder = Holder([SourcePiece(s, s.full_box(), values[s.name]) for s in specs], True)
        endpoint: Any = RefitSender(holder, rendezvous=address, rank=0, world_size=1,
                                    options=RefitOptions(timeout_s=60))
    else:
        holder = Holder([DestinationPiece(s, s.full_box(), torch.zeros(s.shape, dtype=s.dtype)) for s in specs], False)
        endpoint = RefitReceiver(holder, rendezvous=address, rank=0, world_size=1, options=RefitOptions(timeout_s=60))
    endpoint.setup()
    transport = endpoint.executor.transport
    posted = {"exchanges": 0, "operations": 0}
    exchange = transport.exchange

    def counted(sends: Any, recvs: Any, *args: Any, **kwargs: Any) -> Any:
        posted["exchanges"] += 1
        posted["operations"] += len(sends) + len(recvs)
        return exchange(sends, recvs, *args, **kwargs)

    transport.exchange = counted
    out: list[dict[str, Any]] = []
    for step in range(steps):
        posted.update(exchanges=0, operations=0)
        with TorchCalls() as calls:
            endpoint.send(version=step + 1) if train else endpoint.receive()
        out.append({**posted, "torch_calls": sum(calls.calls.values()), "calls": dict(calls.calls)})
    landed = all(same_bytes(p.view, values[p.spec.name]) for p in holder.pieces) if not train else True
    endpoint.close()
    return {"tensors": len(specs), "steps": out, "landed": landed}

"""Transports that break the contract on purpose (the toy TCP transport, bent): the conformance check must
fail each, naming what it broke."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from refit_toy.tcp import TcpOptions, TcpTransport, open_tcp

from refit_core.transports import Fence, TransportContext, TransportType


class _Careless(TcpTransport):
    """Reads its send tensors before the ``after`` fences completed, and sends non-contiguous ones as copies."""

    kind = "toy-tcp-careless"

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = (), *, control: bool = False) -> Fence:
        early = [(peer, tensor.clone(memory_format=torch.contiguous_format)) for peer, tensor in sends]
        fence = super().exchange(early, recvs, (), control=control)
        for waited in after:
            waited.wait()
        return fence


def _open_careless(context: TransportContext) -> _Careless:
    transport = open_tcp(context)
    transport.__class__ = _Careless
    return transport  # type: ignore[return-value]


CARELESS = TransportType("toy-tcp-careless", _open_careless, TcpOptions, "ignores after fences and contiguity")

"""NCCL communicators as the nccl transport uses them: nccl4py's raw bindings, or torch's ProcessGroupNCCL.

:func:`open_comm` builds one communicator of some ranks from the refit's store (rank 0 draws the unique
id); :class:`NcclComm` (nccl4py, the default) and :class:`TorchNcclComm` (the fallback) both post a group of
sends and receives on a stream. The transport (:mod:`refit_core.net.transport.nccl`) decides how many
communicators each link gets and which one each operation goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from refit_core.contract.errors import RefitError
from refit_core.contract.nccl_options import NcclBackend
from refit_core.net.keys import nccl_group_prefix, nccl_unique_id_key

log = logging.getLogger("refit")

_IN_PROGRESS = 7  # ncclInProgress
_UINT8 = 1  # ncclUint8: operations move bytes


class Communicator(Protocol):
    """What refit and its benchmark need of one NCCL communicator."""

    backend: NcclBackend

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
             stream: torch.cuda.Stream) -> None: ...

    def broadcast(self, tensor: torch.Tensor, root: int, stream: torch.cuda.Stream) -> None: ...

    def post_broadcasts(self, tensors: Sequence[torch.Tensor], root: int, stream: torch.cuda.Stream) -> None:
        """One group of in-place broadcasts of ``tensors`` from member ``root``, on ``stream``."""

    def error(self) -> str | None: ...

    def abort(self) -> None:
        """Tear the communicator down now, ending its kernels that wait on a peer (any thread)."""

    def close(self) -> None: ...


class NcclComm:
    """One NCCL communicator (nccl4py), with the few calls refit and its benchmark use."""

    backend = NcclBackend.NCCL4PY

    def __init__(self, store: dist.Store, key: str, nranks: int, rank: int, device: torch.device,
                 max_ctas: int = 0) -> None:
        import nccl.core as nccl
        from nccl.bindings import nccl as bindings

        self._nccl = nccl
        self._bindings = bindings
        self.nranks, self.rank, self.device = nranks, rank, device
        if rank == 0:
            uid = nccl.get_unique_id()
            store.set(nccl_unique_id_key(key), bytes(uid.as_bytes))  # type: ignore[arg-type]  # torch's stub says str
        raw = store.get(nccl_unique_id_key(key))
        config = nccl.NCCLConfig(max_ctas=max_ctas) if max_ctas else None
        with torch.cuda.device(device):
            self.comm = nccl.Communicator.init(nranks, rank, nccl.UniqueId.from_bytes(raw), config)
            self._index = torch.cuda.current_device()
        self._handle = bindings.Comm(self.comm.ptr)
        """The communicator as the raw bindings take it (a handle; ``self.comm`` owns it)."""

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
             stream: torch.cuda.Stream) -> None:
        """One NCCL group of ``recvs`` and ``sends``, as bytes, through nccl4py's raw bindings: its
        ``Communicator.send`` resolves each tensor anew (dtype table, device object: some 30 us an
        operation, on the step's critical path). The transport checks that every tensor is contiguous;
        this checks that each is on the communicator's device, before the group opens."""
        elsewhere = [t.device for _, t in (*recvs, *sends) if t.get_device() != self._index]
        if elsewhere:
            raise ValueError(f"a tensor on {elsewhere[0]} handed to the communicator of {self.device}")
        bindings, comm, handle = self._bindings, self._handle, stream.cuda_stream
        bindings.group_start()
        try:
            for peer, tensor in recvs:
                bindings.recv(tensor.data_ptr(), tensor.nbytes, _UINT8, peer, comm, handle)
            for peer, tensor in sends:
                bindings.send(tensor.data_ptr(), tensor.nbytes, _UINT8, peer, comm, handle)
        finally:
            bindings.group_end()

    def broadcast(self, tensor: torch.Tensor, root: int, stream: torch.cuda.Stream) -> None:
        self.comm.broadcast(tensor, tensor, root, stream=stream.cuda_stream)

    def post_broadcasts(self, tensors: Sequence[torch.Tensor], root: int, stream: torch.cuda.Stream) -> None:
        """One NCCL group of in-place broadcasts, as bytes, through the raw bindings (see :meth:`post`)."""
        elsewhere = [t.device for t in tensors if t.get_device() != self._index]
        if elsewhere:
            raise ValueError(f"a tensor on {elsewhere[0]} handed to the communicator of {self.device}")
        bindings, comm, handle = self._bindings, self._handle, stream.cuda_stream
        bindings.group_start()
        try:
            for tensor in tensors:
                bindings.broadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes, _UINT8, root, comm, handle)
        finally:
            bindings.group_end()

    def error(self) -> str | None:
        """NCCL's asynchronous error, if any (a dead peer, a broken link)."""
        try:
            result = self.comm.get_async_error()
        except Exception as exc:  # noqa: BLE001 - report whatever the binding raises
            return str(exc)
        if int(result) in (0, _IN_PROGRESS):
            return None
        return f"{self._nccl.get_error_string(result)} ({result})"

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.destroy()


class TorchNcclComm:
    """The fallback: ``torch.distributed.ProcessGroupNCCL`` on the refit's store (never the default group)."""

    backend = NcclBackend.TORCH

    def __init__(self, store: dist.Store, key: str, nranks: int, rank: int, device: torch.device,
                 timeout_s: float, max_ctas: int = 0) -> None:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        opts._timeout = timedelta(seconds=timeout_s)
        if max_ctas:
            opts.config.max_ctas = max_ctas
        self.nranks, self.rank, self.device = nranks, rank, device
        self.pg: Any = dist.ProcessGroupNCCL(dist.PrefixStore(nccl_group_prefix(key), store), rank, nranks, opts)
        self._coalesce_takes_device = True

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
             stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):  # the process group's stream waits for this one, and back
            coalesce = hasattr(self.pg, "_start_coalescing")
            if coalesce:
                self._coalescing("_start_coalescing")
            works = [self.pg.recv([t], peer, 0) for peer, t in recvs]
            works += [self.pg.send([t], peer, 0) for peer, t in sends]
            if coalesce:
                works = [self._coalescing("_end_coalescing")]
            for work in works:
                if work is not None:
                    work.wait()

    def _coalescing(self, method: str) -> Any:
        """``ProcessGroupNCCL._start_coalescing`` / ``_end_coalescing``: torch up to 2.10 takes the device,
        2.11 takes nothing (the backend knows its device)."""
        call = getattr(self.pg, method)
        if self._coalesce_takes_device:
            try:
                return call(self.device)
            except TypeError:
                self._coalesce_takes_device = False
        return call()

    def broadcast(self, tensor: torch.Tensor, root: int, stream: torch.cuda.Stream) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        with torch.cuda.stream(stream):
            self.pg.broadcast([tensor], opts).wait()

    def post_broadcasts(self, tensors: Sequence[torch.Tensor], root: int, stream: torch.cuda.Stream) -> None:
        for tensor in tensors:
            self.broadcast(tensor, root, stream)

    def error(self) -> str | None:
        return None

    def abort(self) -> None:
        self.pg.abort()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


def resolve_backend(backend: NcclBackend) -> NcclBackend:
    """``auto`` becomes nccl4py where it imports, torch otherwise; nccl4py that cannot import is an error."""
    if backend == NcclBackend.TORCH:
        return backend
    try:
        import nccl.core  # noqa: F401
    except Exception as exc:  # ImportError, or a cuda-core/bindings mismatch
        if backend == NcclBackend.NCCL4PY:
            raise RefitError(f"nccl4py cannot be imported ({exc}); pip install nccl4py") from exc
        log.warning("refit: nccl4py unavailable (%s); using torch's ProcessGroupNCCL", exc)
        return NcclBackend.TORCH
    return NcclBackend.NCCL4PY


def open_comm(store: dist.Store, key: str, nranks: int, rank: int, device: torch.device,
              timeout_s: float = 300.0, backend: NcclBackend = NcclBackend.AUTO, max_ctas: int = 0) -> Communicator:
    """A communicator of ``nranks`` over ``store`` (keys under ``key``); collective over its ranks.

    ``timeout_s`` bounds torch's ProcessGroupNCCL; nccl4py has no timeout of its own (refit's fences
    enforce deadlines on the host). ``max_ctas``: NCCL's ``maxCTAs`` (0: NCCL's default).
    """
    if resolve_backend(backend) == NcclBackend.TORCH:
        return TorchNcclComm(store, key, nranks, rank, device, timeout_s, max_ctas)
    return NcclComm(store, key, nranks, rank, device, max_ctas)


__all__ = ["Communicator", "NcclComm", "TorchNcclComm", "open_comm", "resolve_backend"]

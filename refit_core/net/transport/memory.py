"""Sharing a trainer's memory with another process on the same host or GPU, in plain encodings.

A storage is *exported* once at setup into a :class:`SharedStorage` (strings and integers only, so it
travels through the rendezvous store as JSON: nothing from the network is ever unpickled) and
*opened* once by the receiving process:

- CPU: the storage moves into a named POSIX shared-memory segment (torch's ``file_system`` sharing,
  in place: the same tensors and values, at a new address), opened by name.
- CUDA: a CUDA IPC handle of the caching allocator's block that holds the storage (torch's own
  ``_share_cuda_``: the block is not reused while a receiver holds it open), opened with
  ``cudaIpcOpenMemHandle``.

:class:`StepEvent` orders GPU work across the two processes with an interprocess CUDA event.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass

import torch

from refit_core.contract.errors import RefitError


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _raw(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


@dataclass(frozen=True)
class SharedStorage:
    """How another process opens one exported storage (``kind`` ``cpu`` or ``cuda``)."""

    kind: str
    handle: str  # base64: the shm segment's name, or the CUDA IPC memory handle
    nbytes: int
    manager: str = ""  # cpu: torch's shm manager socket (base64)
    device: int = 0  # cuda: the device index in the exporting process (the receiver uses its own)
    offset: int = 0  # cuda: byte offset of the storage inside the IPC block
    ref_counter: str = ""  # cuda: torch's IPC reference counter file (base64) and offset
    ref_counter_offset: int = 0
    event: str = ""  # cuda: torch's allocation event handle (base64), and whether to wait on it
    event_sync: bool = False

    def key(self) -> tuple:
        return (self.kind, self.handle, self.offset)


def export_storage(storage: torch.UntypedStorage) -> SharedStorage:
    """Make ``storage`` openable by another process on this host (CPU) or GPU (CUDA).

    On CPU this moves the storage into shared memory in place (its ``data_ptr`` changes; every tensor
    on it stays valid). Raises :class:`RefitError` for other devices.
    """
    if storage.device.type == "cpu":
        manager, handle, size = storage._share_filename_cpu_()
        return SharedStorage("cpu", _b64(handle), int(size), manager=_b64(manager))
    if storage.device.type == "cuda":
        (device, handle, size, offset, ref_counter, ref_offset, event, event_sync) = storage._share_cuda_()
        return SharedStorage("cuda", _b64(handle), int(size), device=int(device), offset=int(offset),
                             ref_counter=_b64(ref_counter), ref_counter_offset=int(ref_offset),
                             event=_b64(event or b""), event_sync=bool(event_sync))
    raise RefitError(f"refit cannot share {storage.device} memory with another process")


def open_storage(shared: SharedStorage, device: torch.device) -> torch.UntypedStorage:
    """Open a storage another process exported (once per process; keep the result while in use)."""
    if shared.kind == "cpu":
        return torch.UntypedStorage._new_shared_filename_cpu(_raw(shared.manager), _raw(shared.handle),
                                                             shared.nbytes)
    if shared.kind == "cuda":
        with torch.cuda.device(device):
            return torch.UntypedStorage._new_shared_cuda(
                device.index if device.index is not None else torch.cuda.current_device(),
                _raw(shared.handle), shared.nbytes, shared.offset, _raw(shared.ref_counter),
                shared.ref_counter_offset, _raw(shared.event), shared.event_sync)
    raise RefitError(f"unknown shared storage kind {shared.kind!r}")


@dataclass(frozen=True)
class SharedView:
    """A tensor on an exported storage: which storage (index into a list), offset, shape, strides, dtype."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor, storage: int) -> SharedView:
        return cls(storage, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()),
                   str(tensor.dtype).removeprefix("torch."))

    def open(self, storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise RefitError(f"a shared view names an unknown dtype {self.dtype!r}")
        end = self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) + 1
        if min(self.shape, default=1) > 0 and end * dtype.itemsize > storage.nbytes():
            raise RefitError(f"a shared view ends at byte {end * dtype.itemsize}, past its storage's "
                             f"{storage.nbytes()} bytes")
        return torch.empty(0, dtype=dtype, device=device).set_(storage, self.offset, self.shape, self.stride)


def encode_exports(storages: list[SharedStorage], views: dict[int, SharedView]) -> bytes:
    """The JSON a sender publishes for its receivers: its exported storages and piece views."""
    return json.dumps({"storages": [asdict(s) for s in storages],
                       "views": {str(k): asdict(v) for k, v in views.items()}}).encode()


def decode_exports(raw: bytes) -> tuple[list[SharedStorage], dict[int, SharedView]]:
    try:
        data = json.loads(raw.decode())
        storages = [SharedStorage(**s) for s in data["storages"]]
        views = {int(k): SharedView(v["storage"], v["offset"], tuple(v["shape"]), tuple(v["stride"]), v["dtype"])
                 for k, v in data["views"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise RefitError(f"malformed shared-memory description from a train rank: {exc}") from exc
    if any(not 0 <= v.storage < len(storages) for v in views.values()):
        raise RefitError("a shared view names a storage the train rank did not export")
    return storages, views


class StepEvent:
    """An interprocess CUDA event: one process records it, the other makes its streams wait on it."""

    def __init__(self, device: torch.device, handle: bytes | None = None) -> None:
        if handle is None:
            self.event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
            self.event.record(torch.cuda.current_stream(device))  # an IPC handle needs a recorded event
        else:
            self.event = torch.cuda.Event.from_ipc_handle(device, handle)

    def handle(self) -> str:
        return _b64(bytes(self.event.ipc_handle()))

    @staticmethod
    def decode(text: str) -> bytes:
        return _raw(text)


__all__ = ["SharedStorage", "SharedView", "StepEvent", "decode_exports", "encode_exports",
           "export_storage", "open_storage"]

"""Binding a rank's pieces to its executors, and the per-step check that the bound memory is still the model's.

refit reads (train side) and writes (gen side) the memory it bound at setup, every step; a model that
rebound (``param.data = ...``), ``set_()``, resized or freed a tensor since would be sent or served stale,
or hand freed memory to the transport. :class:`BoundMemory` is what was bound; its :class:`BoundTensors`
checks before every step, on its critical path, that the model's tensors are still that memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from itertools import compress
from operator import attrgetter, itemgetter

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import ExpertNamer, group_piece
from refit_core.contract.pieces import Piece
from refit_core.contract.side import Side
from refit_core.endpoints.compiled_check import CompiledCheck, compiled_check
from refit_core.run.validate import check_no_overlap, check_view

_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_SPEC, _BOX, _VIEW = attrgetter("spec"), attrgetter("box"), attrgetter("view")
_ADDRESS = torch.Tensor.data_ptr
_STORAGE = torch.Tensor.untyped_storage
_STORAGE_ADDRESS, _STORAGE_BYTES = torch.UntypedStorage.data_ptr, torch.UntypedStorage.nbytes


def device_of(pieces: list[Piece]) -> torch.device:
    """The one device a rank's pieces live on (CPU if none has a view); :class:`RefitError` if several."""
    devices = {p.view.device for p in pieces if p.view is not None}
    if len(devices) > 1:
        raise RefitError(f"pieces live on several devices {sorted(map(str, devices))}; one device per rank")
    return devices.pop() if devices else torch.device("cpu")


class Moved(StrEnum):
    """How a bound tensor's memory changed since the bind."""

    OBJECT_REPLACED = "tensor object replaced"
    """The model holds another tensor object in its place."""
    STORAGE_REPLACED = "storage replaced"
    """The same object, given other memory (``param.data = ...``, ``set_()``)."""
    STORAGE_RESIZED = "storage resized"
    """Its storage itself was resized (reallocated)."""
    STORAGE_FREED = "storage freed"
    """Its storage was resized to 0 bytes (``untyped_storage().resize_(0)``)."""
    VIEW_MOVED = "view moved"
    """The same storage, another place in it (``set_()`` with another offset)."""
    LISTING_CHANGED = "listing changed"
    """The model's tensors or pieces are not the ones listed at the bind (another count or layout)."""


@dataclass(frozen=True)
class MemoryChange:
    """A bound tensor that is no longer the memory refit planned: its name, how it changed and the details."""

    name: str
    moved: Moved
    detail: str = ""

    def describe(self, side: Side) -> str:
        """The step's error on ``side``: the tensor, its side, what changed, and what to do."""
        if side is Side.TRAIN:
            role, since, remedy = "source", "at setup", (
                "refit reads the memory it bound at setup: update parameters in place between setup() and close(), "
                "or call setup() again after replacing them")
        else:
            role, since, remedy = "destination", "when refit bound it", (
                "refit writes the memory it bound: the engine plugin's refit_begin_update must return True after "
                "replacing destination tensors, so that refit binds them again")
        what = f"{self.moved}{f' {self.detail}' if self.detail else ''}"
        if self.moved is Moved.LISTING_CHANGED:
            return f"the {role} tensors changed since refit bound them: {self.detail} (on the {side} side: {remedy})"
        where = (f"is not the memory refit bound {since}" if self.moved is Moved.STORAGE_FREED else
                 f"now lives at a different address than {since}")
        return f"{role} tensor {self.name} {where}: {what} (on the {side} side: {remedy}); nothing of the step moved"


@dataclass
class CompiledRecord:
    """A bind's record for the compiled check (:mod:`~refit_core.endpoints.compiled_check`), taken from the
    bound tensors right after a check in Python passed (None until the compiled check is at hand)."""

    check: CompiledCheck | None = None
    record: bytes | None = None
    allowed: bool = True
    """False: the check stays in Python (what ``benchmarks/bound_check.py`` compares with)."""

    def adopt(self, bound: Sequence[torch.Tensor]) -> None:
        """Record ``bound`` (just checked unchanged) for the compiled check if it is at hand now: a model of
        :data:`~refit_core.endpoints.compiled_check.BUILD_FROM` tensors or more starts its build if none is."""
        check = compiled_check(build_from=len(bound)) if self.allowed else None
        if check is not None:
            self.record, self.check = check.record(bound), check


@dataclass(frozen=True)
class BoundTensors:
    """A model's tensors as refit bound them: each object, the address of its first element (``data_ptr()``)
    and its storage (the storage object itself, kept: it shows a later resize or free), with the storage's
    address and size then.

    ``objects``: whether the listing hands the same tensor objects every time (``refit_model_tensors``), so
    that another object names the change; a plugin's pieces may be new views of the same memory at each call.

    Checked before every step, on its critical path: the common case (nothing changed) is one compiled loop
    over the tensors (:mod:`~refit_core.endpoints.compiled_check`: each tensor's storage object, address, size
    and offset), or where that is not built, two passes of C calls (``map``), one over the tensors' addresses
    and one over their distinct storages' addresses; only a difference is diagnosed. The passes see every way
    the memory can change under a tensor: ``.data =`` and ``set_()`` give the tensor another storage (another
    address: the bound storage is still held, so its memory is not reused while it lives), a storage resized
    gets a new allocation (the old one is held while it copies), and a freed storage
    (``untyped_storage().resize_(0)``) has none: its address falls to 0, and its tensors' to their byte
    offsets. The storages' pass sees a bound storage freed even when the tensor
    was then given new memory at the very address the freed one had (a caching allocator's reuse), which
    the executors' views, still on the freed storage, would hand the transport."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    addresses: tuple[int, ...]
    storages: tuple[torch.UntypedStorage, ...]
    """Each tensor's storage at the bind."""
    storage_addresses: tuple[int, ...]
    storage_bytes: tuple[int, ...]
    distinct: tuple[torch.UntypedStorage, ...]
    """The distinct storages among :attr:`storages` (by address), each checked once per step."""
    distinct_addresses: tuple[int, ...]
    objects: bool = True
    compiled: CompiledRecord = field(default_factory=CompiledRecord, compare=False, repr=False)
    """The compiled check's record of these tensors, once that check is at hand
    (:mod:`refit_core.endpoints.compiled_check`): then a step's check is one compiled loop."""

    @classmethod
    def of(cls, names: Sequence[str], tensors: Sequence[torch.Tensor], objects: bool = True) -> BoundTensors:
        """Record ``tensors`` (named ``names``) as bound now."""
        tensors = tuple(tensors)
        storages = tuple(map(_STORAGE, tensors))
        addresses = tuple(map(_STORAGE_ADDRESS, storages))
        distinct = dict(zip(addresses, storages))
        return cls(tuple(names), tensors, tuple(map(_ADDRESS, tensors)), storages, addresses,
                   tuple(map(_STORAGE_BYTES, storages)), tuple(distinct.values()), tuple(distinct), objects)

    @classmethod
    def listed(cls, named: Sequence[tuple[str, torch.Tensor]]) -> BoundTensors:
        """Record the model's tensors as ``refit_model_tensors`` lists them (name, tensor)."""
        return cls.of(tuple(map(_FIRST, named)), tuple(map(_SECOND, named)))

    def first_change(self, now: Sequence[tuple[str, torch.Tensor]]) -> MemoryChange | None:
        """The first of ``now`` (the model's tensors listed again, as when bound) that is not the memory bound,
        and how it changed; None if every one is."""
        if len(now) == len(self.names) and self._unchanged(now, 1):
            return None
        return self._first_change(tuple(map(_SECOND, now)))

    def first_change_of(self, tensors: Sequence[torch.Tensor]) -> MemoryChange | None:
        """:meth:`first_change` for the tensors alone, in the order bound."""
        if len(tensors) == len(self.names) and self._unchanged(tensors, -1):
            return None
        return self._first_change(tensors)

    def _unchanged(self, items: Sequence[object], field: int) -> bool:
        """The common case, on the step's critical path: every tensor of ``items`` (the items themselves, or
        their ``field``-th element) as recorded. One compiled loop once that is at hand, else one C call per
        tensor and one per distinct storage; a pass in Python then records the tensors for the compiled loop."""
        compiled = self.compiled
        if compiled.record is not None and compiled.check is not None:
            return compiled.check.first_moved(items, compiled.record, field) < 0
        tensors: Iterable[object] = items if field < 0 else map(itemgetter(field), items)  # type: ignore[arg-type]
        try:
            unchanged = (tuple(map(_ADDRESS, tensors)) == self.addresses  # type: ignore[arg-type]
                         and tuple(map(_STORAGE_ADDRESS, self.distinct)) == self.distinct_addresses)
        except TypeError:  # something else than a tensor: named by _first_change
            return False
        if unchanged:
            compiled.adopt(self.tensors)
        return unchanged

    def _first_change(self, tensors: Sequence[object]) -> MemoryChange | None:
        if len(tensors) != len(self.names):
            return MemoryChange("", Moved.LISTING_CHANGED, f"the model now lists {len(tensors)} tensors, "
                                                           f"{len(self.names)} when refit bound them")
        for index, tensor in enumerate(tensors):
            change = self._change(index, tensor)
            if change is not None:
                return change
        return None

    def _change(self, index: int, tensor: object) -> MemoryChange | None:
        """How bound tensor ``index``, now ``tensor``, changed (None: it did not)."""
        name = self.names[index]
        storage, address, nbytes = self.storages[index], self.storage_addresses[index], self.storage_bytes[index]
        if storage.nbytes() != nbytes:  # the bound storage itself: every view of it sees the change
            if storage.nbytes() == 0:
                return MemoryChange(name, Moved.STORAGE_FREED, f"(resized from {nbytes} to 0 bytes)")
            return MemoryChange(name, Moved.STORAGE_RESIZED, f"from {nbytes} to {storage.nbytes()} bytes")
        if storage.data_ptr() != address:
            return MemoryChange(name, Moved.STORAGE_RESIZED, f"(reallocated at the same {nbytes} bytes)")
        if not isinstance(tensor, torch.Tensor):
            return MemoryChange(name, Moved.OBJECT_REPLACED, f"(the model hands a {type(tensor).__name__} now)")
        replaced = self.objects and tensor is not self.tensors[index]
        if tensor.untyped_storage().data_ptr() != address:
            if replaced:
                return MemoryChange(name, Moved.OBJECT_REPLACED, "(the model holds another tensor, in other memory)")
            return MemoryChange(name, Moved.STORAGE_REPLACED, "(`.data = ...` or `set_()` gave it other memory)")
        if tensor.data_ptr() != self.addresses[index]:
            return MemoryChange(name, Moved.VIEW_MOVED, f"from byte {self.addresses[index] - address} to byte "
                                                        f"{tensor.data_ptr() - address} of its storage")
        return None


def checked_views(pieces: list[Piece], side: Side, rank: int, expert_name: ExpertNamer,
                  counts: dict[str, int]) -> tuple[list[str], list[torch.Tensor]]:
    """Every (expert-grouped) piece's name and view, each view re-checked (see :mod:`refit_core.run.validate`;
    a gen rank's views must not overlap: it writes them)."""
    grouped = [group_piece(p, expert_name, counts) for p in pieces]
    if any(p.view is None for p in grouped):
        raise RefitError(f"{side} rank {rank}: a piece without a view cannot be bound")
    writes = side is Side.GEN
    for p in grouped:
        check_view(p.spec, p.box, p.view, destination=writes)
    views = [p.view for p in grouped if p.view is not None]
    if writes:
        check_no_overlap([p.spec.name for p in grouped], views)
    return [p.spec.name for p in grouped], views


@dataclass(frozen=True)
class PieceLayout:
    """A plugin's pieces as bound, when it does not list the model's tensors: each piece's spec and box, and
    which pieces have a view (a gen rank's loader pieces have none)."""

    specs: tuple[object, ...]
    boxes: tuple[object, ...]
    viewed: tuple[bool, ...]

    @classmethod
    def of(cls, pieces: Sequence[Piece]) -> PieceLayout:
        return cls(tuple(map(_SPEC, pieces)), tuple(map(_BOX, pieces)), tuple(p.view is not None for p in pieces))

    @cached_property
    def viewed_bytes(self) -> bytes:
        """:attr:`viewed`, one byte a piece (what the compiled check reads)."""
        return bytes(self.viewed)

    def same(self, pieces: Sequence[Piece]) -> bool:
        """Whether ``pieces`` have this layout (the same specs and boxes, in order)."""
        return tuple(map(_SPEC, pieces)) == self.specs and tuple(map(_BOX, pieces)) == self.boxes

    def views(self, pieces: Sequence[Piece]) -> tuple[torch.Tensor, ...]:
        """The views of the pieces that had one when bound."""
        return tuple(compress(map(_VIEW, pieces), self.viewed))


@dataclass(frozen=True)
class BoundMemory:
    """What the executors were last bound to: every piece's name and the view they read or write, and the
    model's tensors right after the bind (``identity``): those its plugin lists (``refit_model_tensors``), or
    else its pieces' views, whose layout (``layout``) steps compare too."""

    names: list[str]
    views: list[torch.Tensor]
    identity: BoundTensors
    layout: PieceLayout | None = None
    """Without ``refit_model_tensors``: the pieces' layout at the bind (None: the plugin lists tensors)."""

    @classmethod
    def after_bind(cls, names: list[str], views: list[torch.Tensor],
                   tensors: Sequence[tuple[str, torch.Tensor]] | None, pieces: Sequence[Piece]) -> BoundMemory:
        """Record a bind that just happened, with the model's ``tensors`` as its plugin lists them now (None:
        no plugin lists them, then its ``pieces`` as it hands them; on CPU, exporting to colocated peers may
        have moved the storages, so this runs after)."""
        if tensors is not None:
            return cls(names, views, BoundTensors.listed(tensors))
        layout = PieceLayout.of(pieces)
        viewed = list(compress(pieces, layout.viewed))
        return cls(names, views, BoundTensors.of([p.spec.name for p in viewed], layout.views(pieces), objects=False),
                   layout)

    @property
    def lists(self) -> bool:
        """Whether the plugin listed the model's tensors at the bind (``refit_model_tensors``); else steps
        compare its pieces."""
        return self.layout is None

    def first_listed_change(self, listed: Sequence[tuple[str, torch.Tensor]] | None) -> MemoryChange | None:
        """What changed since the bind, against ``listed``, the plugin's ``refit_model_tensors`` now."""
        if listed is None:
            return MemoryChange("", Moved.LISTING_CHANGED, "the plugin's refit_model_tensors stopped listing the "
                                                           "model's tensors")
        return self.identity.first_change(listed)

    def first_piece_change(self, pieces: Sequence[Piece]) -> MemoryChange | None:
        """What changed since the bind, against ``pieces``, the plugin's pieces now (a new layout is a change)."""
        assert self.layout is not None
        compiled = self.identity.compiled
        if compiled.check is not None and compiled.record is not None and compiled.check.first_piece_moved(
                pieces, self.layout.specs, self.layout.boxes, self.layout.viewed_bytes, compiled.record) < 0:
            return None
        if not self.layout.same(pieces):
            return MemoryChange("", Moved.LISTING_CHANGED, "the plugin's pieces are not the ones it listed then "
                                                           "(call setup() again after changing the model)")
        return self.identity.first_change_of(self.layout.views(pieces))


__all__ = ["BoundMemory", "BoundTensors", "CompiledRecord", "MemoryChange", "Moved", "PieceLayout", "checked_views",
           "device_of"]

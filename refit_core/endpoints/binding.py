"""Binding a rank's pieces to its executors, and the per-step checks that the bound memory is still the model's.

refit reads (train side) and writes (gen side) the memory it bound at setup, every step; a model that
replaced, moved or freed a tensor since would be sent or served stale. :class:`BoundMemory` is what was
bound; :class:`BoundTensors` and :func:`first_moved` check it before every step, on its critical path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import is_, itemgetter

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import ExpertNamer, group_piece
from refit_core.contract.pieces import Piece
from refit_core.contract.side import Side
from refit_core.run.validate import check_no_overlap, check_view

_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def device_of(pieces: list[Piece]) -> torch.device:
    """The one device a rank's pieces live on (CPU if none has a view); :class:`RefitError` if several."""
    devices = {p.view.device for p in pieces if p.view is not None}
    if len(devices) > 1:
        raise RefitError(f"pieces live on several devices {sorted(map(str, devices))}; one device per rank")
    return devices.pop() if devices else torch.device("cpu")


@dataclass(frozen=True)
class BoundTensors:
    """A model's tensors as refit bound them: each object and the address of its first element
    (``data_ptr()``: it changes when the storage is replaced, moved or freed, and reading it costs no
    storage object, which on CUDA is most of a per-step check's time).

    Checked before every step, on its critical path: the common case (nothing changed) is two passes
    of C calls over the tensors (``map``), a few microseconds per hundred tensors."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    addresses: tuple[int, ...]

    @classmethod
    def of(cls, named: Sequence[tuple[str, torch.Tensor]]) -> BoundTensors:
        tensors = tuple(map(_SECOND, named))
        return cls(tuple(map(_FIRST, named)), tensors, tuple(map(torch.Tensor.data_ptr, tensors)))

    def first_replaced(self, now: Sequence[tuple[str, torch.Tensor]]) -> str | None:
        """The name of the first of ``now`` (the model's tensors listed again) that is another object or
        lives elsewhere than when bound, or what changed in the listing; None if nothing did."""
        if len(now) != len(self.names):
            return f"the model now has {len(now)} tensors, {len(self.names)} when refit bound it"
        tensors = tuple(map(_SECOND, now))
        if all(map(is_, tensors, self.tensors)) and tuple(map(torch.Tensor.data_ptr, tensors)) == self.addresses:
            return None
        for (name, tensor), was, address in zip(now, self.tensors, self.addresses):
            if tensor is not was or tensor.data_ptr() != address:
                return name
        return None


def first_moved(current: Sequence[Piece], bound: Sequence[Piece]) -> Piece | None:
    """The first of the ``current`` pieces whose view no longer is the memory of its ``bound`` twin (the
    model replaced the tensor or moved it since it was bound); None if every view is where it was."""
    for now, then in zip(current, bound):
        if now.view is None or then.view is None:
            continue
        if (now.view.data_ptr() != then.view.data_ptr()
                or now.view.untyped_storage().data_ptr() != then.view.untyped_storage().data_ptr()):
            return now
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
class BoundMemory:
    """What the executors were last bound to: every piece's name and the view they read or write, and the
    model's tensors right after the bind (None: no plugin lists them, so steps compare the pieces)."""

    names: list[str]
    views: list[torch.Tensor]
    identity: BoundTensors | None

    @classmethod
    def after_bind(cls, names: list[str], views: list[torch.Tensor],
                   tensors: Sequence[tuple[str, torch.Tensor]] | None) -> BoundMemory:
        """Record a bind that just happened, with the model's ``tensors`` as its plugin lists them now (None:
        no plugin lists them; on CPU, exporting to colocated peers may have moved the storages)."""
        return cls(names, views, None if tensors is None else BoundTensors.of(tensors))


__all__ = ["BoundMemory", "BoundTensors", "checked_views", "device_of", "first_moved"]

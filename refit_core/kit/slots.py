"""An adapter's boxes in an engine's LoRA slot tensors: what every engine plugin's adapter target shares.

An engine plugin finds, once, where each box of each adapter tensor lands in its engine's slot tensors
(a :class:`SlotBox` per box, by tracing the engine's own loader) and says how to reach the live slot
tensor a box views (:meth:`AdapterSlots.live_slot`); :class:`AdapterSlots` turns that into the
receiver's destination map, the step's catalog, and the save / restore of the slot bytes around a step.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from refit_core.contract.lora import AdapterReceiver
from refit_core.contract.pieces import DestinationMap, DestinationPiece
from refit_core.contract.spec import Box, TensorSpec


@dataclass(frozen=True)
class SlotBox:
    """Where one box of an adapter tensor lands: a strided view of a live slot tensor, ``offset``
    elements past its storage offset."""

    spec: TensorSpec
    box: Box
    offset: int
    strides: tuple[int, ...]

    def view_of(self, live: torch.Tensor) -> torch.Tensor:
        """This box's view of ``live``, the slot tensor it lands in."""
        return live.as_strided(self.box.sizes, self.strides, live.storage_offset() + self.offset)


@dataclass(frozen=True)
class SlotPlan:
    """An adapter's place in an engine: its slot, its tensors and where every box of them lands."""

    slot: int
    specs: tuple[TensorSpec, ...]
    pieces: tuple[SlotBox, ...]


class AdapterSlots(AdapterReceiver):
    """What a gen rank receives into in adapter mode, engine-independent: :attr:`plan` (None until the
    adapter is registered), :attr:`version` (the last version that landed; None before the first),
    :attr:`saved` (the slot bytes a running step may overwrite; None outside a step) and :meth:`live_slot`,
    the one engine-specific part. A step saves the slot bytes it overwrites when it begins and puts them back
    if it fails."""

    plan: SlotPlan | None
    version: int | None
    saved: list[torch.Tensor] | None

    @abstractmethod
    def live_slot(self, piece: SlotBox) -> torch.Tensor:
        """The live slot tensor ``piece`` lands in."""

    def views(self) -> list[torch.Tensor]:
        """Each piece's view of the live slot tensors."""
        assert self.plan is not None
        return [p.view_of(self.live_slot(p)) for p in self.plan.pieces]

    def destination_map(self) -> DestinationMap:
        assert self.plan is not None
        return DestinationMap(pieces=[DestinationPiece(p.spec, p.box, v) for p, v in zip(self.plan.pieces,
                                                                                        self.views())])

    def catalog(self) -> dict[str, TensorSpec]:
        """The adapter tensors a step moves, by name (what an nccl-style ``update_info`` is held against)."""
        assert self.plan is not None
        return {s.name: s for s in self.plan.specs}

    def begin(self) -> None:
        self.save_slots()

    def finish(self, version: int) -> None:
        self.version, self.saved = version, None

    def abort(self) -> None:
        self.restore_slots()

    def save_slots(self) -> None:
        """Before any byte lands: save the slot bytes the step overwrites."""
        self.saved = [v.clone() for v in self.views()]

    def restore_slots(self) -> None:
        """Put back the slot bytes saved when the step began (the previous version serves)."""
        if self.saved is not None:
            with torch.no_grad():
                for view, old in zip(self.views(), self.saved):
                    view.copy_(old)
        self.saved = None


__all__ = ["AdapterSlots", "SlotBox", "SlotPlan"]

"""What a model may do to one of its tensors behind refit's back between two steps (rebind it, ``set_()`` it,
resize or free its storage), and what the next step's error must then say on every rank
(``refit_core/endpoints/binding.py`` checks before every step). Shared by ``test_bound_memory.py`` and the
fault campaign's memory strikes (``memory_strikes.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from refit_core import Side


class Change(StrEnum):
    """What a rank's model does to one of its tensors between two steps. The tensor keeps its values (in other
    memory) unless its storage is freed: a stale send or a write into memory the model left would look right."""

    REBIND = "rebind"
    """``tensor.data = new_tensor``."""
    SET = "set"
    """``tensor.set_(new_tensor)``."""
    RESIZE = "resize"
    """Its storage resized (reallocated at twice the size, its bytes kept)."""
    FREE = "free"
    """Its storage freed (``untyped_storage().resize_(0)``, as FSDP frees unsharded parameters)."""
    FREE_REBIND = "free_rebind"
    """Its storage freed, then the tensor rebound to new memory of the same size, allocated right after the free
    (an allocator may hand back the freed address: FSDP's next all-gather)."""


def strike(tensor: torch.Tensor, change: Change) -> None:
    """Apply ``change`` to ``tensor``, in place of the object (the model still holds the same tensor object)."""
    if change is Change.FREE:
        tensor.untyped_storage().resize_(0)
    elif change is Change.RESIZE:
        tensor.untyped_storage().resize_(2 * tensor.untyped_storage().nbytes())
    elif change is Change.FREE_REBIND:
        kept = tensor.detach().clone()
        tensor.untyped_storage().resize_(0)
        fresh = torch.empty_like(kept)
        fresh.copy_(kept)
        tensor.data = fresh
    elif change is Change.SET:
        tensor.set_(tensor.detach().clone())
    else:
        tensor.data = tensor.detach().clone()


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes of storage ``tensor`` needs (up to its last element; it is contiguous)."""
    return (tensor.storage_offset() + tensor.numel()) * tensor.element_size()


def heal(tensor: torch.Tensor) -> None:
    """Give a tensor whose storage was freed memory again (its values undefined), as FSDP does before its next
    use; nothing for any other tensor."""
    if tensor.untyped_storage().nbytes() == 0:
        tensor.untyped_storage().resize_(nbytes(tensor))


@dataclass(frozen=True)
class MemoryFault:
    """One bound tensor changed on one side, as every rank's step error must name it."""

    tensor: str
    """The name refit knows it by (its plugin's ``refit_model_tensors`` name, else its piece's)."""
    side: Side
    change: Change
    nbytes: int
    """Its storage's size before the change."""

    @property
    def says(self) -> str:
        """What the error says changed."""
        if self.change is Change.RESIZE:
            return f"storage resized from {self.nbytes} to {2 * self.nbytes} bytes"
        return "storage freed" if self.change in (Change.FREE, Change.FREE_REBIND) else "storage replaced"

    def named_in(self, message: str) -> bool:
        """Whether ``message`` names the tensor, its side and what changed."""
        role = "source" if self.side is Side.TRAIN else "destination"
        return all(part in message for part in (f"{role} tensor {self.tensor} ", f"(on the {self.side} side: ",
                                                self.says))


__all__ = ["Change", "MemoryFault", "heal", "nbytes", "strike"]

"""What a failed step leaves behind, and the two ways a destination can take a step.

- :attr:`UpdateMode.IN_PLACE` (the default, the fast path): bytes land straight in engine memory as
  they arrive. A step that fails part-way leaves some destination tensors new (or half new) and the
  rest old; the error lists exactly which were touched, the engine's weight version is not advanced,
  and the gen plugin's ``refit_abort_update`` is told, so it restores them or refuses to serve them
  until the next successful refit.
- :attr:`UpdateMode.STAGED`: every byte of the step lands in a staging buffer first (extra memory on
  each gen rank: the bytes that rank receives per step); only once the whole step landed on *every*
  gen rank (they agree through the rendezvous) is it copied into engine memory. A failed step leaves
  every destination exactly as it was: old or new, never a mix.
"""

from __future__ import annotations

from dataclasses import dataclass

from refit_core.contract.errors import TransferError
from refit_core.contract.options import UpdateMode


@dataclass(frozen=True)
class StepFailure:
    """A failed step on one gen rank: why, and which destination tensors it touched.

    ``torn`` names the logical (HF, experts grouped) tensors whose engine memory this step may have
    written, partly or wholly: they hold neither the old nor the new version for certain. Empty
    means every destination still holds its previous weights.
    """

    step: int
    mode: UpdateMode
    reason: str
    torn: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not self.torn


class StepFailedError(TransferError):
    """A step failed; ``failure`` says which destination tensors (if any) it left torn."""

    def __init__(self, message: str, failure: StepFailure) -> None:
        super().__init__(message)
        self.failure = failure

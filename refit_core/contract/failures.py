"""What a failed step leaves behind, and the two ways a destination can take a step.

- :attr:`UpdateMode.IN_PLACE` (the default, the fast path): bytes land straight in engine memory as
  they arrive. A step that fails part-way leaves some destination tensors new (or half new) and the
  rest old; the error lists exactly which were touched, the engine's weight version is not advanced,
  and the gen plugin's ``refit_abort_update`` is told, so it restores them or refuses to serve them
  until the next successful refit.
- :attr:`UpdateMode.STAGED`: every byte of the step lands in a staging buffer first (extra memory on
  each gen rank: the bytes that rank receives per step); only once the whole step landed on *every*
  gen rank (every gen rank votes, train rank 0 decides: :mod:`refit_core.endpoints.commit`) is it
  copied into engine memory. A failed step leaves every destination exactly as it was: old or new,
  never a mix; a rank that cannot learn the decision keeps its old weights and refuses to serve.
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
    undecided: bool = False
    """True when this rank could not learn train rank 0's decision on a staged step (the store's host
    stopped or died): it kept its previous weights, but other gen ranks may have applied the step, so
    its engine must not serve until the next successful step. False: the decision was read, or none
    was needed."""

    @property
    def clean(self) -> bool:
        """True when the step wrote no destination tensor of this rank."""
        return not self.torn


class StepFailedError(TransferError):
    """A step failed; ``failure`` says which destination tensors (if any) it left torn."""

    def __init__(self, message: str, failure: StepFailure) -> None:
        super().__init__(message)
        self.failure = failure

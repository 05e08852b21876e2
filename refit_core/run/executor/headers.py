"""The step header: the first exchange of every step, which proves both ends run the same plan, step and subset.

Each rank sends every peer ``[magic, fingerprint, version, step, subset digest, subset size]`` and checks
theirs before any byte of the step moves, so a mismatch is an error on both ends, never a wrong byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.contract.errors import TransferError
from refit_core.net.transport import Fence
from refit_core.plan.subset import WHOLE
from refit_core.run.lanes import current_work

MAGIC = 0x52454649  # "REFI"
HEADER_WORDS = 6

Pairs = Sequence[tuple[int, torch.Tensor]]
Exchange = Callable[[Pairs, Pairs, Sequence[Fence]], Fence]
"""Posts one control exchange ``(sends, recvs, after)`` on the executor's transport."""


@dataclass(frozen=True)
class SubsetTag:
    """Which part of the plan a step moves, as its header says: the subset's digest and tensor count
    (digest :data:`~refit_core.plan.subset.WHOLE`: the whole plan)."""

    digest: int = WHOLE
    size: int = 0

    def describe(self) -> str:
        """How an error names this part of the plan."""
        if self.digest == WHOLE:
            return "the whole plan"
        return f"a subset of {self.size} tensor(s) (digest {self.digest:x})"


WHOLE_PLAN = SubsetTag()

Explain = Callable[[SubsetTag, SubsetTag], str]
"""Names what a peer's subset (first) moves that this rank's (second) does not, and the reverse."""


@dataclass(frozen=True)
class HeaderScope:
    """What an executor's headers claim, and to whom they go; fixed when the executor is made."""

    subset: SubsetTag = WHOLE_PLAN
    """The part of the plan the executor's rounds move."""
    peers: tuple[int, ...] | None = None
    """The peers the headers go to (None: the executor's own): a subset's executor talks to every peer of the
    whole schedule, so that two ends running different subsets both find out."""
    explain: Explain | None = None
    """Adds what differs to a subset mismatch's error (None: the digests alone)."""


class SubsetMismatchError(TransferError):
    """The two ends of a pair run different subsets in one step (:mod:`refit_core.plan.subset`): found in
    the step's headers, before any byte of the step moves."""


@dataclass
class HeaderMemory:
    """Where a step's header exchange lives, kept from step to step: one tensor on the device, this rank's
    header in its first row (``mine``) and the peers' in the rows after it (``theirs``, one each in
    ``their_rows``: views made once, not in every step). On CUDA this rank's words are written into
    ``staged`` (pinned host memory) through its numpy view ``staged_words``, then copied to ``mine``."""

    mine: torch.Tensor
    theirs: torch.Tensor
    their_rows: tuple[torch.Tensor, ...]
    staged: torch.Tensor | None
    staged_words: Any
    written: tuple[int, ...] | None = None
    """The words row 0 holds (None: none yet)."""
    copied: Fence | None = None
    """Completion of the copy that wrote them, when it was queued during the step before (else None)."""

    @classmethod
    def make(cls, peers: int, device: torch.device) -> HeaderMemory:
        rows = torch.empty((1 + peers, HEADER_WORDS), dtype=torch.int64, device=device)
        staged = torch.empty(HEADER_WORDS, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else None
        theirs = rows[1:]
        return cls(rows[0], theirs, tuple(theirs.unbind()), staged, None if staged is None else staged.numpy())


@dataclass(frozen=True)
class PostedHeaders:
    """One step's header exchange in flight: its fence, the peers, and the memory it lives in (kept until
    the fence completes)."""

    fence: Fence
    peers: list[int]
    memory: HeaderMemory


class StepHeaders:
    """The header exchange of one executor: posts this rank's header, checks the peers', and writes the
    next step's header while the current step's bytes move.

    ``fingerprint`` is the plan's; ``own_peers`` the executor's peers (ranks within the other side,
    ``peer_offset`` added for the transport).
    """

    def __init__(self, fingerprint: str, device: torch.device, peer_offset: int, scope: HeaderScope,
                 own_peers: list[int]) -> None:
        self.fingerprint = int(fingerprint[:15], 16)
        self.device = device
        self.peer_offset = peer_offset
        self.scope = scope
        self.peers = own_peers if scope.peers is None else list(scope.peers)
        self._memory: dict[int, HeaderMemory] = {}
        """The header exchange's memory, by number of peers (each step reuses it)."""
        if self.peers:  # at setup, not inside the first step (a gen rank binds at its first step)
            self._memory_for(len(self.peers))

    def post(self, exchange: Exchange, version: int, step: int, pending: str,
             peers: Sequence[int] | None = None) -> tuple[PostedHeaders | None, Fence]:
        """Send this rank's header to each peer (default: :attr:`peers`) and post the receives of theirs (None
        without peers); the step's other host work runs while they travel. Also returns the fence every
        operation of the step waits for: the caller's ``pending`` work on its current stream, then the header's
        copy."""
        if peers is None:
            peers = self.peers
        if not peers:
            return None, current_work(self.device, pending)
        memory = self._memory_for(len(peers))
        words = self._words(version, step)
        if memory.written != words:  # else written while the last step's bytes moved
            self._write(memory, words)
        ready = current_work(self.device, pending)  # queued after a copy written now: one event covers both
        after = [ready] if memory.copied is None else [ready, memory.copied]
        offset, mine = self.peer_offset, memory.mine
        fence = exchange([(p + offset, mine) for p in peers],
                         [(p + offset, row) for p, row in zip(peers, memory.their_rows)], after)
        return PostedHeaders(fence, list(peers), memory), ready

    def check(self, posted: PostedHeaders | None, version: int, step: int, seconds_left: Callable[[], float]
              ) -> int:
        """Wait (``seconds_left()``: of the step's deadline) for the peers' headers and check them: same plan, step and
        subset, one version among them; returns that version (``version`` without peers)."""
        if posted is None:
            return version
        posted.fence.synchronize(seconds_left())
        ours = self.scope.subset
        versions = set()
        for peer, header in zip(posted.peers, posted.memory.theirs.tolist()):
            magic, fp, peer_version, their_step, digest, size = header
            if magic != MAGIC or fp != self.fingerprint or their_step != step:
                raise TransferError(
                    f"peer rank {peer + self.peer_offset} runs a different refit plan or step "
                    f"(fingerprint {fp:x} step {their_step} vs ours {self.fingerprint:x} step {step}); "
                    "both sides must call setup() with the same models and options")
            theirs = SubsetTag(digest, size)
            if theirs != ours:
                explain = self.scope.explain
                explained = "" if explain is None else f" ({explain(theirs, ours)})"
                raise SubsetMismatchError(
                    f"peer rank {peer + self.peer_offset} moves {theirs.describe()} in this step, this rank "
                    f"{ours.describe()}{explained}: both sides must name the same tensors "
                    "(send(only=...) on every train rank, receive(only=...) on every gen rank); nothing of the "
                    "step moved")
            versions.add(peer_version)
        if len(versions) > 1:
            raise TransferError(f"train ranks sent different weight versions {sorted(versions)} in one step: "
                                "every train rank must call send() with the same version")
        return versions.pop()

    def prepare_next(self, version: int, step: int) -> None:
        """While step ``step``'s bytes move, write the next step's header as it most likely reads (version
        ``version + 1`` from a sender, the same subset), so that the next step sends it without a copy
        first; a next step that differs writes its own (:meth:`post`)."""
        memory = self._memory.get(len(self.peers))
        if memory is None:
            return
        self._write(memory, self._words(version + 1 if version >= 0 else version, step + 1))
        if memory.staged is not None:  # the next step's exchange may wait on another current stream
            memory.copied = current_work(self.device, "the next header's copy")

    def _words(self, version: int, step: int) -> tuple[int, ...]:
        subset = self.scope.subset
        return (MAGIC, self.fingerprint, version, step, subset.digest, subset.size)

    def _write(self, memory: HeaderMemory, words: tuple[int, ...]) -> None:
        """Write ``words`` into ``memory.mine`` (on CUDA through pinned memory, on the current stream: the
        header exchange that last read them has completed)."""
        if memory.staged is not None:
            memory.staged_words[:] = words
            memory.mine.copy_(memory.staged, non_blocking=True)
        else:
            memory.mine.copy_(torch.tensor(words, dtype=torch.int64))
        memory.written = words
        memory.copied = None

    def _memory_for(self, peers: int) -> HeaderMemory:
        """The header exchange's memory for ``peers`` peers, made once."""
        memory = self._memory.get(peers)
        if memory is None:
            memory = self._memory[peers] = HeaderMemory.make(peers, self.device)
        return memory


__all__ = ["HEADER_WORDS", "MAGIC", "WHOLE_PLAN", "Explain", "HeaderScope", "PostedHeaders", "StepHeaders",
           "SubsetMismatchError", "SubsetTag"]

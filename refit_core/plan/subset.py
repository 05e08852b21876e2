"""Sub-schedules: one step that moves only some of the plan's logical tensors.

A :class:`Subset` names logical tensors (the plan's names: a grouped expert tensor by its group name).
Each rank derives its sub-schedule from its own part of the static schedule, without talking to
anyone: every message keeps only the segments of the named tensors (a quantized segment keeps its
scales), laid back to back again from offset 0 with the schedule's alignment (values, then scales), so
the bytes on the wire are one contiguous buffer per message as in a whole step; messages left empty,
and then rounds left empty, are dropped. Both ends of a pair hold the same messages and decide per
segment by the same logical name, so they derive the same sub-messages; rounds keep their order, so the
ordering rules of the whole schedule (every rank walks its rounds in increasing order) hold for the
sub-schedule.
:class:`SubSchedules` derives each subset once and keeps it (keyed by its digest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import ExpertName
from refit_core.plan.items import Message, Segment, align

WHOLE = 0
"""The subset digest of a whole step (every tensor of the plan)."""


@dataclass(frozen=True)
class Subset:
    """The logical tensors one step moves (``names``), and ``digest``: a 62-bit fingerprint of the
    sorted names that both sides compare before any byte moves (never :data:`WHOLE`)."""

    names: frozenset[str]
    digest: int

    @classmethod
    def of(cls, names: Iterable[str]) -> Subset:
        """The subset of ``names`` (at least one)."""
        frozen = frozenset(names)
        if not frozen:
            raise ValueError("a subset names at least one tensor (name none to move the whole plan)")
        h = hashlib.sha256("\n".join(sorted(frozen)).encode())
        return cls(frozen, int(h.hexdigest()[:16], 16) >> 2 or 1)

    def __len__(self) -> int:
        return len(self.names)

    def describe(self, shown: int = 4) -> str:
        """``3 tensors (a, b, c)``: the size and the first names, for errors."""
        names = sorted(self.names)
        more = " ..." if len(names) > shown else ""
        return f"{len(names)} tensor(s) ({', '.join(names[:shown])}{more}; digest {self.digest:x})"


SHOWN = 6
"""How many names an error about a subset lists (per side, for two subsets)."""


def listed(names: Iterable[str]) -> str:
    """The first :data:`SHOWN` of ``names`` in order, then `` ...`` if there are more."""
    shown = list(names)
    return ", ".join(shown[:SHOWN]) + (" ..." if len(shown) > SHOWN else "")


def logical_name(name: str, namer: Callable[[str], ExpertName | None], groups: Mapping[str, int]) -> str:
    """The plan's name of HF tensor ``name``: its grouped tensor (one of ``groups``) for an expert, else itself."""
    expert = namer(name)
    return expert.group if expert is not None and expert.group in groups else name


def subset_of(names: Iterable[str], namer: Callable[[str], ExpertName | None], groups: Mapping[str, int],
              known: Collection[str] | None = None) -> Subset:
    """The :class:`Subset` a step naming ``names`` (HF names) moves: per-expert names fold into their
    grouped tensor (``groups``: each grouped tensor's expert count), which must then be named whole;
    names outside ``known`` (the plan's logical tensors; None: not known here) are refused.
    :class:`RefitError` names the group or the tensors."""
    logical: set[str] = set()
    members: dict[str, set[int]] = {}
    for name in names:
        expert = namer(name) if isinstance(name, str) else None
        if expert is not None and expert.group in groups:
            members.setdefault(expert.group, set()).add(expert.index)
            logical.add(expert.group)
        else:
            logical.add(str(name))
    for group, indices in sorted(members.items()):
        missing = sorted(set(range(groups[group])) - indices)
        if missing:
            raise RefitError(f"the subset names {len(indices)} of the {groups[group]} experts of {group} (missing: "
                             f"{listed(map(str, missing))}); refit moves a grouped expert tensor whole: name all "
                             "its experts or none")
    unknown = sorted(logical - set(known)) if known is not None else []
    if unknown:
        raise RefitError(f"the subset names {len(unknown)} tensor(s) the plan does not move: {listed(unknown)}")
    try:
        return Subset.of(logical)
    except ValueError as exc:
        raise RefitError(str(exc)) from exc


def difference(theirs: int, peer: frozenset[str] | None, ours: int, mine: frozenset[str] | None) -> str:
    """What a peer's subset (digest ``theirs``, names ``peer`` if known) moves that this rank's (``ours``,
    ``mine``) does not, and the reverse, for the error of a step whose two ends disagree."""
    if theirs == WHOLE and mine is not None:
        return f"this rank moves only {listed(sorted(mine))}"
    if ours == WHOLE and peer is not None:
        return f"the peer moves only {listed(sorted(peer))}"
    if peer is None or mine is None:
        return "the peer's names are not known here"
    parts = [f"only the peer moves {listed(sorted(peer - mine))}" if peer - mine else "",
             f"only this rank moves {listed(sorted(mine - peer))}" if mine - peer else ""]
    return "; ".join(p for p in parts if p)


Keep = Callable[[Segment, Segment], bool]
"""Whether a segment moves in the sub-schedule, given its sender segment and its (value) receiver segment."""


def narrow_message(m: Message, keep: Keep) -> Message | None:
    """``m`` with only the kept segments, laid back to back (None: nothing kept; ``m`` itself: all kept)."""
    units: list[tuple[Segment, tuple[Segment, ...]]] = []
    targets = iter(m.dst_segments)
    for s in m.src_segments:  # a segment quantized on the sender lands as two: values, then scales
        units.append((s, (next(targets), next(targets)) if s.scales is not None else (next(targets),)))
    kept = [u for u in units if keep(u[0], u[1][0])]
    if len(kept) == len(units):
        return m
    if not kept:
        return None
    offsets = []  # the kept values back to back, then their scales (as the schedule lays them out)
    used = 0
    for _, ds in kept:
        offsets.append(align(used))
        used = offsets[-1] + ds[0].nbytes
    src: list[Segment] = []
    dst: list[Segment] = []
    for (s, ds), at in zip(kept, offsets):
        if s.scales is None:
            src.append(replace(s, offset=at))
            dst.append(replace(ds[0], offset=at))
            continue
        scales_at = align(used)
        used = scales_at + ds[1].nbytes
        src.append(replace(s, offset=at, scales=replace(s.scales, offset=scales_at)))
        dst += (replace(ds[0], offset=at), replace(ds[1], offset=scales_at))
    return Message(m.src, m.dst, used, tuple(src), tuple(dst))


def sub_rounds(rounds: Sequence[Sequence[Message]], keep: Keep) -> list[list[Message]]:
    """A rank's rounds narrowed to the kept segments (:func:`narrow_message`), empty rounds dropped."""
    out = []
    for msgs in rounds:
        narrowed = [n for n in (narrow_message(m, keep) for m in msgs) if n is not None]
        if narrowed:
            out.append(narrowed)
    return out


def keeping(subset: Subset, names: Sequence[str], *, sender: bool) -> Keep:
    """The :data:`Keep` of this rank: a segment moves if its local piece's name (``names[piece]``, the
    sender segment's piece on a train rank, the receiver segment's on a gen rank) is in ``subset``."""
    wanted = subset.names
    if sender:
        return lambda s, d: names[s.piece] in wanted
    return lambda s, d: names[d.piece] in wanted


class SubSchedules:
    """One rank's sub-schedules, derived once per subset and kept (a repeated subset is not derived again)."""

    def __init__(self, rounds: Sequence[Sequence[Message]], names: Sequence[str], *, sender: bool) -> None:
        self.rounds = rounds
        self.names = list(names)
        self.sender = sender
        self._cache: dict[int, list[list[Message]]] = {}
        self.derived = 0
        """How many subsets were derived (a cache hit derives nothing)."""

    def rounds_for(self, subset: Subset) -> list[list[Message]]:
        """This rank's rounds for ``subset``."""
        found = self._cache.get(subset.digest)
        if found is None:
            found = self._cache[subset.digest] = sub_rounds(self.rounds, keeping(subset, self.names,
                                                                                 sender=self.sender))
            self.derived += 1
        return found


def moved_bytes(rounds: Sequence[Sequence[Message]]) -> int:
    """The payload bytes of ``rounds`` (segments only, without alignment gaps), as the receiver writes them."""
    return sum(d.nbytes for msgs in rounds for m in msgs for d in m.dst_segments)


__all__ = ["SHOWN", "WHOLE", "Keep", "SubSchedules", "Subset", "difference", "keeping", "listed", "logical_name",
           "moved_bytes", "narrow_message", "sub_rounds", "subset_of"]

"""The setup protocol's store keys: every key refit's ranks write into the store is built, and parsed back, here.

Every process of one job must build the same strings, so they never change lightly. A rank's
store identity is ``SIDE/RANK`` (``"train/0"``); a per-rank key is ``KIND/SIDE/RANK``
(``"meta/gen/1"``), a side-wide key ``size/SIDE`` (its rank 0 publishes it), a step's landing
vote ``landed/STEP/gen/RANK``, its decision ``decision/STEP/train/0`` and each gen rank's report that it
settled the step ``settled/STEP/gen/RANK``, a rank's note that it failed a step ``failed/STEP/SIDE/RANK``,
a train rank's arrival at a merged-mode adapter gather ``gathered/STEP/train/RANK``, a colocated pair's
setup record ``colocated/SRC>DST/RECORD`` and the NCCL transport's ``nccl/gpu/RANK`` and
``nccl/{world/K,pair/I/J/K}/uid``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from refit_core.contract.side import Side

TRANSPORT_FAILED = "transport/failed"
"""Why the first rank that gave up on a step's transfer did (``RANK REASON``): ranks waiting on a live peer
that is itself stuck learn of the loss here (:mod:`refit_core.net.transport.watch`)."""
GONE_PREFIX = "gone/"
"""The store's host records a rank whose connection closed without a goodbye under ``gone/SIDE/RANK``."""

OPTIONS = "options"
"""Train rank 0's resolved options, which every other rank adopts."""
AGREED = "agreed"
"""The barrier every rank passes once it holds its part of the plan (:func:`barrier_keys`)."""


class RankRecord(StrEnum):
    """What a per-rank key holds; each rank publishes its own (the planner: every rank's ``PLAN``)."""

    META = "meta"
    """The rank's piece metadata."""
    PLACEMENT = "placement"
    """Where its memory lives (which link each of its pairs can use)."""
    PLAN = "plan"
    """Its part of the plan, published by the planner."""
    FINGERPRINT = "fingerprint"
    """The fingerprint of the plan it holds (the agreement barrier's arrival)."""
    DONE = "done"
    """It read a failed setup's error (the store's host lingers until every rank has)."""


class ColocatedRecord(StrEnum):
    """A colocated pair's setup record, written by its train rank, read once by its gen rank."""

    EXPORTS = "exports"
    """The shared memory of the train rank's source pieces."""
    CONTROL = "control"
    """The pair's mailbox page and the trainer's step event."""


@dataclass(frozen=True)
class RankId:
    """One rank of a refit: its side and its rank there. ``str()`` is its store identity (``"train/0"``)."""

    side: Side
    rank: int

    def __str__(self) -> str:
        return f"{self.side.value}/{self.rank}"

    @property
    def name(self) -> str:
        """How errors name it: ``"train rank 0"``."""
        return f"{self.side.value} rank {self.rank}"


@dataclass(frozen=True)
class BarrierKeys:
    """The two keys of one barrier: the arrivals' counter and the key the last arrival sets."""

    count: str
    all: str


def rank_key(record: RankRecord, who: RankId | str) -> str:
    """The key under which rank ``who`` (a :class:`RankId` or its store identity) publishes ``record``."""
    return f"{record.value}/{who}"


def rank_keys(record: RankRecord, sizes: Mapping[Side, int]) -> list[str]:
    """Every rank's ``record`` key, side by side in the order of ``sizes`` (each side's world size)."""
    return [rank_key(record, RankId(side, r)) for side, n in sizes.items() for r in range(n)]


def side_rank_keys(record: RankRecord, side: Side, size: int) -> list[str]:
    """The ``record`` keys of one side's ``size`` ranks, in rank order."""
    return [rank_key(record, RankId(side, r)) for r in range(size)]


def size_key(side: Side) -> str:
    """The key under which ``side``'s rank 0 publishes that side's world size."""
    return f"size/{side.value}"


def landed_key(step: int, gen_rank: int) -> str:
    """Gen rank ``gen_rank``'s vote on whether it landed step ``step``."""
    return f"landed/{step}/{RankId(Side.GEN, gen_rank)}"


def landed_keys(step: int, gen_size: int) -> list[str]:
    """Every gen rank's landing vote on step ``step``, in rank order."""
    return [landed_key(step, r) for r in range(gen_size)]


def decision_key(step: int) -> str:
    """The one decision on step ``step`` (train rank 0 writes it once every gen rank voted)."""
    return f"decision/{step}/{RankId(Side.TRAIN, 0)}"


def settled_key(step: int, gen_rank: int) -> str:
    """Gen rank ``gen_rank``'s report that it read the decision on ``step`` and what it did."""
    return f"settled/{step}/{RankId(Side.GEN, gen_rank)}"


def heard_key(step: int, train_rank: int) -> str:
    """Train rank ``train_rank``'s note that it read the commit decision on step ``step`` (train rank 0, the
    store's host, keeps the store up at ``close()`` until every other train rank wrote it)."""
    return f"heard/{step}/{RankId(Side.TRAIN, train_rank)}"


def failed_key(step: int, who: RankId) -> str:
    """Rank ``who``'s note that it failed step ``step`` and read why the first rank gave up (train rank 0,
    the store's host, keeps the store up until every rank wrote it: :func:`refit_core.endpoints.commit.linger`)."""
    return f"failed/{step}/{who}"


def gathered_key(step: int, train_rank: int) -> str:
    """Train rank ``train_rank``'s arrival at step ``step``'s gather of the LoRA adapters (merged mode)."""
    return f"gathered/{step}/{RankId(Side.TRAIN, train_rank)}"


def gathered_prefix(step: int) -> str:
    """The prefix of every train rank's :func:`gathered_key` of step ``step``."""
    return f"gathered/{step}/"


def subset_key(digest: int) -> str:
    """The names of the subset whose digest is ``digest`` (:mod:`refit_core.plan.subset`), offered by the
    first rank that moves it, for the error of a peer that moves another one."""
    return f"subset/{digest:x}"


def subset_verdict_key(digest: int) -> str:
    """Train rank 0's check of the subset whose digest is ``digest``: null if the plan moves it, else why
    not (the other train ranks refuse it with that reason)."""
    return f"subset/{digest:x}/verdict"


def step_prefixes(step: int) -> list[str]:
    """The prefixes of every key of step ``step``'s commit (votes, decision, settlements, train ranks' notes)."""
    return [f"{kind}/{step}/" for kind in ("landed", "decision", "settled", "heard")]


def colocated_key(src: int, dst: int, record: ColocatedRecord) -> str:
    """The ``record`` of the colocated pair (train rank ``src``, gen rank ``dst``)."""
    return f"colocated/{src}>{dst}/{record.value}"


NCCL_PREFIX = "nccl/"
"""The NCCL transport's keys live under this prefix (a ``PrefixStore``); the functions below build the rest."""


def nccl_gpu_key(rank: int) -> str:
    """Where refit rank ``rank`` publishes its GPU's UUID (ranks sharing a GPU need pairwise communicators)."""
    return f"gpu/{rank}"


def nccl_comm_key(pair: tuple[int, int] | None, index: int) -> str:
    """The ``index``-th communicator of every rank (``pair`` None) or of the two ranks ``pair``."""
    return f"world/{index}" if pair is None else f"pair/{pair[0]}/{pair[1]}/{index}"


def nccl_broadcast_key(members: tuple[int, ...], index: int) -> str:
    """The ``index``-th communicator of the broadcast group of global ranks ``members`` (its root first)."""
    return f"broadcast/{'.'.join(map(str, members))}/{index}"


def nccl_group_prefix(comm_key: str) -> str:
    """The prefix under which torch's NCCL process group for communicator ``comm_key`` keeps its own keys."""
    return f"{comm_key}/"


def nccl_unique_id_key(comm_key: str) -> str:
    """Where the first rank of communicator ``comm_key`` publishes NCCL's unique id."""
    return f"{comm_key}/uid"


def gone_key(who: RankId | str) -> str:
    """Where the store's host records that rank ``who`` (a :class:`RankId` or its store identity) left
    without a goodbye."""
    return f"{GONE_PREFIX}{who}"


def barrier_keys(name: str) -> BarrierKeys:
    """The keys of the barrier called ``name``."""
    return BarrierKeys(f"{name}/count", f"{name}/all")


def publisher(key: str) -> RankId | None:
    """The rank that publishes ``key``, or that a store identity names; None for any other key.

    ``done/gen/0``, ``landed/3/gen/0`` and ``gen/0`` -> gen rank 0; a side-wide ``size/gen`` -> gen rank 0.
    """
    parts = key.split("/")
    if parts[-1] in tuple(Side):
        return RankId(Side(parts[-1]), 0)
    if len(parts) >= 2 and parts[-2] in tuple(Side) and parts[-1].isdigit():
        return RankId(Side(parts[-2]), int(parts[-1]))
    return None


def rank_name(key: str) -> str:
    """The rank that publishes ``key`` (or that a store identity names) as errors name it:
    ``"train/1"`` -> ``"train rank 1"``; ``key`` itself if no rank publishes it."""
    who = publisher(key)
    return key if who is None else who.name

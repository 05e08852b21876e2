"""Relay among engine replicas and within nodes (:class:`RelayOptions`, ``RefitOptions.relay``): which gen ranks
get part of their step from another gen rank instead of the trainers (:mod:`refit_core.plan.relay`)."""

from __future__ import annotations

from dataclasses import dataclass

from refit_core.contract.errors import OptionError
from refit_core.contract.settings import _setting, _Settings, _tracks_explicit
from refit_core.units import MiB


RELAY_COMMS_PER_LINK = 8
"""NCCL communicators per link when replicas relay: a relaying rank receives and forwards at once (4 x H200,
Llama-3-8B shape, 1 -> a chain of 3: 1.26x NCCL's broadcast of the same bytes with 4, 1.18x with 8)."""


@_tracks_explicit
@dataclass(frozen=True)
class RelayOptions(_Settings):
    """Relay fanout (:mod:`refit_core.plan.relay`); both sides must agree (the plan depends on it).

    - ``replicas``: the gen ranks form this many identical replicas (consecutive equal blocks).
    - ``direct``: how many replicas the trainers feed (the relay tree's roots); 0 (the default) means all
      of them, i.e. no relay. With ``0 < direct < replicas`` the others get each message of the step from
      their parent replica as soon as it landed there (pipelined).
    - ``fanout``: replicas each holder forwards to (1: chains; 2 and more: a tree).
    - ``node_ranks``: gen ranks per node (consecutive ranks share a node); above 1, a destination
      region that several gen ranks of one node hold (norms a TP engine replicates, MLA's ``q_a`` /
      ``kv_a`` at high TP) is fed by the trainers to one of them and forwarded to the others over the
      node's links (0, the default: off). Not combined with replica relay (``direct``).
    - ``forward_min_bytes``: smaller shared regions are fed to every holder by the trainers (1 MiB):
      a norm rides along messages its holders get anyway, while forwarding it would have its leader
      hear from every sender that holds a slice of it.
    - ``chunk_bytes``: replica relay: relay messages travel in slices of at most this many bytes, each
      forwarded as soon as it landed (0, the default: whole rounds). ``refit plan --relay`` chooses it by
      simulation (deep chains over NICs want a few MiB; short chains on NVLink none).
    - ``slice_pieces``: with ``chunk_bytes``, each slice travels as this many operations of equal size (1,
      the default: one). NCCL runs one operation on one communicator, which fills a fraction of an NVLink
      link; a slice in as many pieces as the link has communicators spreads over all of them.
    - ``broadcast``: replica relay by collective: each message the trainers send to a rank of the first
      replica reaches that rank of every replica in one broadcast (NCCL pipelines it down a chain inside
      its kernels, with no host round trip per piece). Needs ``direct=1``; a transport without broadcasts
      of its own sends from the trainer to every replica (:meth:`Transport.broadcast
      <refit_core.net.transport.base.Transport.broadcast>`).

    Replica relay runs in place and staged; forwarding within nodes needs ``mode="in_place"`` (a leader
    forwards what landed in its engine memory). Both need network links between gen ranks (NCCL needs
    them on different GPUs).
    """

    replicas: int = _setting(1, int)
    direct: int = _setting(0, int)
    fanout: int = _setting(1, int)
    node_ranks: int = _setting(0, int)
    forward_min_bytes: int = _setting(1 * MiB, int)
    chunk_bytes: int = _setting(0, int)
    slice_pieces: int = _setting(1, int)
    broadcast: bool = _setting(False, bool)

    def __post_init__(self) -> None:
        self._coerce()
        others = (self.direct, self.node_ranks, self.forward_min_bytes, self.chunk_bytes)
        if self.replicas < 1 or self.fanout < 1 or self.slice_pieces < 1 or min(others) < 0:
            raise OptionError(f"RelayOptions(replicas={self.replicas}, direct={self.direct}, fanout={self.fanout}, "
                              f"node_ranks={self.node_ranks}, forward_min_bytes={self.forward_min_bytes}, "
                              f"chunk_bytes={self.chunk_bytes}, slice_pieces={self.slice_pieces}): replicas, "
                              "fanout and slice_pieces must be >= 1, the others >= 0")
        if self.broadcast and self.direct != 1:
            raise OptionError(f"RelayOptions(broadcast=True) needs direct=1 (every replica hears the trainers' "
                              f"messages in one broadcast), not direct={self.direct}")
        if self.fans_out and self.forwards_within_nodes:
            raise OptionError(f"RelayOptions: replica relay (direct={self.direct}) and forwarding within nodes "
                              f"(node_ranks={self.node_ranks}) cannot be combined; choose one")

    @property
    def fans_out(self) -> bool:
        """True when some replicas get the step from other replicas."""
        return 0 < self.direct < self.replicas

    @property
    def forwards_within_nodes(self) -> bool:
        """True when gen ranks of one node forward the regions they share to each other."""
        return self.node_ranks > 1

    @property
    def active(self) -> bool:
        """True when some gen rank gets part of its step from another gen rank."""
        return self.fans_out or self.forwards_within_nodes

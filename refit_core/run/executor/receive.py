"""The receiving direction: land each round straight in the weights where possible, unpack the rest; forwarding."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from refit_core.contract.failures import UpdateMode
from refit_core.net.transport import Fence, Transport
from refit_core.plan.items import Message, Segment
from refit_core.plan.relay import chunk_spans, piece_bytes, relay_slices
from refit_core.run.copies import StagingCopies
from refit_core.run.executor.base import ExecutorSettings, RoundRunner, StepCount, StepStats
from refit_core.run.executor.headers import HeaderScope, PostedHeaders, StepHeaders
from refit_core.run.executor.rounds import buffer_views, pack
from refit_core.run.executor.send import SendExecutor
from refit_core.run.timing import Phase, Timeline

Pairs = list[tuple[int, torch.Tensor]]


class ReceiveExecutor(RoundRunner):
    """Runs a gen rank's rounds: receive (straight into the weights where possible), unpack the rest.

    In place, a step lands straight in the destinations. Staged, it lands in a step-wide staging buffer
    only; :meth:`commit` then writes the destinations, or :meth:`discard` drops it.

    A relaying rank (``forward_to``: the global ranks of its children in the relay tree,
    :mod:`refit_core.plan.relay`) sends every operation of a round on to each child as soon as that round
    landed here, ordered after its receive by the transport's fences (CUDA events: no host wait), while
    the next rounds still arrive. Its children receive the same operations, round for round; the step's
    header goes to them once this rank learned the version. With ``chunk_bytes``, relay messages travel in
    pieces of at most that size: a relayed rank (``relayed``: fed by its parent replica) receives each
    round in slices (:func:`~refit_core.plan.relay.relay_slices`) and forwards each slice once it landed;
    with ``slice_pieces``, each slice as that many operations (spread over the link's communicators).
    """

    _landed: tuple[torch.Tensor, list[int]] | None = None
    _commit_copies: StagingCopies | None = None
    """Staged mode: every round's copies from the step-wide buffer into the destinations, planned at the
    first commit (the buffer's layout is the same every step, its address need not be)."""

    def __init__(self, rounds: list[list[Message]], transport: Transport, peer_offset: int,
                 settings: ExecutorSettings, *, scope: HeaderScope = HeaderScope(), steps: StepCount | None = None,
                 forward_to: Sequence[int] = (), chunk_bytes: int = 0, slice_pieces: int = 1,
                 relayed: bool = False) -> None:
        super().__init__(rounds, transport, peer_offset, settings, scope=scope, steps=steps)
        self.forward_to = tuple(forward_to)
        self.chunk_bytes = chunk_bytes
        """Relay messages (to the children; from the parent when ``relayed``) in slices of at most this (0: whole)."""
        self.slice_pieces = slice_pieces
        """The operations each slice travels as."""
        self.relayed = relayed
        self._children = (StepHeaders(settings.fingerprint, self.device, 0, HeaderScope(), list(self.forward_to))
                          if self.forward_to else None)
        """The children's header exchange (None: this rank relays to none)."""
        self._unchecked: PostedHeaders | None = None
        """The children's headers of this step, posted and not yet checked."""
        self._held: tuple[Pairs, Fence] | None = None
        """CUDA: the last round received and not yet forwarded, and the fence of its receive."""
        if self.forward_to and self.device.type == "cuda":  # a round's buffer is read by the next round's exchange
            self.num_buffers = max(2, self.num_buffers)

    def _peer(self, m: Message) -> int:
        return m.src

    def _segments(self, m: Message) -> tuple[Segment, ...]:
        return m.dst_segments

    def run(self, version_hint: int = -1, *, touched: set[int] | None = None,
            timeline: Timeline | None = None) -> StepStats:
        """Receive one step. ``touched`` (the caller's, for its failure report) gathers the pieces that may
        have been written, also when this raises (None: not gathered); ``timeline`` records the step's spans
        (None: not recorded)."""
        touched = set() if touched is None else touched
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        self._landed, self._held = None, None
        self._begin(timeline)
        headers, ready = self._post_headers(version_hint, "the engine's pending work")
        if self.mode is UpdateMode.STAGED:
            version = self._check_headers(headers, version_hint, deadline)
            self._post_children_headers(version)
            return self._run_staged(version, version_hint, start, deadline, ready)
        buffers = self._buffers()
        version = self._check_headers(headers, version_hint, deadline)
        self._post_children_headers(version)
        free: list[list[Fence]] = [[] for _ in range(len(buffers))]
        pending: list[Fence] = []
        staged, last_slot = 0, None
        for index, plan in enumerate(self.plans):
            touched |= plan.direct_pieces
            slot = None
            if not plan.staged_bytes:  # straight into the weights: after the engine's pending work
                fences = self._receive_round(plan.pairs(None), [ready], index, deadline)
            else:
                slot = staged % len(buffers)
                staged += 1
                buffer = buffers[slot]
                previous = free[slot]
                for fence in previous:
                    self._settle(fence, deadline)
                fences = self._receive_round(plan.pairs(buffer), [ready, *previous], index, deadline)
                received = fences[0]
                self._settle(received, deadline)
                touched |= plan.staged_pieces
                assert plan.copies is not None
                fences.append(self.lane.run(partial(plan.copies.run, buffer), after=[received],
                                            mark=self._mark(Phase.UNPACK, index)))
                free[slot] = list(fences)
            if last_slot is not None and self._held is not None:  # this exchange forwards from the last slot
                free[last_slot].append(fences[0])
            last_slot = slot
            pending += fences
        pending += self._flush_forwards(deadline)
        self.headers.prepare_next(version_hint, self.step)
        self._finish(pending, deadline)
        self._end()
        stats = self._stats(version, start, buffers)
        del buffers, free, pending
        return stats

    def _run_staged(self, version: int, version_hint: int, start: float, deadline: float, ready: Fence
                    ) -> StepStats:
        """Every round's messages into one step-wide buffer; the destinations are not touched."""
        offsets, total = [], 0
        for plan in self.plans:
            offsets.append(total)
            total += plan.staged_bytes
        buffer = self.lane.allocate(total, self.device)
        pending: list[Fence] = []
        for index, (plan, off) in enumerate(zip(self.plans, offsets)):
            if plan.posts:
                pending += self._receive_round(plan.pairs(buffer[off:off + plan.staged_bytes]), [ready], index,
                                               deadline)
        pending += self._flush_forwards(deadline)
        self.headers.prepare_next(version_hint, self.step)
        self._finish(pending, deadline)
        self._end()
        self._landed = (buffer, offsets)
        stats = self._stats(version, start, [])
        stats.staging_bytes = total
        return stats

    def _post_children_headers(self, version: int) -> None:
        """A relaying rank: send this step's header (the trainers' ``version``) to its children and post the
        receives of theirs, checked before the first forward."""
        if self._children is not None:
            self._unchecked, _ = self._children.post(self._exchange_header, version, self.step,
                                                     "the engine's pending work")

    def _receive_round(self, pairs: Pairs, after: list[Fence], index: int, deadline: float) -> list[Fence]:
        """Post round ``index``'s receives (``pairs``) after ``after``; the first fence returned is theirs.

        A relaying rank forwards each round (or each slice of it, :attr:`chunk_bytes`) as it received it. On
        the host path a slice's forward goes out once it landed, on its own. On CUDA it goes out in one
        exchange with the next slice's receives (the step's last one after the step, :meth:`_flush_forwards`),
        ordered after its own receives by their event: sharing NCCL groups, both directions of the rank's
        links move at once, where a forward posted alone would wait on its stream for the receive before it
        and the receive after it for the forward. Each slice's exchange waits for the one before, so the
        last fence covers the round."""
        if self._children is None:
            return [self._exchange([], self._pieces(pairs) if self.relayed else pairs, after, index)]
        self._check_children(deadline)
        slices = self._slices(pairs) if self.relayed else [pairs]
        if self.device.type != "cuda":
            forwards: list[Fence] = []
            received = after[0]  # replaced: there is at least one slice
            for piece in slices:
                received = self._exchange([], piece, after, index)
                self._settle(received, deadline)
                forwards.append(self._exchange(self._to_children(piece), [], [received], index, Phase.FORWARD))
            return [received, *forwards]
        fence = after[0]  # replaced: there is at least one slice
        for piece in slices:
            held, self._held = self._held, None
            if held is None:
                fence = self._exchange([], piece, after, index)
            else:
                fence = self._exchange(self._to_children(held[0]), piece, [*after, held[1]], index, Phase.FORWARD)
            self._held = (piece, fence)
        return [fence]

    def _flush_forwards(self, deadline: float) -> list[Fence]:
        """CUDA: forward the step's last round, held back by :meth:`_receive_round` (empty: nothing held)."""
        held, self._held = self._held, None
        if held is None:
            return []
        return [self._exchange(self._to_children(held[0]), [], [held[1]], len(self.plans) - 1, Phase.FORWARD)]

    def _to_children(self, pairs: Pairs) -> Pairs:
        return [(child, tensor) for child in self.forward_to for _, tensor in self._pieces(pairs)]

    def _pieces(self, pairs: Pairs) -> Pairs:
        """``pairs`` cut in the relay's pieces (:func:`~refit_core.plan.relay.chunk_spans`), in order."""
        if not self.chunk_bytes:
            return pairs
        cut = piece_bytes(self.chunk_bytes, self.slice_pieces)
        return [(peer, _bytes_of(tensor)[start:end]) for peer, tensor in pairs
                for start, end in chunk_spans(tensor.nbytes, cut)]

    def _slices(self, pairs: Pairs) -> list[Pairs]:
        """A relayed round's receives in the slices its parent forwards (one slice: the whole round)."""
        if not self.chunk_bytes or not pairs:
            return [pairs]
        return [[(pairs[p.message][0], _bytes_of(pairs[p.message][1])[p.start:p.end]) for p in piece]
                for piece in relay_slices([tensor.nbytes for _, tensor in pairs], self.chunk_bytes,
                                          self.slice_pieces)]

    def _check_children(self, deadline: float) -> None:
        """Before the step's first forward: check the children's headers (same plan and step)."""
        if self._unchecked is not None:
            posted, self._unchecked = self._unchecked, None
            assert self._children is not None
            self._children.check(posted, -1, self.step, lambda: self._remaining(deadline))

    def commit(self, touched: set[int] | None = None) -> None:
        """Staged mode: copy the landed step into the destinations, adding them to ``touched`` first (in
        place: nothing is left to do)."""
        if self._landed is None:
            return
        buffer, offsets = self._landed
        self._landed = None
        if self._commit_copies is None:
            shifted = [dataclasses.replace(seg, offset=seg.offset + off)
                       for plan, off in zip(self.plans, offsets) for seg in plan.segments]
            self._commit_copies = StagingCopies([view for plan in self.plans for view in plan.views],
                                                buffer_views(buffer, shifted), into_buffer=False)
        if touched is not None:
            for plan in self.plans:
                touched |= plan.staged_pieces
        self.lane.run(partial(self._commit_copies.run, buffer)).synchronize(self.timeout_s)

    def discard(self) -> None:
        """Staged mode: drop a landed step without touching the destinations."""
        self._landed = None


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous message tensor as its flat bytes."""
    return tensor.reshape(-1).view(torch.uint8)


class ForwardExecutor:
    """Runs a gen rank's forwarding within its node (:mod:`refit_core.plan.relay`) after its own step landed.

    ``rounds`` are every round of the forwarding plan, each with this rank's messages of both
    directions (empty where it has none). Each round's sends (from this rank's destinations, which
    hold the step) and receives (into them) are posted as one exchange, so that two ranks forwarding
    to each other never wait on each other; rounds run one after another, staged parts packed and
    unpacked synchronously (the forwarded regions are small beside the step).
    """

    def __init__(self, rank: int, rounds: list[list[Message]], transport: Transport, peer_offset: int,
                 *args: Any, **kwargs: Any) -> None:
        """``args`` and ``kwargs``: the :class:`RoundRunner` settings both directions share."""
        self.receives = ReceiveExecutor([[m for m in msgs if m.dst == rank] for msgs in rounds], transport,
                                        peer_offset, *args, **kwargs)
        kwargs["steps"] = self.receives.steps  # one step count: a forwarded step is one step both ways
        self.sends = SendExecutor([[m for m in msgs if m.src == rank] for msgs in rounds], transport, peer_offset,
                                  *args, **kwargs)

    def bind(self, views: list[torch.Tensor]) -> None:
        self.sends.bind(views)
        self.receives.bind(views)

    def run(self, version: int, *, touched: set[int] | None = None) -> StepStats:
        """Forward one step; both directions' headers are checked first (fingerprint, step, version).
        ``touched`` gathers the destination pieces the forwarding may have written (also when it raises)."""
        touched = set() if touched is None else touched
        sends, receives = self.sends, self.receives
        start = time.perf_counter()
        deadline = time.monotonic() + receives.timeout_s
        peers = sorted(set(sends.peers()) | set(receives.peers()))
        headers, ready = receives._post_headers(version, "the engine's pending work", peers)
        version = receives._check_headers(headers, version, deadline)
        lane = receives.lane
        send_buffer = lane.allocate(sends.buffer_bytes, receives.device) if sends.buffer_bytes else None
        receive_buffer = lane.allocate(receives.buffer_bytes, receives.device) if receives.buffer_bytes else None
        for index, (out, into) in enumerate(zip(sends.plans, receives.plans)):
            if not out.posts and not into.posts:
                continue
            after = [ready]
            if out.staged_bytes:
                assert send_buffer is not None
                after.append(lane.run(partial(pack, send_buffer, out), after=[ready]))
            touched |= into.direct_pieces
            fence = receives._exchange(out.pairs(send_buffer if out.staged_bytes else None),
                                       into.pairs(receive_buffer if into.staged_bytes else None), after, index)
            fence.synchronize(receives._remaining(deadline))
            if into.staged_bytes:
                assert receive_buffer is not None and into.copies is not None
                touched |= into.staged_pieces
                lane.run(partial(into.copies.run, receive_buffer), after=[fence]).synchronize(
                    receives._remaining(deadline))
        stats = receives._stats(version, start, [])
        stats.bytes += sends.payload_bytes
        stats.staging_bytes = sum(b.numel() for b in (send_buffer, receive_buffer) if b is not None)
        return stats


__all__ = ["ForwardExecutor", "ReceiveExecutor"]

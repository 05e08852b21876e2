"""Colocated pairs: the receiver copies straight out of the trainer's memory (shared memory, CUDA IPC).

For a (train rank, gen rank) pair whose link reads peer memory (:mod:`refit_core.plan.links`)
nothing is packed or sent. At setup the train rank *exports* the storages of its source pieces (CPU:
moved into shared memory in place; CUDA: an IPC handle) and publishes them as JSON through the
rendezvous store; the gen rank opens them once. Every step then runs:

1. train rank (:meth:`ColocatedSender.post`): check that the exported memory is still the parameters'
   memory, record an interprocess CUDA event after the trainer's queued work, post a *ready* header
   (step, version, plan fingerprint, error) in each colocated peer's mailbox (one page of host shared
   memory per pair, :mod:`refit_core.net.transport.mailbox`: no network, no store per step); with
   ``RefitOptions(overlap_check=True)`` the header comes first, marked "verdict follows", and the
   check's verdict after it (the engine copies meanwhile and fails the step, torn, on a bad verdict);
2. gen rank (:meth:`ColocatedReceiver.start` / :meth:`~ColocatedReceiver.finish`): wait for every
   peer's header and check it, then copy every segment from the trainer's view straight into the
   engine's view (casting where the plan casts) as a :class:`~refit_core.run.copies.CopyProgram` resolved
   at bind time: neighbours merged, equal blocks stacked into one strided copy, small copies batched
   into multi-tensor launches (large strided copies as ``RefitOptions.strided_copies`` says); ordered
   after the trainer's event and the engine's queued work (segments the plan quantizes on the sender,
   FP8 destinations, are quantized by the gen rank straight from the trainer's memory after the
   copies, :class:`~refit_core.contract.spec.Quantization`); wait for it (and any verdict), publish *done*;
3. train rank (:meth:`ColocatedSender.wait`): wait for every peer's *done* before ``send`` returns.

No staging memory on either side, casts included: one read and one write of every byte, which is
the bound of any copy (a source region is always a strided view of the trainer's memory; what an
engine must post-process, such as a quantized layer, takes the loader path into the engine's own
buffers). The same
plan, fingerprint and step counting as the network path; setup records are JSON, step headers plain
integers (never pickle).

What the trainer must keep: between ``setup()`` and ``close()``, every parameter a source piece views
must stay in the memory it had at setup. Freeing it (``untyped_storage().resize_(0)``, as FSDP does
with unsharded parameters), replacing it (``param.data = ...``) or moving it (offloading to the host)
is detected at the next ``send`` and fails that step on both sides with an error naming the tensor;
in-place updates (optimizer steps, ``copy_``) are what refit expects. Refit's references keep the
exported memory alive until ``close()`` (torch's IPC reference counting also keeps a CUDA block from
being reused while a receiver has it open), so a mistake yields an error, never garbage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist

from refit_core.contract.errors import RefitError, TransferError
from refit_core.contract.options import StridedCopy
from refit_core.net.keys import ColocatedRecord, colocated_key
from refit_core.net.transport.base import Fence
from refit_core.net.transport.mailbox import GPU_SPIN_S, SPIN_S, Mailbox
from refit_core.net.transport.memory import (
    SharedStorage,
    SharedView,
    StepEvent,
    decode_exports,
    encode_exports,
    export_storage,
    open_storage,
)
from refit_core.plan.items import Message, Segment
from refit_core.run.copies import CopyCounts, CopyProgram
from refit_core.run.lanes import EventFence, Lane, StreamLane, current_work, lane_for
from refit_core.run.quant.batched import QuantizeInto, TensorsToQuantize
from refit_core.run.quant.fast import default_quantizer
from refit_core.run.timing import StepTrace

MAGIC = "refit-colocated"


class _Channel:
    """Setup records between the two ranks of colocated pairs (JSON, through the rendezvous store)."""

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        # keys are whole (net.keys.colocated_key), not under torch's PrefixStore: refit's own store is a
        # Python dist.Store, whose methods (delete_key among them) torch's C++ wrappers do not all reach
        self.store = store
        self.timeout_s = timeout_s

    def put(self, key: str, value: dict | bytes) -> None:
        try:
            self.store.set(key, value if isinstance(value, bytes) else json.dumps(value).encode())  # type: ignore[arg-type]
        except Exception as exc:
            raise TransferError(f"lost the refit rendezvous (train rank 0 hosts it): {exc}") from exc

    def take(self, key: str, what: str, *, delete: bool = True) -> bytes:
        """The value of ``key`` once it exists (then removed); :class:`TransferError` after the timeout."""
        try:
            raw = self.store.get(key)  # waits up to the store's timeout, the refit's timeout_s
            if delete:
                self.store.delete_key(key)
        except Exception as exc:
            raise TransferError(f"{what} did not arrive within {self.timeout_s:.0f} s (a peer died or "
                                f"hung): {exc}") from exc
        return raw

    def take_json(self, key: str, what: str) -> dict:
        raw = self.take(key, what)
        try:
            value = json.loads(raw.decode())
        except ValueError as exc:
            raise TransferError(f"{what} is not valid JSON: {exc}") from exc
        if not isinstance(value, dict) or value.get("magic") != MAGIC:
            raise TransferError(f"{what} is not a refit colocated header")
        return value


class _ColocatedPairs:
    """What both ends of a rank's colocated pairs hold: its messages by peer, the setup channel, the
    plan's fingerprint, the step count, the peers' mailboxes and the step trace."""

    def __init__(self, messages: dict[int, list[Message]], store: dist.Store, rank: int,
                 device: torch.device, fingerprint: str, timeout_s: float, trace: bool) -> None:
        self.messages = messages
        self.channel = _Channel(store, timeout_s)
        self.rank = rank
        self.device = device
        self.fingerprint = fingerprint
        self._fingerprint_word = int(fingerprint[:15], 16)
        self.timeout_s = timeout_s
        self.step = 0
        self.nbytes = sum(m.nbytes for msgs in messages.values() for m in msgs)
        self._tracing = trace
        self.trace: StepTrace | None = None
        """This step's :class:`~refit_core.run.timing.StepTrace` (with ``trace=True``; else None)."""
        self._mailboxes: dict[int, Mailbox] = {}
        self._spin_s = GPU_SPIN_S if device.type == "cuda" else SPIN_S

    @property
    def peers(self) -> list[int]:
        return sorted(self.messages)


class ColocatedSender(_ColocatedPairs):
    """A train rank's colocated pairs: exports its memory once, then posts a header per step."""

    def __init__(self, messages: dict[int, list[Message]], store: dist.Store, rank: int,
                 device: torch.device, fingerprint: str, timeout_s: float, trace: bool = False) -> None:
        super().__init__(messages, store, rank, device, fingerprint, timeout_s, trace)
        self._storages: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, data_ptr, nbytes
        self._owners: list[str] = []  # a tensor name per exported storage, for errors
        self._event: StepEvent | None = None

    def export(self, views: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        """Export the storages of every piece a colocated message reads and publish them (once)."""
        used = sorted({seg.piece for msgs in self.messages.values() for m in msgs for seg in m.src_segments})
        exported: list[SharedStorage] = []
        index_of: dict[int, int] = {}  # storage data_ptr (after export) -> index
        shared: dict[int, SharedView] = {}
        for piece in used:
            view = views[piece]
            storage = view.untyped_storage()
            index = index_of.get(storage.data_ptr())
            if index is None:
                try:
                    exported.append(export_storage(storage))
                except Exception as exc:
                    raise RefitError(f"cannot share the memory of source tensor {names[piece]} with a "
                                     f"colocated engine: {exc}") from exc
                index = index_of[storage.data_ptr()] = len(exported) - 1
                self._storages.append((storage, storage.data_ptr(), storage.nbytes()))
                self._owners.append(names[piece])
            shared[piece] = SharedView.of(view, index)
        control: dict = {"magic": MAGIC}
        if self.device.type == "cuda" and self.messages:
            self._event = StepEvent(self.device)
            control["event"] = self._event.handle()
        raw = encode_exports(exported, shared)
        for peer in self.peers:
            page = Mailbox.allocate()
            mailbox = export_storage(page.untyped_storage())
            self._mailboxes[peer] = Mailbox(page, self.timeout_s, f"gen rank {peer}", self._spin_s)
            self.channel.put(colocated_key(self.rank, peer, ColocatedRecord.EXPORTS), raw)
            self.channel.put(colocated_key(self.rank, peer, ColocatedRecord.CONTROL),
                             {**control, "mailbox": asdict(mailbox)})

    def mark(self, name: str) -> None:
        """Record host mark ``name`` of this step (``start`` begins a new trace); no-op unless tracing."""
        if self._tracing:
            if name == "start":
                self.trace = StepTrace()
            if self.trace is not None:
                self.trace.mark(name)

    def check(self) -> str | None:
        """None if every exported storage is still where it was; else what changed."""
        for (storage, ptr, nbytes), owner in zip(self._storages, self._owners):
            if storage.data_ptr() != ptr or storage.nbytes() != nbytes:
                state = "freed" if storage.nbytes() == 0 else "reallocated"
                return (f"the memory of source tensor {owner} was {state} since setup (a colocated engine "
                        "reads it directly: keep parameters in place between setup() and close())")
        return None

    def post(self, version: int, error: str | None = None, verdict: bool = False) -> None:
        """Tell every colocated peer that this step's weights are ready (or why they are not); with
        ``verdict``, the check of the trainer's memory runs after this and :meth:`post_verdict`
        follows (the engine copies meanwhile, and fails the step if the verdict is an error)."""
        if not verdict:
            self.mark("checked")
        if self._event is not None and error is None:
            self._event.event.record(torch.cuda.current_stream(self.device))
        for mailbox in self._mailboxes.values():
            mailbox.post(self.step, version, self._fingerprint_word, error, verdict)
        self.mark("posted")
        if error is not None:  # the step ends here, on both sides
            self.step += 1

    def post_verdict(self, error: str | None) -> None:
        """The check of this step (posted with ``verdict=True``): None if the memory is unchanged."""
        self.mark("checked")
        for mailbox in self._mailboxes.values():
            mailbox.post_verdict(self.step, error)
        if error is not None:  # the engines fail this step at its end
            self.step += 1

    def wait(self) -> None:
        """Block until every colocated peer has copied this step's weights; raise on its error."""
        step, self.step = self.step, self.step + 1
        for peer, mailbox in self._mailboxes.items():
            error = mailbox.wait_done(step)
            if error:
                raise TransferError(f"colocated gen rank {peer} failed step {step}: {error}")
        self.mark("done_seen")

    def close(self) -> None:
        self._storages, self._event, self._mailboxes = [], None, {}


class ColocatedReceiver(_ColocatedPairs):
    """A gen rank's colocated pairs: opens the trainers' memory once, copies out of it every step."""

    def __init__(self, messages: dict[int, list[Message]], store: dist.Store, rank: int,
                 device: torch.device, fingerprint: str, timeout_s: float,
                 strided: StridedCopy = StridedCopy.TRITON, trace: bool = False) -> None:
        super().__init__(messages, store, rank, device, fingerprint, timeout_s, trace)
        self.strided = strided
        self._device_marks: tuple[torch.cuda.Event, list[tuple[str, torch.cuda.Event]]] | None = None
        self._verdicts: list[int] = []  # peers whose check of this step follows their ready signal
        self.lane: Lane = lane_for(device, "colocated copies")
        self._sources: dict[int, dict[int, torch.Tensor]] = {}  # peer -> piece -> view of its memory
        self._opened: list[torch.UntypedStorage] = []
        self._events: dict[int, torch.cuda.Event] = {}
        self._program: CopyProgram | None = None
        self._quantize: QuantizeInto | None = None
        self._pending: Fence | None = None
        self.pieces = frozenset(seg.piece for msgs in messages.values() for m in msgs for seg in m.dst_segments)
        """The bound destination pieces these pairs write (in place, every step)."""

    @property
    def counts(self) -> CopyCounts | None:
        """What one step runs (after :meth:`bind`)."""
        return self._program.counts if self._program is not None else None

    @property
    def copies(self) -> int:
        """Copy launches per step, quantizations included (after :meth:`bind`; 0 before)."""
        return ((self._program.counts.launches if self._program is not None else 0)
                + (self._quantize.launches if self._quantize is not None else 0))

    def open(self) -> None:
        """Open every colocated train peer's exported memory (once, at setup)."""
        for peer in self.peers:
            what = f"train rank {peer}'s shared memory description"
            storages, views = decode_exports(self.channel.take(colocated_key(peer, self.rank, ColocatedRecord.EXPORTS),
                                                               what))
            opened = [open_storage(s, self.device) for s in storages]
            self._opened += opened
            self._sources[peer] = {piece: v.open(opened[v.storage], self.device) for piece, v in views.items()}
            control = self.channel.take_json(colocated_key(peer, self.rank, ColocatedRecord.CONTROL),
                                             f"train rank {peer}'s mailbox")
            try:
                page_storage = open_storage(SharedStorage(**control["mailbox"]), torch.device("cpu"))
            except (KeyError, TypeError) as exc:
                raise TransferError(f"train rank {peer} sent a malformed mailbox description: {exc}") from exc
            self._opened.append(page_storage)
            page = torch.empty(0, dtype=torch.uint8).set_(page_storage, 0, (page_storage.nbytes(),), (1,))
            self._mailboxes[peer] = Mailbox(page, self.timeout_s, f"train rank {peer}", self._spin_s)
            if "event" in control:
                self._events[peer] = StepEvent(self.device, StepEvent.decode(control["event"])).event

    def _source(self, peer: int, seg: Segment) -> torch.Tensor:
        try:
            view = self._sources[peer][seg.piece]
        except KeyError:
            raise TransferError(f"train rank {peer} did not share source piece {seg.piece}") from None
        return seg.box.slice_of(view)

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        """Resolve every segment to (engine view, trainer view), then into a :class:`CopyProgram`.

        A segment the plan quantizes on the sender (its source segment carries ``scales``; the
        receiver's side has two segments, values then scales) is quantized here instead, straight
        from the trainer's memory into the engine's FP8 values and scales, after the copies: one
        batched launch per kernel variant on CUDA (:class:`~refit_core.run.quant.batched.QuantizeInto`,
        compiled here).
        """
        pairs = []
        quantized = []
        for peer in self.peers:
            for m in self.messages[peer]:
                targets = iter(m.dst_segments)
                for src in m.src_segments:
                    dst = next(targets)
                    source, target = self._source(peer, src), dst.box.slice_of(views[dst.piece])
                    if src.scales is None:
                        pairs.append((target, source))
                    else:
                        scale = next(targets)
                        quantized.append(TensorsToQuantize(source, target, scale.box.slice_of(views[scale.piece]),
                                                           src.scales.quant))
        self._program = CopyProgram(pairs, strided=self.strided)
        self._quantize = QuantizeInto(quantized, default_quantizer()) if quantized else None
        if self._quantize is not None:
            self._quantize.warm_up()

    def start(self, version_hint: int = -1) -> int:
        """Wait for every peer's header, check it, start the copies; returns the weight version."""
        trace = self.trace = StepTrace() if self._tracing else None
        if trace is not None:
            trace.mark("start")
        versions = set()
        step = self.step
        self._verdicts = []
        for peer, mailbox in self._mailboxes.items():
            try:
                version, fingerprint, error, verdict = mailbox.wait_ready(step)
            except TransferError as exc:
                self._publish_done(str(exc))
                raise
            if error:
                self._publish_done(f"train rank {peer} reported: {error}")
                raise TransferError(f"train rank {peer} failed colocated step {step}: {error}")
            if fingerprint != self._fingerprint_word:
                message = (f"train rank {peer} runs a different refit plan (fingerprint {fingerprint:x} vs ours "
                           f"{self._fingerprint_word:x}); both sides must call setup() with the same models "
                           "and options")
                self._publish_done(message)
                raise TransferError(message)
            versions.add(version)
            if verdict:
                self._verdicts.append(peer)
        if len(versions) > 1:
            message = (f"train ranks sent different weight versions {sorted(versions)} in one step: "
                       "every train rank must call send() with the same version")
            self._publish_done(message)
            raise TransferError(message)
        if trace is not None:
            trace.mark("ready_seen")
            trace.mark("enqueue_begin")
        after = [current_work(self.device, "the engine's pending work"),
                 *(EventFence(event, "the trainer's step") for event in self._events.values())]
        program, quantized = self._program, self._quantize
        if (program is not None and program.counts.launches) or quantized is not None:
            if trace is not None and isinstance(self.lane, StreamLane):
                queued = torch.cuda.Event(enable_timing=True)
                queued.record(self.lane.stream)  # before the stream's waits: when queueing began
                marks: list[tuple[str, torch.cuda.Event]] = []
                self._device_marks = (queued, marks)
                self._pending = self.lane.run(partial(_copy_and_quantize, program, quantized, marks), after=after)
            else:
                self._pending = self.lane.run(partial(_copy_and_quantize, program, quantized), after=after)
        if trace is not None:
            trace.mark("enqueued")
        return versions.pop() if versions else version_hint

    def finish(self, error: str | None = None) -> None:
        """Wait for the copies (unless ``error``), then tell every peer this step is done."""
        try:
            if self._pending is not None and error is None:
                self._pending.synchronize(self.timeout_s)
            if error is None:
                for peer in self._verdicts:
                    problem = self._mailboxes[peer].wait_verdict(self.step)
                    if problem:
                        raise TransferError(f"train rank {peer} failed colocated step {self.step} after the "
                                            f"copies had started: {problem}")
        except Exception as exc:
            self._publish_done(str(exc))
            raise
        finally:
            self._pending = None
        trace, device_marks, self._device_marks = self.trace, self._device_marks, None
        if trace is not None:
            trace.mark("gpu_done_seen")
        self._publish_done(error)
        if trace is not None:
            trace.mark("done_posted")
            if device_marks is not None and error is None:
                trace.device_phases(*device_marks)

    def _publish_done(self, error: str | None) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.done(self.step, error)
        self.step += 1

    def close(self) -> None:
        self._program, self._sources, self._opened, self._events, self._mailboxes = None, {}, [], {}, {}
        self._quantize = None


def _copy_and_quantize(program: CopyProgram | None, quantize: QuantizeInto | None,
                       marks: list[tuple[str, torch.cuda.Event]] | None = None) -> None:
    """One step of a gen rank's colocated part: the copy program (timed into ``marks`` if given),
    then the sender-side quantizations."""
    if program is not None:
        if marks is None:
            program.run()
        else:
            marks.extend(program.run_timed())
    if quantize is not None:
        quantize.run()


__all__ = ["ColocatedReceiver", "ColocatedSender"]

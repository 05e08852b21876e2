"""Colocated pairs: the receiver copies straight out of the trainer's memory (shared memory, CUDA IPC).

For a (train rank, gen rank) pair whose link reads peer memory (:mod:`refit_core.transport.placement`)
nothing is packed or sent. At setup the train rank *exports* the storages of its source pieces (CPU:
moved into shared memory in place; CUDA: an IPC handle) and publishes them as JSON through the
rendezvous store; the gen rank opens them once. Every step then runs:

1. train rank (:meth:`ColocatedSender.post`): check that the exported memory is still the parameters'
   memory, record an interprocess CUDA event after the trainer's queued work, post a *ready* header
   (step, version, plan fingerprint, error) in each colocated peer's mailbox (one page of host shared
   memory per pair, :mod:`refit_core.transport.mailbox`: no network, no store per step);
2. gen rank (:meth:`ColocatedReceiver.start` / :meth:`~ColocatedReceiver.finish`): wait for every
   peer's header and check it, then one batched ``torch._foreach_copy_`` of all the pair's segments
   from the trainer's views into the engine's views (casting where the plan casts; neighbouring
   segments that are neighbours in memory on both sides merged into one copy), ordered after the
   trainer's event and the engine's queued work (segments the plan quantizes on the sender, FP8
   destinations, are quantized by the gen rank straight from the trainer's memory after the copies,
   :mod:`refit_core.quant`); wait for it, publish *done*;
3. train rank (:meth:`ColocatedSender.wait`): wait for every peer's *done* before ``send`` returns.

No staging memory: one read and one write of every byte, which is the bound of any copy. The same
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
from dataclasses import asdict
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist

from .errors import RefitError, TransferError
from .lanes import EventFence, Lane, current_work, lane_for
from .quant.fast import default_quantizer
from .quant.spec import Quantization
from .schedule import Message, Segment
from .transport.base import Fence
from .transport.mailbox import Mailbox
from .transport.memory import (
    SharedStorage,
    SharedView,
    StepEvent,
    decode_exports,
    encode_exports,
    export_storage,
    open_storage,
)

MAGIC = "refit-colocated"


def _pair(src: int, dst: int) -> str:
    return f"{src}>{dst}"


class _Channel:
    """Setup records between the two ranks of colocated pairs (JSON, through the rendezvous store)."""

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        # prefixed here, not with torch's PrefixStore: refit's own store is a Python dist.Store, whose
        # methods (delete_key among them) torch's C++ wrappers do not all reach
        self.store = store
        self.prefix = "colocated/"
        self.timeout_s = timeout_s

    def put(self, key: str, value: dict | bytes) -> None:
        try:
            self.store.set(self.prefix + key, value if isinstance(value, bytes) else json.dumps(value).encode())  # type: ignore[arg-type]
        except Exception as exc:
            raise TransferError(f"lost the refit rendezvous (train rank 0 hosts it): {exc}") from exc

    def take(self, key: str, what: str, *, delete: bool = True) -> bytes:
        """The value of ``key`` once it exists (then removed); :class:`TransferError` after the timeout."""
        try:
            raw = self.store.get(self.prefix + key)  # waits up to the store's timeout, the refit's timeout_s
            if delete:
                self.store.delete_key(self.prefix + key)
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


class ColocatedSender:
    """A train rank's colocated pairs: exports its memory once, then posts a header per step."""

    def __init__(self, messages: dict[int, list[Message]], store: dist.Store, rank: int,
                 device: torch.device, fingerprint: str, timeout_s: float) -> None:
        self.messages = messages
        self.channel = _Channel(store, timeout_s)
        self.rank = rank
        self.device = device
        self.fingerprint = fingerprint
        self._fingerprint_word = int(fingerprint[:15], 16)
        self.timeout_s = timeout_s
        self.step = 0
        self.nbytes = sum(m.nbytes for msgs in messages.values() for m in msgs)
        self._mailboxes: dict[int, Mailbox] = {}
        self._storages: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, data_ptr, nbytes
        self._owners: list[str] = []  # a tensor name per exported storage, for errors
        self._event: StepEvent | None = None

    @property
    def peers(self) -> list[int]:
        return sorted(self.messages)

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
            self._mailboxes[peer] = Mailbox(page, self.timeout_s, f"gen rank {peer}")
            self.channel.put(f"{_pair(self.rank, peer)}/exports", raw)
            self.channel.put(f"{_pair(self.rank, peer)}/control", {**control, "mailbox": asdict(mailbox)})

    def check(self) -> str | None:
        """None if every exported storage is still where it was; else what changed."""
        for (storage, ptr, nbytes), owner in zip(self._storages, self._owners):
            if storage.data_ptr() != ptr or storage.nbytes() != nbytes:
                state = "freed" if storage.nbytes() == 0 else "reallocated"
                return (f"the memory of source tensor {owner} was {state} since setup (a colocated engine "
                        "reads it directly: keep parameters in place between setup() and close())")
        return None

    def post(self, version: int, error: str | None = None) -> None:
        """Tell every colocated peer that this step's weights are ready (or why they are not)."""
        if self._event is not None and error is None:
            self._event.event.record(torch.cuda.current_stream(self.device))
        for mailbox in self._mailboxes.values():
            mailbox.post(self.step, version, self._fingerprint_word, error)
        if error is not None:  # the step ends here, on both sides
            self.step += 1

    def wait(self) -> None:
        """Block until every colocated peer has copied this step's weights; raise on its error."""
        step, self.step = self.step, self.step + 1
        for peer, mailbox in self._mailboxes.items():
            error = mailbox.wait_done(step)
            if error:
                raise TransferError(f"colocated gen rank {peer} failed step {step}: {error}")

    def close(self) -> None:
        self._storages, self._event, self._mailboxes = [], None, {}


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts where contiguous ``a`` ends, in the same storage and dtype."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


def _span(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=a.dtype, device=a.device).set_(a.untyped_storage(), a.storage_offset(),
                                                               (a.numel() + b.numel(),), (1,))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _step(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements from ``a``'s first element to ``b``'s (0 if not a positive whole number)."""
    delta = b.data_ptr() - a.data_ptr()
    return delta // a.element_size() if delta > 0 and delta % a.element_size() == 0 else 0


def _stack(run: list[tuple[torch.Tensor, torch.Tensor]], steps: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-layout copies at constant distances as one copy of two views with a new leading dim."""
    (dst, src), (dst_step, src_step) = run[0], steps
    return (dst.as_strided((len(run), *dst.shape), (dst_step, *dst.stride()), dst.storage_offset()),
            src.as_strided((len(run), *src.shape), (src_step, *src.stride()), src.storage_offset()))


def coalesce(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) copies batched into as few copies as possible, exactly the same bytes.

    Neighbours in memory on both sides merge into one flat copy (``[gate_e; up_e]`` of every expert:
    one copy per stacked tensor); then runs of equal-layout copies at constant distances on both sides
    become one strided copy (Megatron's per-group ``q``/``k``/``v`` blocks: one copy each per layer).
    Segments never overlap, so a merged view covers exactly the bytes of the copies it replaces.
    """
    flat: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        if flat and _adjacent(flat[-1][0], dst) and _adjacent(flat[-1][1], src):
            flat[-1] = (_span(flat[-1][0], dst), _span(flat[-1][1], src))
        else:
            flat.append((dst, src))
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []
    steps = (0, 0)
    for dst, src in flat:
        if run and _same_layout(run[-1][0], dst) and _same_layout(run[-1][1], src):
            step = (_step(run[-1][0], dst), _step(run[-1][1], src))
            if all(step) and (len(run) == 1 or step == steps):
                run.append((dst, src))
                steps = step
                continue
        if run:
            out.append(run[0] if len(run) == 1 else _stack(run, steps))
        run, steps = [(dst, src)], (0, 0)
    if run:
        out.append(run[0] if len(run) == 1 else _stack(run, steps))
    return out


class ColocatedReceiver:
    """A gen rank's colocated pairs: opens the trainers' memory once, copies out of it every step."""

    def __init__(self, messages: dict[int, list[Message]], store: dist.Store, rank: int,
                 device: torch.device, fingerprint: str, timeout_s: float) -> None:
        self.messages = messages
        self.channel = _Channel(store, timeout_s)
        self.rank = rank
        self.device = device
        self.fingerprint = fingerprint
        self._fingerprint_word = int(fingerprint[:15], 16)
        self.timeout_s = timeout_s
        self.step = 0
        self.nbytes = sum(m.nbytes for msgs in messages.values() for m in msgs)
        self._mailboxes: dict[int, Mailbox] = {}
        self.lane: Lane = lane_for(device, "colocated copies")
        self._sources: dict[int, dict[int, torch.Tensor]] = {}  # peer -> piece -> view of its memory
        self._opened: list[torch.UntypedStorage] = []
        self._events: dict[int, torch.cuda.Event] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._quantized: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Quantization]] = []
        self._pending: Fence | None = None
        self.copies = 0

    @property
    def peers(self) -> list[int]:
        return sorted(self.messages)

    def open(self) -> None:
        """Open every colocated train peer's exported memory (once, at setup)."""
        for peer in self.peers:
            what = f"train rank {peer}'s shared memory description"
            storages, views = decode_exports(self.channel.take(f"{_pair(peer, self.rank)}/exports", what))
            opened = [open_storage(s, self.device) for s in storages]
            self._opened += opened
            self._sources[peer] = {piece: v.open(opened[v.storage], self.device) for piece, v in views.items()}
            control = self.channel.take_json(f"{_pair(peer, self.rank)}/control", f"train rank {peer}'s mailbox")
            try:
                page_storage = open_storage(SharedStorage(**control["mailbox"]), torch.device("cpu"))
            except (KeyError, TypeError) as exc:
                raise TransferError(f"train rank {peer} sent a malformed mailbox description: {exc}") from exc
            self._opened.append(page_storage)
            page = torch.empty(0, dtype=torch.uint8).set_(page_storage, 0, (page_storage.nbytes(),), (1,))
            self._mailboxes[peer] = Mailbox(page, self.timeout_s, f"train rank {peer}")
            if "event" in control:
                self._events[peer] = StepEvent(self.device, StepEvent.decode(control["event"])).event

    def _source(self, peer: int, seg: Segment) -> torch.Tensor:
        try:
            view = self._sources[peer][seg.piece]
        except KeyError:
            raise TransferError(f"train rank {peer} did not share source piece {seg.piece}") from None
        return seg.box.slice_of(view)

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        """Resolve every segment to (engine view, trainer view); merge memory neighbours.

        A segment the plan quantizes on the sender (its source segment carries ``scales``; the
        receiver's side has two segments, values then scales) is quantized here instead, straight
        from the trainer's memory into the engine's FP8 values and scales, after the copies.
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
                        quantized.append((source, target, scale.box.slice_of(views[scale.piece]), src.scales.quant))
        self._copies = coalesce(pairs)
        self._quantized = quantized
        self.copies = len(self._copies) + len(quantized)

    def start(self, version_hint: int = -1) -> int:
        """Wait for every peer's header, check it, start the copies; returns the weight version."""
        versions = set()
        step = self.step
        for peer, mailbox in self._mailboxes.items():
            try:
                version, fingerprint, error = mailbox.wait_ready(step)
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
        if len(versions) > 1:
            message = (f"train ranks sent different weight versions {sorted(versions)} in one step: "
                       "every train rank must call send() with the same version")
            self._publish_done(message)
            raise TransferError(message)
        after = [current_work(self.device, "the engine's pending work"),
                 *(EventFence(event, "the trainer's step") for event in self._events.values())]
        if self._copies or self._quantized:
            self._pending = self.lane.run(partial(_copy_and_quantize, self._copies, self._quantized), after=after)
        return versions.pop() if versions else version_hint

    def finish(self, error: str | None = None) -> None:
        """Wait for the copies (unless ``error``), then tell every peer this step is done."""
        try:
            if self._pending is not None and error is None:
                self._pending.synchronize(self.timeout_s)
        except Exception as exc:
            self._publish_done(str(exc))
            raise
        finally:
            self._pending = None
        self._publish_done(error)

    def _publish_done(self, error: str | None) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.done(self.step, error)
        self.step += 1

    def close(self) -> None:
        self._copies, self._sources, self._opened, self._events, self._mailboxes = [], {}, [], {}, {}
        self._quantized = []


def _copy_and_quantize(copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       quantized: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Quantization]]) -> None:
    """One step of a gen rank's colocated part: the batched copies, then the sender-side quantizations."""
    if copies:
        torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])
    quantizer = default_quantizer()
    for source, values, scales, quant in quantized:
        quantizer.quantize_into(source, values, scales, quant)


def split_rounds(rounds: list[list[Message]], network: Callable[[Message], bool]
                 ) -> tuple[list[list[Message]], list[Message]]:
    """A rank's rounds split into the network part (rounds kept in order) and the colocated messages."""
    kept, colocated = [], []
    for msgs in rounds:
        net = [m for m in msgs if network(m)]
        colocated += [m for m in msgs if not network(m)]
        if net:
            kept.append(net)
    return kept, colocated


def by_peer(messages: Sequence[Message], peer: Callable[[Message], int]) -> dict[int, list[Message]]:
    out: dict[int, list[Message]] = {}
    for m in messages:
        out.setdefault(peer(m), []).append(m)
    return out


__all__ = ["ColocatedReceiver", "ColocatedSender", "coalesce", "split_rounds"]

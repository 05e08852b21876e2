"""The settings of one refit: what every rank must agree on, as one typed object.

:class:`RefitOptions` holds every knob of a refit. All of them but ``timeout_s`` change what
travels on the wire or how (bucket size, buffers, cast policy, message formation, transport, NCCL
communicators), so both sides must run with the same values: the train side's rank 0 resolves its
options and publishes them (:meth:`RefitOptions.to_wire`); every other rank adopts them
(:meth:`RefitOptions.agree_with`), except where it set a different value *explicitly* (in code, or
through an environment override, see :mod:`refit_core.contract.env`): then setup fails on every rank with a
:class:`~refit_core.contract.errors.PlanError` naming the setting and both values. The agreed settings are
hashed into the plan's fingerprint.

A setting is explicit when it was passed to the constructor with a value other than None;
everything left out is a default the train side may overrule. Bad values raise
:class:`~refit_core.contract.errors.OptionError` naming the class and the field.
"""

from __future__ import annotations

import json
import re
import dataclasses
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from refit_core.contract.errors import OptionError, PlanError
from refit_core.contract.fleet_options import FleetOptions, Membership
from refit_core.contract.nccl_options import DEFAULT_CHOICE, NcclBackend, NcclChoice, NcclOptions
from refit_core.contract.relay_options import RELAY_COMMS_PER_LINK, RelayOptions
from refit_core.contract.settings import (
    _nested,
    _rebuild,
    _setting,
    _Settings,
    _shown,
    _tracks_explicit,
)
from refit_core.contract.transport_options import PerTransportOptions, TransportOptions
from refit_core.units import MiB

_MESSAGE_ALIGN = 16
"""Messages start at multiples of this many bytes (:data:`refit_core.plan.items.ALIGN`, which the settings
cannot import: ``tests/core/test_options.py`` holds them equal), so ``bucket_bytes`` is a multiple of it."""


class CastPolicy(StrEnum):
    """What to do when a source tensor's dtype differs from its destination's."""

    CAST = "cast"
    """Convert to the destination dtype on the sender."""
    STRICT = "strict"
    """Refuse the plan at setup."""


class TransportKind(StrEnum):
    """The transport names refit itself ships (``RefitOptions.transport`` takes any registered name:
    :mod:`refit_core.transports`); ``RefitOptions.transport`` holds one of these when it names one."""

    AUTO = "auto"
    """NCCL when this rank's pieces are on CUDA, gloo otherwise."""
    GLOO = "gloo"
    NCCL = "nccl"


_TRANSPORT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def _transport_name(where: str, value: Any) -> TransportKind | str:
    """A transport name: one of :class:`TransportKind` as its member, any other well-formed name as given
    (whether a transport of that name is installed is checked when the transport opens)."""
    if not isinstance(value, str) or not _TRANSPORT_NAME.fullmatch(value):
        raise OptionError(f"{where}={value!r}: expected a transport name (lowercase letters, digits, '.', '_' "
                          f"or '-'), e.g. one of {', '.join(repr(k.value) for k in TransportKind)}")
    try:
        return TransportKind(value)
    except ValueError:
        return str(value)


class Colocation(StrEnum):
    """Which (train rank, gen rank) pairs the gen rank copies straight out of the train rank's memory
    instead of receiving over the network transport (:mod:`refit_core.plan.links`)."""

    AUTO = "auto"
    """Pairs on the same GPU use CUDA IPC (NCCL cannot connect them); all others the network."""
    SHARED = "shared"
    """Also pairs of CPU ranks on one host use shared memory (``refit demo --colocate``)."""
    OFF = "off"
    """Every pair uses the network transport; a plan with a same-GPU pair is refused."""


class MessageMode(StrEnum):
    """How the schedule cuts transfers into messages (see :mod:`refit_core.plan.schedule`)."""

    UNITS = "units"
    """Units of at least ``direct_min_bytes`` get messages of their own, small ones share (default)."""
    RUNS = "runs"
    """Runs of units of one kind packed back to back (fewer NCCL operations; benchmarking)."""


class UpdateMode(StrEnum):
    """How a gen rank applies a step (see :mod:`refit_core.contract.failures`)."""

    IN_PLACE = "in_place"
    """Bytes land straight in engine memory; a failed step reports the tensors it tore."""
    STAGED = "staged"
    """A step lands in staging memory on every gen rank first, and is applied only once all have it."""





class StridedCopy(StrEnum):
    """How a :class:`CopyProgram` moves a large copy whose views are not contiguous (a stack of equal
    blocks at constant distances: Megatron's per-group ``q`` / ``k`` / ``v`` rows into vLLM's ``[Q; K; V]``).

    A gen rank's own choice (a local setting): every variant moves the same bytes. Which is fastest
    is a property of the device, measured side by side by ``python -m refit_core.tools.bench.colocated
    --variants`` (:mod:`refit_core.run.copies`)."""

    KERNEL = "kernel"
    """One strided ``copy_`` per stacked copy (torch's elementwise copy kernel, non-contiguous)."""
    BLOCKS = "blocks"
    """One contiguous ``copy_`` (a device memcpy) per block of at least ``min_block_bytes``; more launches."""
    FOREACH = "foreach"
    """Every large strided copy's contiguous blocks in one ``torch._foreach_copy_`` per dtype."""
    MEMCPY2D = "memcpy2d"
    """One ``cudaMemcpy2DAsync`` (blocks of ``width`` bytes at two pitches) per stacked copy whose
    blocks are contiguous (CUDA only; elsewhere, and for other layouts, as ``kernel``)."""
    TRITON = "triton"
    """Every large strided copy whose rows are contiguous 8-byte words on both sides in one Triton launch
    of whole-row tiles (:mod:`refit_core.run.triton_copies`; CUDA with Triton only; elsewhere, and for
    other layouts, as ``foreach``)."""


@_tracks_explicit
@dataclass(frozen=True)
class MessageOptions(_Settings):
    """How transfers become messages; both sides must agree (the plan depends on it).

    - ``mode``: :class:`MessageMode` (``units`` by default).
    - ``direct_min_bytes``: in ``units`` mode, units of at least this many bytes get messages of
      their own (16 MiB).
    - ``zero_copy``: send or receive a message that is one contiguous run of local memory straight
      from or into that memory (True); False stages every message through the buffers.
    - ``shared_max_bytes``: in ``units`` mode, the most bytes of one message that smaller units share
      (64 MiB, at most the bucket). Such a message is staged on both sides; capped, its copies spread over
      the step and hide behind the transfers.
    """

    mode: MessageMode = _setting(MessageMode.UNITS, MessageMode)
    direct_min_bytes: int = _setting(16 * MiB, int)
    zero_copy: bool = _setting(True, bool)
    shared_max_bytes: int = _setting(64 * MiB, int)

    def __post_init__(self) -> None:
        self._coerce()
        if self.direct_min_bytes < 0:
            raise OptionError(f"MessageOptions.direct_min_bytes={self.direct_min_bytes}: must be >= 0")
        if self.shared_max_bytes < _MESSAGE_ALIGN or self.shared_max_bytes % _MESSAGE_ALIGN:
            raise OptionError(f"MessageOptions.shared_max_bytes={self.shared_max_bytes}: must be a positive "
                              f"multiple of {_MESSAGE_ALIGN}")


@_tracks_explicit
@dataclass(frozen=True)
class StoreLimits(_Settings):
    """What the rendezvous store on train rank 0 accepts from an authenticated rank (train rank 0's own
    setting: only the host's values count). Each limit refuses the request with a named
    :class:`~refit_core.contract.errors.RendezvousError` and keeps serving the job.

    - ``max_value_bytes``: one value (256 MiB; the largest of a 1032-rank plan, a rank's part of it,
      is 4.8 MB). Also bounds a request's frame (base64 of this, plus 64 KiB).
    - ``max_stored_bytes``: keys and values held at once (2 GiB; a 1032-rank setup holds 180 MB).
    - ``max_keys``: keys held at once (2**22; a setup holds a few per rank, and each step's commit two
      per gen rank, deleted two steps later).
    - ``max_rank``: store identities are ``train/N`` or ``gen/N`` with N below the side's published
      world size, or below this (65536) until it is published.
    - ``max_replicas``: a fleet's replicas at once (:class:`~refit_core.RefitFleet`; 1024); a join beyond it is
      refused by name.
    - ``max_joins_per_minute``: replicas a fleet admits per minute (120); a join beyond it is refused by name
      (a crash-looping replica, or a flood).
    """

    max_value_bytes: int = _setting(256 * MiB, int)
    max_stored_bytes: int = _setting(2048 * MiB, int)
    max_keys: int = _setting(1 << 22, int)
    max_rank: int = _setting(1 << 16, int)
    max_replicas: int = _setting(1024, int)
    max_joins_per_minute: int = _setting(120, int)

    def __post_init__(self) -> None:
        self._coerce()
        values = {f: getattr(self, f) for f in ("max_value_bytes", "max_stored_bytes", "max_keys", "max_rank",
                                                 "max_replicas", "max_joins_per_minute")}
        if min(values.values()) < 1:
            shown = ", ".join(f"{name}={value}" for name, value in values.items())
            raise OptionError(f"StoreLimits({shown}): each must be >= 1")


@_tracks_explicit
@dataclass(frozen=True)
class RefitOptions(_Settings):
    """Every knob of one refit. The train side's rank 0 decides; see the module doc.

    - ``bucket_bytes``: most bytes a rank sends or receives in one round (None: 512 MiB when the
      train side's rank 0 is on CUDA, 64 MiB on CPU); staging memory per rank is at most
      ``bucket_bytes x num_buffers``. A positive multiple of 16.
    - ``num_buffers``: staging buffers in flight (pack / transfer / unpack overlap on CUDA).
    - ``cast``: :class:`CastPolicy`.
    - ``allow_unused_sources``: skip source tensors no destination wants instead of failing.
    - ``transport``: the network transport, for pairs that share no memory: a registered transport's name
      (:mod:`refit_core.transports`); refit ships :class:`TransportKind` (``auto``: NCCL on CUDA, gloo on
      CPU). An unknown name fails setup on every rank, naming the installed ones, before any collective.
    - ``colocate``: :class:`Colocation`: which pairs read the trainer's memory directly instead.
    - ``messages``: :class:`MessageOptions`; ``nccl``: :class:`NcclOptions` (the nccl transport's own).
    - ``transport_options``: the options of any other transport kind, ``{name: options}``
      (:class:`~refit_core.contract.transport_options.PerTransportOptions`; a kind left out runs with its
      defaults). Both sides must agree on them, like on ``nccl``.
    - ``relay``: :class:`RelayOptions`: relay fanout among engine replicas (off by default).
    - ``timeout_s``: setup waits fail after this long, and every step must finish within it
      (counted from the step's start). This rank's own deadline: the sides need not agree on it.
    - ``mode``: :class:`UpdateMode` (``in_place`` by default; ``staged`` costs each gen rank the
      bytes it receives per step in extra memory and guarantees old-or-new, never a mix).
    - ``confirm``: in place, ``send()`` returns only once train rank 0 heard that every gen rank landed
      the step, and raises if one did not (off by default: it costs the gen ranks a vote and train rank
      0 a read per step, about 1 ms on an H100 pair). Staged mode always confirms: it needs the vote.
    - ``job`` / ``secret``: this refit job's name and shared secret (local settings; defaults:
      the ``REFIT_JOB`` / ``REFIT_SECRET`` environment variables, else ``"refit"`` and the launcher's,
      see :mod:`refit_core.contract.env`). Every rank proves both (HMAC) before it may read or write
      the rendezvous; the secret is never sent. Setup refuses to run without a secret unless
      ``insecure`` (a local setting, ``REFIT_INSECURE=1``) opts out by name: then any process that can
      reach the rendezvous, local ones included, can join, and two jobs that share the job name and
      the port can mix.
    - ``store``: :class:`StoreLimits`: what the rendezvous store accepts (train rank 0's own setting).
    - ``fleet``: :class:`FleetOptions`: a fleet's relay tree and how it judges a step (train rank 0's own).

    - ``strided_copies``: :class:`StridedCopy`: how a colocated gen rank moves large strided copies
      (a local setting; ``triton`` by default, the fastest on an H200, ``foreach`` where Triton or CUDA
      is missing: ``benchmarks/results/colocated-nvidia-h200-variants-2026-11-26.md``).
    - ``overlap_check``: a colocated train rank signals *ready* first and checks that its parameters
      are still the memory shared at setup while the engine copies (on by default: checked first, the
      check sat on the step's critical path, 0.2-0.4 ms of a 9 ms Llama-3-8B step on an H200). A failed
      check still fails the step on both sides with the same error, but the engine's weights are then
      torn (``needs_refit``) instead of unchanged; ``False`` checks before *ready*. A train-side local
      setting.
    - ``step_trace``: record where each colocated step's time goes (host timestamps on both sides,
      CUDA events around the receiver's copies), read back as ``colocated_trace`` (a local setting,
      off by default: a few timestamps and events per step when on).

    Strings and dicts are accepted where enums and nested options are expected
    (``RefitOptions(cast="strict", messages={"zero_copy": False})``).
    """

    bucket_bytes: int | None = _setting(None, int)
    num_buffers: int = _setting(3, int)
    cast: CastPolicy = _setting(CastPolicy.CAST, CastPolicy)
    allow_unused_sources: bool = _setting(False, bool)
    transport: TransportKind | str = _setting(TransportKind.AUTO, _transport_name)
    colocate: Colocation = _setting(Colocation.AUTO, Colocation)
    messages: MessageOptions = _nested(MessageOptions)
    nccl: NcclOptions = _nested(NcclOptions)
    timeout_s: float = _setting(300.0, float, local=True)
    mode: UpdateMode = _setting(UpdateMode.IN_PLACE, UpdateMode)
    confirm: bool = _setting(False, bool)
    job: str | None = _setting(None, str, local=True)
    secret: str | None = field(default=None, repr=False, metadata={"kind": str, "local": True, "secret": True})
    insecure: bool = _setting(False, bool, local=True)
    relay: RelayOptions = _nested(RelayOptions)
    store: StoreLimits = field(default_factory=StoreLimits, metadata={"kind": StoreLimits, "local": True})
    fleet: FleetOptions = field(default_factory=FleetOptions, metadata={"kind": FleetOptions, "local": True})
    strided_copies: StridedCopy = _setting(StridedCopy.TRITON, StridedCopy, local=True)
    step_trace: bool = _setting(False, bool, local=True)
    overlap_check: bool = _setting(True, bool, local=True)
    transport_options: PerTransportOptions = field(default_factory=PerTransportOptions, metadata={
        "kind": PerTransportOptions, "local": False, "omit_empty": True})

    def __post_init__(self) -> None:
        self._coerce()
        if self.relay.forwards_within_nodes and self.mode is not UpdateMode.IN_PLACE:
            raise OptionError("RefitOptions.relay: forwarding within nodes needs mode='in_place' (a leader "
                              f"forwards what landed in its engine memory), got mode={self.mode.value!r}")
        if self.bucket_bytes is not None and (self.bucket_bytes < _MESSAGE_ALIGN
                                              or self.bucket_bytes % _MESSAGE_ALIGN):
            raise OptionError(f"RefitOptions.bucket_bytes={self.bucket_bytes}: must be a positive "
                              f"multiple of {_MESSAGE_ALIGN}")
        if self.num_buffers < 1:
            raise OptionError(f"RefitOptions.num_buffers={self.num_buffers}: must be >= 1")
        if self.job is not None and (not isinstance(self.job, str) or not 0 < len(self.job) <= 256):
            raise OptionError(f"RefitOptions.job={self.job!r:.60}: expected a name of 1 to 256 characters")
        if self.secret is not None and not isinstance(self.secret, str):
            raise OptionError("RefitOptions.secret: expected a string")

    def options_for(self, kind: str) -> TransportOptions | None:
        """The options of transport ``kind``: ``nccl`` for NCCL, else its entry of ``transport_options``, or
        None where none was given (the transport's defaults apply). A replica relay's NCCL links get
        :data:`RELAY_COMMS_PER_LINK` communicators unless ``nccl.comms_per_link`` was given."""
        if kind != TransportKind.NCCL:
            return self.transport_options.get(kind)
        if self.relay.fans_out and self.nccl.comms_per_link is None:
            return dataclasses.replace(self.nccl, comms_per_link=RELAY_COMMS_PER_LINK)
        return self.nccl

    def resolved(self, device_type: str) -> RefitOptions:
        """These options with ``bucket_bytes`` decided for a rank on ``device_type`` (``"cuda"``...)."""
        if self.bucket_bytes is not None:
            return self
        bucket = 512 * MiB if device_type == "cuda" else 64 * MiB
        return self.overridden({"bucket_bytes": bucket}, explicit=False)

    def overridden(self, values: dict[str, Any], *, explicit: bool = True) -> RefitOptions:
        """A copy with the settings of dotted name in ``values`` replaced (explicit unless told not)."""
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            head, _, rest = name.partition(".")
            if rest:
                nested.setdefault(head, {})[rest] = value
            else:
                top[head] = value
        unknown = sorted(set(values) - set(self.leaves()))
        if unknown:
            raise OptionError(f"RefitOptions: unknown setting(s) {unknown} (known: {sorted(self.leaves())})")
        result: RefitOptions = _rebuild(self, top, nested, explicit)
        return result

    def agreed_wire(self) -> dict[str, Any]:
        """The settings every rank must agree on, as a plain dict (what the fingerprint hashes)."""
        wire = self.to_wire()
        for f in fields(self):
            if f.metadata.get("local"):
                wire.pop(f.name, None)
        if not self.confirm:  # the default: the same fingerprints as before the setting existed
            wire.pop("confirm")
        if self.messages.shared_max_bytes == MessageOptions().shared_max_bytes:  # likewise
            wire["messages"].pop("shared_max_bytes")
        if not self.relay.active:  # no relay: the same fingerprints as before relay existed
            wire.pop("relay", None)
        elif not self.relay.forwards_within_nodes:  # nor does node forwarding change replica relay's
            for name in ("node_ranks", "forward_min_bytes"):
                wire["relay"].pop(name, None)
        if "relay" in wire and not self.relay.chunk_bytes:  # whole rounds: the same fingerprints as before slices
            wire["relay"].pop("chunk_bytes", None)
        if "relay" in wire and self.relay.slice_pieces == 1:  # likewise before slices in pieces
            wire["relay"].pop("slice_pieces", None)
        if "relay" in wire and not self.relay.broadcast:  # likewise before broadcasts
            wire["relay"].pop("broadcast", None)
        return wire

    def digest(self) -> str:
        """A stable text form of :meth:`agreed_wire` (sorted JSON), for the plan's fingerprint."""
        return json.dumps(self.agreed_wire(), sort_keys=True, separators=(",", ":"))

    def agree_with(self, published: RefitOptions, who: str) -> RefitOptions:
        """Adopt the train side's ``published`` options, keeping this rank's own local settings.

        Raises :class:`PlanError` naming the setting and both values where this rank (``who``,
        e.g. ``"gen rank 1"``) explicitly set a value that differs from the published one.
        """
        mine = self.leaves()
        theirs = published.leaves()
        local = {f.name for f in fields(self) if f.metadata.get("local")}
        for name in sorted(self.explicit):
            if name.partition(".")[0] not in local and mine[name] != theirs[name]:
                raise PlanError(f"setting {name!r} disagrees: {who} set {_shown(mine[name])} but the train "
                                f"side's rank 0 uses {_shown(theirs[name])}; set it the same on both sides "
                                "or only on the train side")
        return published.overridden({name: value for name, value in mine.items() if name.partition(".")[0] in local},
                                     explicit=False)

__all__ = ["DEFAULT_CHOICE", "CastPolicy", "FleetOptions", "Membership", "MessageMode", "MessageOptions", "NcclBackend",
           "NcclChoice", "NcclOptions", "PerTransportOptions", "RefitOptions", "RelayOptions", "StoreLimits",
           "StridedCopy", "TransportKind", "TransportOptions", "UpdateMode"]

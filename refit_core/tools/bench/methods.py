"""What ``refit bench`` times, each as a sender half and a receiver half.

- ``wire``: one NCCL send/recv of one contiguous buffer of the model's size: the ceiling. ``wire@copy``: the
  same, then a device copy of those bytes on the receiver: the ceiling of staged mode (``refit@mode=staged``).
- ``per-tensor`` (baseline A, the old vLLM / OpenRLHF example pattern): every HF tensor is produced
  on the trainer (gathered into a contiguous tensor where the layout splits it), broadcast on its own,
  received into a fresh tensor and copied into the engine's layout.
- ``packed`` (baseline B, NeMo-RL's packed broadcast): HF tensors are packed into buffers of about
  1 GiB, two in flight on two streams, broadcast, and unpacked tensor by tensor into the engine's
  layout (``packed_broadcast_producer`` / ``packed_broadcast_consumer``).
- ``broadcast`` (runs by itself when ``--gen-dp`` > 1 and one train rank feeds the replicas): NCCL's
  broadcast of one replica's bytes from the train rank to every replica, in buckets, the reference of a
  fleet (:mod:`~refit_core.tools.bench.broadcast`).
- ``refit``: :class:`~refit_core.RefitSender` / :class:`~refit_core.RefitReceiver` with a plan made once.
- ``refit-quantize-after`` (FP8 destinations only; the baseline of sender-side quantization): refit
  lands BF16 in a BF16 copy of the engine's layout, then the engine quantizes every FP8 weight from
  it (refit's own quantizer, compiled on CUDA) into its FP8 parameters and scales.

Each method has ``setup()`` (not timed), ``step(i)`` (timed) and ``close()``
(:class:`~refit_core.tools.bench.method.Method`). This module names them (:data:`METHODS`,
:func:`method_class`); they live in :mod:`~refit_core.tools.bench.wire`,
:mod:`~refit_core.tools.bench.baselines` and :mod:`~refit_core.tools.bench.refit_methods`.
"""

from __future__ import annotations

from collections.abc import Callable

from refit_core.contract.options import RefitOptions
from refit_core.tools.bench.baselines import PACKED_BUFFERS, PACKED_TARGET_BYTES, Packed, PerTensor
from refit_core.tools.bench.broadcast import Broadcast
from refit_core.tools.bench.comms import GlooComm, open_bench_comm
from refit_core.tools.bench.hftensors import Parts, hf_tensors, materialize, scatter
from refit_core.tools.bench.method import Method
from refit_core.tools.bench.refit_methods import Refit, RefitQuantizeAfter
from refit_core.tools.bench.wire import Wire, WireThenCopy

METHODS: dict[str, type[Method]] = {m.name: m for m in (Wire, PerTensor, Packed, Refit, RefitQuantizeAfter,
                                                          Broadcast)}
BASELINES = ("wire", "per-tensor", "packed")
"""The methods that run between one train and one gen rank (the wire, with refit's pairs, on more)."""


def is_baseline(name: str) -> bool:
    """True for the wire and the two baselines (and their variants), False for refit's methods."""
    return name.split("@")[0] in BASELINES


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def method_class(name: str) -> type[Method]:
    """A method by name; ``refit@bucket=256M+buffers=2+messages=runs+direct=64M+shared=512M+zero_copy=0+comms=1``
    is a refit variant (``refit@mode=staged``: staged commits; ``refit@confirm=0``: in place without the
    landing vote) (``refit@replicas=3+relay=1``: relay fanout, the trainers feed 1 of 3 replicas;
    ``+chunk=16M``: relayed in slices of 16 MiB),
    ``wire@ops=64`` the wire cut into 64 operations of one NCCL group, ``wire@copy`` the wire and then a device
    copy of the received bytes (staged mode's bound)."""
    if name in METHODS:
        return METHODS[name]
    base, sep, spec = name.partition("@")
    if base == "wire" and spec == "copy":
        return WireThenCopy
    if base == "wire" and spec.startswith("ops="):
        return type("WireOps", (Wire,), {"name": name, "ops": int(spec[4:])})
    if base != "refit" or not sep:
        raise KeyError(name)
    settings: dict[str, object] = {}
    for item in filter(None, spec.split("+")):
        key, _, value = item.partition("=")
        if key not in VARIANT_SETTINGS:
            raise KeyError(f"{name}: unknown refit setting {key!r} ({', '.join(VARIANT_SETTINGS)})")
        setting, parse = VARIANT_SETTINGS[key]
        settings[setting] = parse(value)
    RefitOptions().overridden(settings)  # a bad value fails here, naming the setting
    return type("RefitVariant", (Refit,), {"name": name, "settings": settings})


VARIANT_SETTINGS: dict[str, tuple[str, Callable[[str], object]]] = {
    "bucket": ("bucket_bytes", _size),
    "buffers": ("num_buffers", int),
    "direct": ("messages.direct_min_bytes", _size),
    "shared": ("messages.shared_max_bytes", _size),
    "zero_copy": ("messages.zero_copy", lambda v: v not in ("0", "false", "False")),
    "messages": ("messages.mode", str),
    "comms": ("nccl.comms_per_link", int),
    "ctas": ("nccl.max_ctas", int),
    "nccl": ("nccl.backend", str),
    "replicas": ("relay.replicas", int),
    "relay": ("relay.direct", int),
    "fanout": ("relay.fanout", int),
    "chunk": ("relay.chunk_bytes", _size),
    "pieces": ("relay.slice_pieces", int),
    "broadcast": ("relay.broadcast", lambda v: v not in ("0", "false", "False")),
    "mode": ("mode", str),
    "confirm": ("confirm", lambda v: v not in ("0", "false", "False")),
}
"""``refit@KEY=VALUE`` variant keys: the :class:`RefitOptions` setting each sets, and its parser."""

__all__ = [  # the methods' homes are their own modules; these names stay importable from here
    "BASELINES", "METHODS", "PACKED_BUFFERS", "PACKED_TARGET_BYTES", "VARIANT_SETTINGS", "Broadcast", "GlooComm",
    "Method",
    "Packed", "Parts", "PerTensor", "Refit", "RefitQuantizeAfter", "Wire", "WireThenCopy", "hf_tensors",
    "is_baseline", "materialize", "method_class", "open_bench_comm", "scatter",
]

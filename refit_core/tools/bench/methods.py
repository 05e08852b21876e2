"""What ``refit bench`` times, each as a sender half and a receiver half.

- ``wire``: one NCCL send/recv of one contiguous buffer of the model's size: the ceiling. ``wire@copy``: the
  same, then a device copy of those bytes on the receiver: the ceiling of staged mode (``refit@mode=staged``).
- ``per-tensor`` (baseline A, the old vLLM / OpenRLHF example pattern): every HF tensor is produced
  on the trainer (gathered into a contiguous tensor where the layout splits it), broadcast on its own,
  received into a fresh tensor and copied into the engine's layout.
- ``packed`` (baseline B, NeMo-RL's packed broadcast): HF tensors are packed into buffers of about
  1 GiB, two in flight on two streams, broadcast, and unpacked tensor by tensor into the engine's
  layout (``packed_broadcast_producer`` / ``packed_broadcast_consumer``).
- ``refit``: :class:`~refit_core.RefitSender` / :class:`~refit_core.RefitReceiver` with a plan made once.
- ``refit-quantize-after`` (FP8 destinations only; the baseline of sender-side quantization): refit
  lands BF16 in a BF16 copy of the engine's layout, then the engine quantizes every FP8 weight from
  it (refit's own quantizer, compiled on CUDA) into its FP8 parameters and scales.

Each method has ``setup()`` (not timed), ``step(i)`` (timed) and ``close()``. The baselines are
written generously: the name-to-memory mapping of every HF tensor is computed once at setup, where
real code walks names and loaders every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import default_expert_name
from refit_core.contract.options import RefitOptions
from refit_core.contract.spec import Box, TensorSpec
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender
from refit_core.kit.models import checkpoint_specs
from refit_core.run.timing import Timeline
from refit_core.tools.bench.copybound import CopyBound

PACKED_TARGET_BYTES = 1 << 30
PACKED_BUFFERS = 2


class GlooComm:
    """The CPU stand-in for :class:`~refit_core.net.transport.nccl.NcclComm` (benchmark smoke runs)."""

    backend = "gloo"

    def __init__(self, store: dist.Store, key: str, nranks: int, rank: int, device: torch.device,
                 timeout_s: float = 300.0) -> None:
        self.pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/", store), rank, nranks,
                                             timedelta(seconds=timeout_s))

    def post(self, sends, recvs, stream=None) -> None:
        works = [self.pg.recv([t], p, 0) for p, t in recvs] + [self.pg.send([t], p, 0) for p, t in sends]
        for work in works:
            work.wait()

    def broadcast(self, tensor: torch.Tensor, root: int, stream=None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        self.pg = None


def open_bench_comm(store: dist.Store, key: str, nranks: int, rank: int, device: torch.device) -> Any:
    """An NCCL communicator between the two benchmark ranks on CUDA, a gloo stand-in on CPU."""
    if device.type == "cuda":
        from refit_core.net.transport.nccl import open_comm
        return open_comm(store, key, nranks, rank, device)
    return GlooComm(store, key, nranks, rank, device)


def _stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


# -- HF tensors as the baselines see them ------------------------------------------------------------

Parts = list[tuple[Box, torch.Tensor]]


def hf_tensors(model: Any) -> list[tuple[TensorSpec, Parts]]:
    """Every HF checkpoint tensor (per-expert names, checkpoint order) and where this rank holds it.

    Each entry lists ``(box within the HF tensor, local view)``; grouped expert pieces are cut into
    their experts. The baselines assume one rank per side holding whole tensors.
    """
    by_name = model.by_name()
    out = []
    for spec in checkpoint_specs(model.config, grouped=False):
        spec = TensorSpec(spec.name, spec.shape, model.dtype)
        expert = default_expert_name(spec.name)
        parts: Parts = []
        if expert is not None:
            for piece in by_name.get(expert.group, []):
                first, count = piece.box.offsets[0], piece.box.sizes[0]
                if first <= expert.index < first + count:
                    parts.append((Box(piece.box.offsets[1:], piece.box.sizes[1:]), piece.view[expert.index - first]))
        else:
            parts = [(piece.box, piece.view) for piece in by_name.get(spec.name, [])]
        if sum(box.numel for box, _ in parts) != spec.numel:
            raise ValueError(f"the baselines need whole tensors on one rank: {spec.name} is split")
        out.append((spec, parts))
    return out


def materialize(spec: TensorSpec, parts: Parts, device: torch.device) -> torch.Tensor:
    """The HF tensor as one contiguous tensor: the memory itself if it already is one, else a gather."""
    if len(parts) == 1 and parts[0][0].sizes == spec.shape and parts[0][1].is_contiguous():
        return parts[0][1]
    out = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    for box, view in parts:
        box.slice_of(out).copy_(view)
    return out


def scatter(full: torch.Tensor, parts: Parts) -> None:
    """Copy a received HF tensor into the engine's layout (what a ``load_weights`` does)."""
    for box, view in parts:
        view.copy_(box.slice_of(full))


# -- methods ------------------------------------------------------------------------------------------

class Method:
    name = ""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.info: dict[str, Any] = {}

    def setup(self) -> None:
        pass

    def step(self, index: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Wire(Method):
    """The bound: the bytes refit moves, over the same (train rank, gen rank) pairs, all pairs at once,
    each pair one p2p of one contiguous buffer (``wire@ops=N``: cut into N operations of one NCCL
    group). A one-to-one run moves the model's bytes over its pair; a multi-rank run the
    :class:`~refit_core.tools.bench.wireplan.WirePlan` of refit's schedule (``ctx.wire_plan``). A
    sender keeps one buffer (its largest pair's bytes), a receiver one region per pair; pairs on one
    device (NCCL cannot pair a device with itself) are left out and named in ``info``."""

    name = "wire"
    ops = 1

    buffer: torch.Tensor | None = None

    def setup(self) -> None:
        c = self.ctx
        plan = c.wire_plan()
        rank_of = c.extra.get("devices", {})
        self.lanes: list[tuple[Any, torch.Tensor, Any, str]] = []  # (comm, tensor, stream, checksum key)
        mine = [p for p in plan.of_rank(c.rank)
                if c.device.type != "cuda" or rank_of.get(p.src) != rank_of.get(p.dst)]
        skipped = [p for p in plan.pairs
                   if c.device.type == "cuda" and rank_of.get(p.src) == rank_of.get(p.dst)]
        size = max((p.nbytes for p in mine), default=0) if c.is_train else sum(p.nbytes for p in mine)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=c.device)
        if c.is_train:
            self.buffer.random_(0, 256)
        else:
            self.buffer.zero_()
        offset = 0
        for p in mine:
            comm = c.comm if c.comm is not None and len(plan.pairs) == 1 else \
                open_bench_comm(c.store, f"{self.name}/{p.src}-{p.dst}", 2, 0 if c.is_train else 1, c.device)
            view = self.buffer[:p.nbytes] if c.is_train else self.buffer[offset:offset + p.nbytes]
            offset += 0 if c.is_train else p.nbytes
            stream = torch.cuda.Stream(c.device) if c.device.type == "cuda" and len(mine) > 1 else None
            self.lanes.append((comm, view, stream, f"{self.name}/checksum/{p.src}-{p.dst}"))  # one key per method
        self.info["wire_bytes"] = plan.nbytes - sum(p.nbytes for p in skipped)
        self.info["wire_pairs"] = len(plan.pairs) - len(skipped)
        if skipped:
            self.info["wire_skipped_pairs"] = [(p.src, p.dst) for p in skipped]

    def close(self) -> None:
        for comm, _, _, _ in self.lanes:
            if comm is not self.ctx.comm:
                comm.close()
        self.lanes = []
        self.buffer = None
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()

    def step(self, index: int) -> None:
        c = self.ctx
        current = _stream(c.device)
        for comm, data, stream, _ in self.lanes:
            if stream is not None:
                stream.wait_stream(current)
            parts = list(data.tensor_split(self.ops)) if self.ops > 1 else [data]
            if c.is_train:
                comm.post([(1, p) for p in parts], [], stream or current)
            else:
                comm.post([], [(0, p) for p in parts], stream or current)
        for _, _, stream, _ in self.lanes:
            if stream is not None:
                current.wait_stream(stream)

    def verify(self, checksum: Callable[[torch.Tensor], int]) -> str | None:
        """Senders publish each pair's checksum; receivers compare theirs (None on a sender)."""
        store = self.ctx.store
        if self.ctx.is_train:
            for _, data, _, key in self.lanes:
                store.set(key, str(checksum(data)))
            return None
        bad = [key for _, data, _, key in self.lanes if int(store.get(key).decode()) != checksum(data)]
        return "checksum ok" if not bad else f"CHECKSUM MISMATCH ({', '.join(bad)})"


class WireThenCopy(Wire):
    """``wire@copy``, the bound of staged mode (``refit@mode=staged``): the wire, then on each receiver a
    device copy of every byte it received (:class:`~refit_core.tools.bench.copybound.CopyBound`, through two
    buffers of at most 1 GiB), as a staged commit copies the landed step into the engine's weights."""

    name = "wire@copy"
    CHUNK = 1 << 30

    bound: CopyBound | None = None

    def setup(self) -> None:
        super().setup()
        if not self.ctx.is_train and self.buffer is not None:
            self.bound = CopyBound(self.buffer.numel(), self.ctx.device, self.CHUNK)

    def step(self, index: int) -> None:
        super().step(index)
        if self.bound is not None:
            self.bound.copy()

    def close(self) -> None:
        self.bound = None
        super().close()


class PerTensor(Method):
    """Baseline A: broadcast every HF tensor on its own, then copy it into place."""

    name = "per-tensor"

    def setup(self) -> None:
        self.tensors = hf_tensors(self.ctx.model)
        self.info["tensors"] = len(self.tensors)

    def step(self, index: int) -> None:
        c = self.ctx
        stream = _stream(c.device)
        for spec, parts in self.tensors:
            if c.is_train:
                c.comm.broadcast(materialize(spec, parts, c.device), 0, stream)
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=c.device)
                c.comm.broadcast(buffer, 0, stream)
                scatter(buffer, parts)


def _chunks(tensors: list[tuple[TensorSpec, Parts]], target: int) -> Iterator[list[tuple[TensorSpec, Parts]]]:
    """NeMo-RL's packing rule: add tensors until the buffer is *over* the target size."""
    chunk, size = [], 0
    for item in tensors:
        chunk.append(item)
        size += item[0].nbytes
        if size > target:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class Packed(Method):
    """Baseline B: HF tensors packed into ~1 GiB buffers, two in flight, broadcast, unpacked."""

    name = "packed"

    def setup(self) -> None:
        self.tensors = hf_tensors(self.ctx.model)
        self.chunks = list(_chunks(self.tensors, PACKED_TARGET_BYTES))
        dev = self.ctx.device
        self.streams = [torch.cuda.Stream(dev) if dev.type == "cuda" else None for _ in range(PACKED_BUFFERS)]
        self.info.update(tensors=len(self.tensors), buffers=len(self.chunks))

    def step(self, index: int) -> None:
        c = self.ctx
        keep: list[torch.Tensor | None] = [None] * PACKED_BUFFERS
        for i, chunk in enumerate(self.chunks):
            slot = i % PACKED_BUFFERS
            stream = self.streams[slot]
            if stream is not None:
                stream.synchronize()
            with torch.cuda.stream(stream) if stream is not None else _null():
                if c.is_train:
                    flat = [materialize(spec, parts, c.device).reshape(-1).view(torch.uint8)
                            for spec, parts in chunk]
                    packed = torch.cat(flat)
                    c.comm.broadcast(packed, 0, stream)
                else:
                    packed = torch.empty(sum(spec.nbytes for spec, _ in chunk), dtype=torch.uint8, device=c.device)
                    c.comm.broadcast(packed, 0, stream)
                    offset = 0
                    for spec, parts in chunk:
                        full = packed[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)
                        offset += spec.nbytes
                        scatter(full, parts)
                keep[slot] = packed
        for stream in self.streams:
            if stream is not None:
                stream.synchronize()
        del keep


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Refit(Method):
    """refit itself; a variant's ``settings`` (dotted :class:`RefitOptions` names) apply on both sides."""

    name = "refit"
    settings: dict[str, object] = {}

    def setup(self) -> None:
        c = self.ctx
        options = RefitOptions(bucket_bytes=c.bucket_bytes, num_buffers=c.num_buffers, timeout_s=c.timeout_s)
        options = options.overridden(self.settings) if self.settings else options
        endpoint: RefitSender | RefitReceiver
        if c.is_train:
            endpoint = RefitSender(self.endpoint_model(), rendezvous=c.refit_address(self.name), rank=c.side_rank,
                                   world_size=c.side_size, options=options, plugins=c.plugins)
        else:
            endpoint = RefitReceiver(self.endpoint_model(), rendezvous=c.refit_address(self.name), rank=c.side_rank,
                                     world_size=c.side_size, options=options, plugins=c.plugins)
        self.endpoint = endpoint
        self.schedule = endpoint.setup()
        if c.extra.get("timeline"):
            try:
                endpoint.executor.timeline = Timeline(c.device)  # every step: the last one is drawn
            except RefitError:  # every pair colocated: no network executor to record
                pass
        transport = endpoint.transport
        summary = self.schedule.summary
        self.info.update(messages=summary.messages, segments=summary.segments, rounds=summary.rounds,
                         transport=str(getattr(transport, "backend", transport.kind if transport else "")),
                         transport_mode=getattr(transport, "mode", ""))
        built = getattr(transport, "choice", None)  # NCCL: the communicators per link and their max CTAs
        if built is not None:
            self.info.update(comms_per_link=built.comms_per_link, max_ctas=built.max_ctas)

    def endpoint_model(self) -> Any:
        """The model refit reads (train) or writes (gen): the benchmark's own by default."""
        return self.ctx.model

    def _executor_info(self) -> None:
        side = "send" if self.ctx.is_train else "recv"
        self.info["links"] = sorted({link.value for link in self.endpoint.links.values()})
        try:
            ex = self.endpoint.executor
        except RefitError:  # every pair of this rank is colocated (CUDA IPC): nothing staged
            self.info[f"{side}_staging_bytes"] = 0
            return
        staged_rounds = sum(1 for p in ex.plans if p.staged_bytes)
        self.info[f"{side}_direct_bytes"] = ex.direct_bytes
        self.info[f"{side}_staging_bytes"] = min(ex.num_buffers, staged_rounds) * ex.buffer_bytes

    def step(self, index: int) -> None:
        if isinstance(self.endpoint, RefitSender):
            self.endpoint.send(version=index)
        else:
            stats = self.endpoint.receive()
            if stats.version != index:
                raise AssertionError(f"received version {stats.version}, expected {index}")
        if index == 0:
            self._executor_info()

    def recorded(self) -> dict[str, Any]:
        """This rank's setup breakdown and, with ``--timeline``, its last step's spans (JSON)."""
        out: dict[str, Any] = {}
        times = self.endpoint.setup_times
        if times is not None:
            out["setup"] = times.to_json()
        try:
            last = self.endpoint.executor.last_timeline
        except RefitError:
            last = None
        if last is not None:
            out["timeline"] = last.to_json()
        return out

    def close(self) -> None:
        self.endpoint.close()


class RefitQuantizeAfter(Refit):
    """Baseline for FP8 destinations: refit BF16 into a BF16 copy of the engine's layout, then quantize."""

    name = "refit-quantize-after"

    def endpoint_model(self) -> Any:
        c = self.ctx
        if c.is_train:
            return c.model
        from refit_core.run.quant.batched import QuantizeInto, TensorsToQuantize
        from refit_core.run.quant.fast import default_quantizer
        from refit_core.tools.bench.layouts import VllmStyleModel

        fp8 = c.model
        if not any(p.spec.quant is not None for p in fp8.pieces):
            raise ValueError(f"{self.name} needs a block-FP8 destination (refit bench --fp8-block)")
        self.staging = VllmStyleModel(fp8.config, tp=fp8.tp, rank=fp8.rank, device=fp8.device)
        hp = {(p.spec.name, p.box): p.view for p in self.staging.pieces}
        scales = {(p.spec.name, p.box): p.view for p in fp8.pieces}
        work = [TensorsToQuantize(hp[(p.spec.name, p.box)], p.view,
                                  scales[(p.spec.quant.scale_name, p.spec.quant.scale_box(p.box))], p.spec.quant)
                for p in fp8.pieces if p.spec.quant is not None]
        self.copies = [(p.view, hp[(p.spec.name, p.box)]) for p in fp8.pieces
                       if p.spec.quant is None and (p.spec.name, p.box) in hp]
        self.info["receiver_bf16_copy_bytes"] = self.info["bytes_moved"] = self.staging.nbytes
        # the same batched kernel as refit's pack step, writing the engine's tensors by address
        self.quantize = QuantizeInto(work, default_quantizer())
        self.quantize.warm_up()  # compile here, not inside a timed step
        return self.staging

    def step(self, index: int) -> None:
        super().step(index)
        if self.ctx.is_train:
            return
        with torch.no_grad():
            torch._foreach_copy_([d for d, _ in self.copies], [s for _, s in self.copies])
            self.quantize.run()
        self.ctx.model.version = index

    def close(self) -> None:
        super().close()
        self.copies = []
        self.__dict__.pop("quantize", None)
        self.__dict__.pop("staging", None)  # the BF16 copy of the engine's layout


METHODS: dict[str, type[Method]] = {m.name: m for m in (Wire, PerTensor, Packed, Refit, RefitQuantizeAfter)}


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def method_class(name: str) -> type[Method]:
    """A method by name; ``refit@bucket=256M+buffers=2+messages=runs+direct=64M+shared=512M+zero_copy=0+comms=1``
    is a refit variant (``refit@mode=staged``: staged commits; ``refit@confirm=0``: in place without the
    landing vote) (``refit@replicas=3+relay=1``: relay fanout, the trainers feed 1 of 3 replicas),
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
    "mode": ("mode", str),
    "confirm": ("confirm", lambda v: v not in ("0", "false", "False")),
}
"""``refit@KEY=VALUE`` variant keys: the :class:`RefitOptions` setting each sets, and its parser."""

"""The public API: a :class:`RefitSender` on every train rank, a :class:`RefitReceiver` on every gen rank.

Both sides call ``setup()`` once (metadata exchange through the rendezvous store, planning, agreement
on the plan's fingerprint, transport creation), then every step the train side calls
``send(version)`` and the gen side ``receive()``. The two sides are separate programs; train rank 0
hosts the rendezvous store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from .backend import GEN, TRAIN
from .errors import PlanError, RefitError
from .executor import ReceiveExecutor, SendExecutor, StepStats
from .experts import group_piece, group_side, ungroup_name
from .pieces import DestinationPiece, Piece, PieceMeta
from .planner import plan_transfers
from .plugins import PluginManager, get_plugin_manager
from .rendezvous import Rendezvous
from .schedule import Schedule, build_schedule
from .transport import Transport, open_transport
from .units import format_bytes

log = logging.getLogger("refit")

MiB = 1 << 20


@dataclass(frozen=True)
class RefitOptions:
    """Knobs of one refit. The train side's rank 0 decides ``bucket_bytes`` and ``cast`` for both sides.

    - ``bucket_bytes``: most bytes a rank sends or receives in one round (None: 512 MiB on CUDA,
      64 MiB on CPU); staging memory per rank is at most ``bucket_bytes x num_buffers``.
    - ``num_buffers``: staging buffers in flight (pack / transfer / unpack overlap on CUDA).
    - ``cast``: ``"cast"`` converts to the destination dtype on the sender; ``"strict"`` rejects
      dtype differences at setup.
    - ``allow_unused_sources``: skip source tensors no destination wants instead of failing.
    - ``transport``: ``"auto"`` (NCCL on CUDA, gloo on CPU), ``"gloo"`` or ``"nccl"``.
    - ``timeout_s``: setup waits and every step's transfers fail after this long.
    """

    bucket_bytes: int | None = None
    num_buffers: int = 3
    cast: str = "cast"
    allow_unused_sources: bool = False
    transport: str = "auto"
    timeout_s: float = 300.0

    def resolved_bucket(self, device: torch.device) -> int:
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        return 512 * MiB if device.type == "cuda" else 64 * MiB


def _device_of(pieces: list[Piece]) -> torch.device:
    devices = {p.view.device for p in pieces if p.view is not None}
    if len(devices) > 1:
        raise RefitError(f"pieces live on several devices {sorted(map(str, devices))}; one device per rank")
    return devices.pop() if devices else torch.device("cpu")


def _device_identity(device: torch.device) -> str:
    """``cuda:<uuid>`` for a GPU (equal on every process that uses it), ``cpu`` otherwise."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


class _Endpoint:
    side: str

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None) -> None:
        if not 0 <= rank < world_size:
            raise RefitError(f"{self.side} rank {rank} is outside world_size {world_size}")
        self.model = model
        self.address = rendezvous
        self.rank = rank
        self.world_size = world_size
        self.options = options or RefitOptions()
        self.plugins = plugins or get_plugin_manager()
        self.schedule: Schedule | None = None
        self.transport: Transport | None = None
        self._rdv: Rendezvous | None = None

    # -- setup --------------------------------------------------------------------------------

    def _local_pieces(self) -> list[Piece]:
        raise NotImplementedError

    def setup(self) -> Schedule:
        """Exchange metadata, plan, check agreement and open the transport. Collective over both sides."""
        start = time.perf_counter()
        self._rdv = Rendezvous(self.address, host=self._hosts_store, timeout_s=self.options.timeout_s)
        self.sizes: dict[str, int] = {}
        try:
            pieces = self._local_pieces()
            self.device = _device_of(pieces)
            settings, metas = self._exchange_metadata(pieces)
            schedule = self._plan(settings, metas)
        except Exception as exc:
            self._abort_setup(exc)
            raise
        self.schedule = schedule
        self.transport = open_transport(self.options.transport, self._rdv.store, self._global_rank(),
                                        sum(self.sizes.values()), self.device, self.options.timeout_s)
        self._executor = self._make_executor(schedule, settings["bucket_bytes"])
        self._pieces = pieces
        stats = schedule.stats
        log.info("refit %s rank %d ready in %.2f s: %s in %d messages over %d rounds, plan %s",
                 self.side, self.rank, time.perf_counter() - start, format_bytes(stats["bytes"]),
                 stats["messages"], stats["rounds"], schedule.fingerprint)
        return schedule

    @property
    def _hosts_store(self) -> bool:
        return self.side == TRAIN and self.rank == 0

    def _exchange_metadata(self, pieces: list[Piece]) -> tuple[dict, dict[str, list[list[PieceMeta]]]]:
        """Publish this rank's piece metadata; return the train side's settings and everyone's metadata."""
        rdv = self._rdv
        if self.rank == 0:
            rdv.publish(f"size/{self.side}", self.world_size)
        if self._hosts_store:
            rdv.publish("options", {"bucket_bytes": self.options.resolved_bucket(self.device),
                                    "cast": self.options.cast,
                                    "allow_unused_sources": self.options.allow_unused_sources})
        rdv.publish(f"meta/{self.side}/{self.rank}", [p.meta for p in pieces])
        rdv.publish(f"device/{self.side}/{self.rank}", _device_identity(self.device))
        self.sizes = dict(zip((TRAIN, GEN), rdv.wait(["size/train", "size/gen"], "both sides' sizes")))
        (settings,) = rdv.wait(["options"], "the train side's options")
        metas = {side: rdv.wait([f"meta/{side}/{r}" for r in range(self.sizes[side])], f"{side} metadata")
                 for side in (TRAIN, GEN)}
        return settings, metas

    def _plan(self, settings: dict, metas: dict[str, list[list[PieceMeta]]]) -> Schedule:
        """Plan (identically on every rank) and check that every rank got the same fingerprint."""
        grouped = {side: group_side(metas[side], self.plugins.expert_name) for side in (TRAIN, GEN)}
        self._counts = grouped[self.side][1]
        transfers = plan_transfers(grouped[TRAIN][0], grouped[GEN][0], cast=settings["cast"],
                                   allow_unused_sources=settings["allow_unused_sources"])
        schedule = build_schedule(transfers, self.sizes[TRAIN], self.sizes[GEN], settings["bucket_bytes"])
        self._check_placement(schedule)
        self._rdv.publish(f"fingerprint/{self.side}/{self.rank}", schedule.fingerprint)
        everyone = self._rdv.wait(self._rank_keys("fingerprint"), "every rank's plan fingerprint")
        if any(fp != schedule.fingerprint for fp in everyone):
            raise PlanError(f"ranks computed different plans (fingerprints {sorted(set(everyone))}); "
                            "every rank must run the same refit version and options")
        return schedule

    def _check_placement(self, schedule: Schedule) -> None:
        """NCCL cannot connect two ranks on one GPU: refuse such a plan before any collective."""
        devices = {side: self._rdv.wait([f"device/{side}/{r}" for r in range(n)], f"{side} devices")
                   for side, n in self.sizes.items()}
        shared = sorted({(m.src, m.dst) for msgs in schedule.rounds for m in msgs
                         if devices[TRAIN][m.src].startswith("cuda") and devices[TRAIN][m.src] == devices[GEN][m.dst]})
        if shared and self.options.transport in ("auto", "nccl"):
            pairs = ", ".join(f"train {s} -> gen {d}" for s, d in shared[:5])
            raise PlanError(f"{len(shared)} transfer(s) would connect two ranks on the same GPU ({pairs}); "
                            "NCCL cannot do that: place the train and gen ranks that exchange weights "
                            "on different GPUs")

    def _rank_keys(self, prefix: str) -> list[str]:
        return [f"{prefix}/{side}/{r}" for side, n in self.sizes.items() for r in range(n)]

    def _abort_setup(self, exc: Exception) -> None:
        """Tell every rank why setup failed; the store's host waits until they have read it."""
        self._rdv.fail(exc, f"{self.side} rank {self.rank}", f"done/{self.side}/{self.rank}")
        if self._hosts_store:
            if not self.sizes:  # failed before learning the gen side's size: wait for it to show up
                self._rdv.linger(["size/gen"], timeout_s=self.options.timeout_s)
                self.sizes = {TRAIN: self.world_size, GEN: self._rdv.read("size/gen", default=0)}
            self._rdv.linger(self._rank_keys("done"), timeout_s=self.options.timeout_s)

    def _global_rank(self) -> int:
        """Train ranks come first in refit's own process group, then gen ranks."""
        return self.rank if self.side == TRAIN else self.sizes[TRAIN] + self.rank

    def _make_executor(self, schedule: Schedule, bucket: int):
        raise NotImplementedError

    def _bind(self, pieces: list[Piece]) -> None:
        grouped = [group_piece(p, self.plugins.expert_name, self._counts) for p in pieces]
        self._executor.bind([p.view for p in grouped])

    def _require_setup(self) -> None:
        if self.transport is None:
            raise RefitError(f"call setup() on the {self.side} side before the first step")

    def close(self) -> None:
        """Release the transport and the rendezvous connection."""
        if self.transport is not None:
            self.transport.close()
        self.transport = None
        self._rdv = None


class RefitSender(_Endpoint):
    """The train side of a refit, one per train rank. ``send(version)`` every step."""

    side = TRAIN

    def _local_pieces(self) -> list[Piece]:
        pieces = self.plugins.source_pieces(self.model)
        missing = [p.spec.name for p in pieces if p.view is None]
        if missing:
            raise RefitError(f"source pieces without views: {missing[:5]}")
        return pieces

    def _make_executor(self, schedule: Schedule, bucket: int) -> SendExecutor:
        return SendExecutor(schedule.rounds_of_source(self.rank), self.transport, self.sizes[TRAIN],
                            bucket_bytes=bucket, num_buffers=self.options.num_buffers,
                            fingerprint=schedule.fingerprint, timeout_s=self.options.timeout_s)

    def setup(self) -> Schedule:
        schedule = super().setup()
        self._bind(self._pieces)
        return schedule

    def send(self, version: int) -> StepStats:
        """Send the model's current weights as weight ``version``; returns this rank's step stats."""
        self._require_setup()
        stats = self._executor.run(version)
        log.info("refit sent version %d: %s in %.3f s (%.2f GB/s)", version, format_bytes(stats.bytes),
                 stats.seconds, stats.gbps)
        return stats


class RefitReceiver(_Endpoint):
    """The gen side of a refit, one per gen rank. ``receive()`` every step lands one weight version."""

    side = GEN
    _bound = False

    def _local_pieces(self) -> list[Piece]:
        mapping = self.plugins.destination_map(self.model)
        self._loader = list(mapping.loader)
        loader = [DestinationPiece(spec, spec.full_box()) for spec in self._loader]
        return list(mapping.pieces) + loader

    def _make_executor(self, schedule: Schedule, bucket: int) -> ReceiveExecutor:
        return ReceiveExecutor(schedule.rounds_of_destination(self.rank), self.transport, 0,
                               bucket_bytes=bucket,
                               num_buffers=self.options.num_buffers, fingerprint=schedule.fingerprint,
                               timeout_s=self.options.timeout_s)

    def _bind_step(self) -> list[tuple[str, torch.Tensor]]:
        """(Re)bind destination views for this step; returns the fresh loader-path tensors."""
        rebind = self.plugins.begin_update(self.model)
        if rebind:
            pieces = self._local_pieces()
            if [p.meta for p in pieces] != [p.meta for p in self._pieces]:
                raise RefitError("the generation model's destination pieces changed after "
                                 "refit_begin_update; a plugin must return the same pieces every time")
            self._pieces = pieces
        if not self._loader:
            if rebind or not self._bound:
                self._bind(self._pieces)
                self._bound = True
            return []
        fast = len(self._pieces) - len(self._loader)
        buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in self._loader]
        loaded = [DestinationPiece(s, s.full_box(), b) for s, b in zip(self._loader, buffers)]
        self._bind(self._pieces[:fast] + loaded)
        return [(s.name, b) for s, b in zip(self._loader, buffers)]

    def receive(self) -> StepStats:
        """Receive one step's weights into the engine; ``stats.version`` is the sender's version."""
        self._require_setup()
        try:
            loader_weights = self._bind_step()
            stats = self._executor.run()
            if loader_weights:
                self.plugins.load_weights(self.model, _ungrouped(loader_weights, self.plugins))
        except Exception:
            self.plugins.abort_update(self.model)
            raise
        self.plugins.finish_update(self.model, stats.version)
        log.info("refit received version %d: %s in %.3f s (%.2f GB/s)", stats.version,
                 format_bytes(stats.bytes), stats.seconds, stats.gbps)
        return stats


def _ungrouped(weights: list[tuple[str, torch.Tensor]], pm: PluginManager) -> list[tuple[str, torch.Tensor]]:
    """Grouped expert tensors back into the checkpoint's per-expert names, for an engine's loader."""
    out = []
    for name, tensor in weights:
        if pm.expert_name(name) is not None:  # already a per-expert checkpoint name
            out.append((name, tensor))
            continue
        probe = ungroup_name(name, 0) if ".experts." in name else None
        expert = pm.expert_name(probe) if probe else None
        if expert is not None and expert.group == name:
            out.extend((ungroup_name(name, e), tensor[e]) for e in range(tensor.shape[0]))
        else:
            out.append((name, tensor))
    return out


__all__ = ["RefitOptions", "RefitReceiver", "RefitSender", "StepStats"]

"""How long a rank's bind takes on a real plan, as an endpoint binds (``checked_views``, then its network
executor's ``bind``: every segment of its rounds resolved onto local views, direct or staged regions
picked, staging copies planned, the transport's ``register()``), on CPU.

The plan is planned from metadata as :mod:`setup_records` plans it (the plugins' layout hooks, no model
built): by default the Qwen3-30B-A3B shape from ``dtensor:tp=2`` to ``vllm:tp=1,dp=2`` (26k segments,
each bound on both sides: 52k segment bindings), the setup of issue #48. Train rank 0 binds its
``SendExecutor``, gen rank 0 its ``ReceiveExecutor``, each over the views a real rank hands refit:

- train (DTensor over transformers' model): the experts' ``gate``/``up`` are the two halves of one
  fused ``gate_up_proj`` stack (``[:, :I]`` and ``[:, I:]``, not contiguous); every other piece is its
  own tensor (a parameter's local shard, contiguous);
- gen (vLLM): ``q``/``k``/``v`` are row blocks of one fused ``qkv_proj``, ``gate``/``up`` of one
  ``gate_up_proj``, the experts' ``gate``/``up`` the two halves of one ``w13`` stack; every other
  piece is its own tensor.

Memory: every tensor is a ``torch.empty`` on CPU of its real size and dtype (not one flat buffer cut with
``as_strided``, and not the meta device: a bind compares storages and addresses, so each parameter needs
a storage of its own at a real address). Nothing writes them, so the kernel hands out their pages
lazily: a rank's ~30 GB of bf16 weights is address space, not RAM (printed: the process's peak resident
memory). Binding reads only addresses, shapes and strides, so it sees what it sees on a real rank.

Printed: per rank, the messages and segments bound, the best and median time per bind over ``--repeat``
binds (this thread's CPU time: the machine's cores are shared), and per phase (:data:`PHASES`); with
``--digest``, a hash of everything the bind resolved (posts, staged layout, views as storage and offset,
the planned copies, in an address-free order), equal before and after a change that keeps behaviour;
with ``--profile N``, cProfile's top N functions of one bind.

    .venv/bin/python benchmarks/bind_speed.py --repeat 3 --digest
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import os
import platform
import pstats
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from setup_records import Planned, plan_case  # type: ignore[import-not-found]

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.experts import default_expert_name
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import DestinationPiece, Piece, PieceMeta, SourcePiece
from refit_core.contract.side import Side
from refit_core.endpoints.binding import checked_views
from refit_core.net.transport import Fence, Transport
from refit_core.run.executor import ExecutorSettings, ReceiveExecutor, SendExecutor
from refit_core.run.executor.base import RoundRunner

@dataclass(frozen=True)
class Fused:
    """Pieces that are blocks of one tensor: names matching ``pattern`` (group 1: the module, group 2: the
    member), stacked in ``order`` along ``dim``."""

    pattern: re.Pattern[str]
    order: tuple[str, ...]
    dim: int


EXPERTS_GATE_UP = Fused(re.compile(r"(.*\.mlp\.experts)\.(gate|up)_proj\.weight$"), ("gate", "up"), 1)
TRAIN_FUSED = (EXPERTS_GATE_UP,)
"""transformers' fused experts: ``gate_up_proj`` ``[E, 2I, H]`` (the DTensor rank's expert shard)."""
GEN_FUSED = (Fused(re.compile(r"(.*\.self_attn)\.(q|k|v)_proj\.weight$"), ("q", "k", "v"), 0),
             Fused(re.compile(r"(.*\.mlp)\.(gate|up)_proj\.weight$"), ("gate", "up"), 0), EXPERTS_GATE_UP)
"""vLLM's ``qkv_proj``, ``gate_up_proj`` and the experts' ``w13``."""


@dataclass
class Memory:
    """A rank's tensors (each its own storage) and every piece's view of them."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    views: list[torch.Tensor] = field(default_factory=list)

    def locate(self, t: torch.Tensor) -> tuple[int, int]:
        """``t``'s storage (as an index into :attr:`tensors`) and its byte offset in it."""
        base = t.untyped_storage().data_ptr()
        return self._index[base], t.data_ptr() - base

    def index(self) -> None:
        self._index = {t.untyped_storage().data_ptr(): i for i, t in enumerate(self.tensors)}


def memory_of(metas: Sequence[PieceMeta], fused: Sequence[Fused]) -> Memory:
    """A rank's views: the ``fused`` groups' pieces as blocks of one tensor each, every other piece a
    contiguous tensor of its own."""
    memory = Memory()
    views: list[torch.Tensor | None] = [None] * len(metas)
    groups: dict[tuple[str, Fused], dict[str, int]] = {}
    for i, meta in enumerate(metas):
        for rule in fused:
            match = rule.pattern.match(meta.spec.name)
            if match is not None:
                groups.setdefault((match.group(1), rule), {})[match.group(2)] = i
                break
        else:
            memory.tensors.append(torch.empty(meta.box.sizes, dtype=meta.spec.dtype))
            views[i] = memory.tensors[-1]
    for (_, rule), members in groups.items():
        parts = [members[name] for name in rule.order if name in members]
        first = metas[parts[0]]
        shape = list(first.box.sizes)
        shape[rule.dim] = sum(metas[i].box.sizes[rule.dim] for i in parts)
        memory.tensors.append(torch.empty(shape, dtype=first.spec.dtype))
        start = 0
        for i in parts:
            views[i] = memory.tensors[-1].narrow(rule.dim, start, metas[i].box.sizes[rule.dim])
            start += metas[i].box.sizes[rule.dim]
    memory.views = [v for v in views if v is not None]
    assert len(memory.views) == len(metas)
    memory.index()
    return memory


class RegisteringTransport(Transport):
    """A CPU transport that only registers (binding never exchanges): counts what it was handed."""

    kind = "bench"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.registered = 0

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = (), *, control: bool = False) -> Fence:
        raise NotImplementedError("binding does not exchange")

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        self.registered = len(tensors)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Rank:
    """One rank to bind: its side, its executor (made fresh per bind), its pieces over its memory."""

    name: str
    side: Side
    make: Callable[[RegisteringTransport], RoundRunner]
    memory: Memory
    pieces: list[Piece]
    counts: dict[str, int]
    segments: int
    messages: int


PHASES = ("check", "resolve", "copies", "register")
"""What a bind spends its time on: checking the pieces' views (``checked_views``: shapes, and on a gen rank
that no two views share a byte); resolving segments to views and picking direct or staged regions (all
that the other phases leave); planning the staging copies; the transport's ``register()``."""


def timed_bind(rank: Rank) -> tuple[RoundRunner, dict[str, float]]:
    """One bind as an endpoint binds (its views checked, then its executor bound), with its phases' seconds."""
    transport = RegisteringTransport()
    executor = rank.make(transport)
    spent = dict.fromkeys(("copies", "register"), 0.0)

    def timing(name: str, fn: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            began = time.thread_time()
            fn(*args)
            spent[name] += time.thread_time() - began
        return run

    executor._plan_copies = timing("copies", executor._plan_copies)  # type: ignore[method-assign]
    transport.register = timing("register", transport.register)  # type: ignore[method-assign]
    began = time.thread_time()
    _, views = checked_views(rank.pieces, rank.side, 0, default_expert_name, rank.counts)
    checked = time.thread_time()
    executor.bind(views)
    done = time.thread_time()
    return executor, {"total": done - began, "check": checked - began,
                      "resolve": done - checked - spent["copies"] - spent["register"], **spent}


def digest(executor: RoundRunner, memory: Memory) -> str:
    """A hash of what ``executor`` bound, views named by storage and offset (addresses vary run to run)."""
    def where(t: torch.Tensor) -> tuple:
        return (*memory.locate(t), t.dtype, tuple(t.shape), t.stride())

    h = hashlib.sha256()
    h.update(repr((executor.buffer_bytes, executor.direct_bytes)).encode())
    for plan in executor.plans:
        h.update(repr([(p.peer, p.nbytes, p.staging_offset, None if p.direct is None else where(p.direct))
                       for p in plan.posts]).encode())
        h.update(repr((plan.staged_bytes, plan.segments, plan.planned, sorted(plan.direct_pieces),
                       sorted(plan.staged_pieces))).encode())
        h.update(repr([where(v) for v in plan.views]).encode())
        copies = plan.copies
        if copies is not None:  # merged copies come in an order that follows storage addresses: sorted here
            h.update(repr(sorted(repr((where(v), layout)) for v, layout in copies.singles)).encode())
            h.update(repr(sorted(repr((key, sorted(repr((where(v), layout)) for v, layout in zip(views, layouts))))
                                 for key, (views, layouts) in copies.batches.items())).encode())
            runs = getattr(copies, "runs", None)
            if runs is not None and runs._runs:  # small contiguous copies moved as runs
                h.update(repr([(r.start, r.end, r.word, r.sizes) for r in runs._runs]).encode())
        quantization = getattr(plan, "quantization", None)
        h.update(repr(quantization is None).encode())
    return h.hexdigest()[:16]


def ranks(planned: Planned) -> list[Rank]:
    """Train rank 0 and gen rank 0, with their executors' settings as a CUDA setup resolves them."""
    schedule = planned.schedule
    options = RefitOptions().resolved("cuda")
    assert options.bucket_bytes is not None
    settings = ExecutorSettings(options.bucket_bytes, options.num_buffers, options.messages.zero_copy,
                                schedule.fingerprint, options.timeout_s, options.mode)
    sent, received = schedule.rounds_of_source(0), schedule.rounds_of_destination(0)
    train, gen = memory_of(planned.metas[TRAIN][0], TRAIN_FUSED), memory_of(planned.metas[GEN][0], GEN_FUSED)
    return [
        Rank("train rank 0 (send)", Side.TRAIN, lambda t: SendExecutor(sent, t, schedule.num_src, settings), train,
             [SourcePiece(m.spec, m.box, v) for m, v in zip(planned.metas[TRAIN][0], train.views)],
             planned.counts[TRAIN], sum(len(m.src_segments) for msgs in sent for m in msgs), sum(map(len, sent))),
        Rank("gen rank 0 (receive)", Side.GEN, lambda t: ReceiveExecutor(received, t, 0, settings), gen,
             [DestinationPiece(m.spec, m.box, v) for m, v in zip(planned.metas[GEN][0], gen.views)],
             planned.counts[GEN], sum(len(m.dst_segments) for msgs in received for m in msgs),
             sum(map(len, received))),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b-shape")
    parser.add_argument("--train", default="dtensor:tp=2")
    parser.add_argument("--gen", default="vllm:tp=1,dp=2")
    parser.add_argument("--repeat", type=int, default=3, help="binds per side (best and median printed)")
    parser.add_argument("--digest", action="store_true", help="print a hash of what each bind resolved")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one bind: top N functions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    planned = plan_case(args.model, args.train, args.gen)
    schedule = planned.schedule
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or 'unknown'}), "
          f"torch {torch.__version__}, Python {platform.python_version()}")
    print(f"{args.model} {args.train} -> {args.gen}: {schedule.summary.segments} segments in the plan, "
          f"{schedule.summary.messages} messages, {schedule.summary.rounds} rounds (planned in {planned.plan_s:.1f} s)")
    print("\n| rank | messages | segments | bind best | bind median | " + " | ".join(PHASES) + " | per segment |")
    print("|---|" + "---:|" * (len(PHASES) + 5))
    notes = []
    for rank in ranks(planned):
        runs = [timed_bind(rank) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r[1]["total"])[1]
        median = statistics.median(r[1]["total"] for r in runs)
        phases = " | ".join(f"{best[p] * 1e3:.1f} ms" for p in PHASES)
        print(f"| {rank.name} | {rank.messages} | {rank.segments} | {best['total'] * 1e3:.1f} ms "
              f"| {median * 1e3:.1f} ms | {phases} | {best['total'] / max(rank.segments, 1) * 1e6:.1f} us |",
              flush=True)
        if args.digest:
            notes.append(f"{rank.name}: bound {digest(runs[0][0], rank.memory)}")
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(timed_bind, rank)
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
            notes.append(f"profile of one bind, {rank.name}:\n{out.getvalue()}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\npeak resident memory: {rss:.2f} GiB (the ranks' tensors are untouched torch.empty: address space)")
    for line in notes:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

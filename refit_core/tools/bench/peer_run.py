"""One process of the checkpoint-engine comparison: its models, the methods it takes part in, the step loop."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core.kit.models import load_config
from refit_core.tools.bench import layouts
from refit_core.tools.bench.barrier import Barrier
from refit_core.tools.bench.comms import open_bench_comm
from refit_core.tools.bench.copybound import CopyBound, sync_device
from refit_core.tools.bench.fit import Fit, memory_budget
from refit_core.tools.bench.peer_ce import CeServer, ce_receive, ce_settings, engine_loader, hf_state, ignore_weights
from refit_core.tools.bench.peer_layout import CE, REFIT, Layout, Role, fit_model
from refit_core.tools.bench.wire import checksum


class _Run:
    """One process's part: its models, the methods it takes part in and the step loop."""

    def __init__(self, rank: int, job: dict[str, Any]) -> None:
        self.rank, self.job = rank, job
        self.layout = Layout(job["gpus"])
        cuda = job["device"] == "cuda"
        self.device = torch.device("cuda", self.layout.device_index(rank)) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        host, port = job["sync_address"].rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=rank == 0,
                                   timeout=timedelta(seconds=job["timeout_s"]), wait_for_workers=False)
        self.barrier = Barrier(self.store, self.layout.nprocs)
        self.methods: list[str] = job["methods"]
        self.server: CeServer | None = None
        self.zmq_ctx: Any = None
        if CE in self.methods:
            self._open_ce()

    def _open_ce(self) -> None:
        ps_rank = self.layout.ps_rank(self.rank)
        if ps_rank is not None:
            host, port = self.job["ce_address"].rsplit(":", 1)
            self.server = CeServer(ps_rank, self.layout.gpus, (host, int(port)), self.device, self.store)
        if self.layout.worker_of(self.rank) is not None:
            import zmq

            self.zmq_ctx = zmq.Context()

    def close(self) -> None:
        """End checkpoint-engine's ZMQ contexts now (linger 0), so that no exit waits on them."""
        contexts = [self.zmq_ctx, getattr(self.server.ps, "_zmq_ctx", None) if self.server is not None else None]
        for context in contexts:
            if context is not None:
                context.destroy(linger=0)
        self.server = self.zmq_ctx = None

    def log(self, text: str) -> None:
        """Progress on stderr (the trainer's only)."""
        if self.rank == Role.TRAINER:
            print(f"[peer {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    def timed(self, key: str, work: Callable[[], Any]) -> float:
        """``work`` from a common barrier to its end on this rank; the largest over the ranks."""
        self.barrier()
        start = time.perf_counter()
        work()
        sync_device(self.device)
        return self.barrier.max(key, self.rank, time.perf_counter() - start)

    def model(self, number: int, name: str) -> dict[str, Any]:
        """Model ``number`` (``name``) as far as it fits: this process's times and checks, or why it was skipped."""
        job, layout = self.job, self.layout
        config = load_config(name)
        budget = memory_budget(self.device, job.get("memory_gib")) if self.device.type == "cuda" else None
        fit = fit_model(name, config, budget, layout, job["bound_bytes"])
        if fit.skipped:
            return {"model": name, "skipped": fit.reason}
        config = fit.config(config)
        trainer = engine = None
        if self.rank == Role.TRAINER:
            trainer = layouts.MegatronStyleModel(config, tp=1, rank=0, device=self.device)
        if self.rank == Role.ENGINE:
            engine = layouts.VllmStyleModel(config, tp=1, rank=0, device=self.device)
        self.log(f"{fit.label}: methods {self.methods}, bound {layout.bound}")
        return self._steps(number, fit, trainer, engine)

    def _open_refit(self, number: int, trainer: Any, engine: Any) -> Any:
        """This process's refit endpoint for model ``number``, set up (None: it takes no part in refit)."""
        from refit_core import RefitOptions, RefitReceiver, RefitSender

        if REFIT not in self.methods or self.rank not in (Role.TRAINER, Role.ENGINE):
            return None
        cls = RefitSender if self.rank == Role.TRAINER else RefitReceiver
        refit = cls(trainer if self.rank == Role.TRAINER else engine, rendezvous=self.job["refit_addresses"][number],
                    rank=0, world_size=1, options=RefitOptions(timeout_s=self.job["timeout_s"]))
        refit.setup()
        return refit

    def _steps(self, number: int, fit: Fit, trainer: Any, engine: Any) -> dict[str, Any]:
        """Every step of every method on model ``number``, interleaved, and the bound between them."""
        job, layout, rank = self.job, self.layout, self.rank
        refit = self._open_refit(number, trainer, engine)
        self.barrier()
        bound: Any = None
        nbytes = self.model_bytes(number, trainer)
        if layout.gpus == 1 and rank == Role.ENGINE:
            bound = CopyBound(nbytes, self.device, job["bound_bytes"])
        wire = self._open_wire(number, nbytes) if layout.gpus == 2 and rank in (Role.TRAINER, Role.ENGINE) else None
        load = engine_loader(engine) if engine is not None else ignore_weights
        times: dict[str, list[float]] = {m: [] for m in [*self.methods, layout.bound]}
        ce: dict[str, list[float]] = {"h2d": [], "register": [], "gather_metas": []}
        checks: dict[str, str] = {}
        steps = job["warmup"] + job["iters"]
        for i in range(steps):
            seed, last, timed = 1000 * number + i, i == steps - 1, i >= job["warmup"]
            if trainer is not None:
                trainer.fill(seed=seed)
            for method in self.methods:
                if last and engine is not None:
                    engine.poison()
                seconds = self._step(method, number, i, trainer, load, ce, refit, last)
                if timed:
                    times[method].append(seconds)
                if last and engine is not None:
                    bad = engine.mismatches(seed=seed)
                    checks[method] = "bitwise ok" if not bad else f"{len(bad)} pieces differ, e.g. {bad[:3]}"
            if layout.gpus == 2:
                seconds = self.timed(f"wire/{number}/{i}", wire.step if wire is not None else lambda: None)
                if timed:
                    times["wire"].append(seconds)
            else:
                self.barrier()  # the copy bound, the others idle
                if bound is not None and timed:
                    bound.sample()
                self.barrier()
            self.log(f"{fit.label} step {i + 1}/{steps}: " + ", ".join(
                f"{m} {1000 * t[-1]:.2f} ms" for m, t in times.items() if t and m != layout.bound and timed))
        if bound is not None:
            times["copy-bound"] = bound.samples
            bound.close()
        if wire is not None:
            checks["wire"] = wire.check(self.store, f"peer-wire/{number}/checksum", self.rank == Role.TRAINER)
        if refit is not None:
            refit.close()
        settings = ce_settings(self.server) if CE in self.methods and self.rank == Role.TRAINER else None
        if self.server is not None:
            self.server.release(last=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"model": fit.label, "bytes": nbytes, "times": times, "ce": ce, "checks": checks,
                "ce_settings": settings,
                "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}

    def model_bytes(self, number: int, trainer: Any) -> int:
        """The model's bytes, published by the trainer (the other ranks may hold no model)."""
        key = f"bytes/{number}"
        if trainer is not None:
            self.store.set(key, str(trainer.nbytes))
        self.store.wait([key])
        return int(self.store.get(key).decode())

    def _step(self, method: str, number: int, i: int, trainer: Any, load: Callable, ce: dict[str, list[float]],
              refit: Any, last: bool) -> float:
        if method == REFIT:
            def work() -> None:
                if self.rank == Role.TRAINER:
                    refit.send(version=i)
                elif self.rank == Role.ENGINE:
                    refit.receive()
            return self.timed(f"refit/{number}/{i}", work)
        # checkpoint-engine: register (host copy) and gather metas untimed, then the timed update
        server = self.server
        if server is not None:
            start = time.perf_counter()
            state = hf_state(trainer, self.device) if trainer is not None else None
            server.register(state)
            del state
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the gathered tensors: checkpoint-engine sizes its buckets by free memory
            if self.rank == Role.TRAINER:
                ce["register"].append(time.perf_counter() - start)
        h2d: list[float] = []
        worker = self.layout.worker_of(self.rank)
        key = f"ce/{number}/{i}"

        def update() -> None:
            if server is not None:
                h2d.append(server.update(f"{key}/{server.rank}"))
            if worker is not None:
                ce_receive(self.store, f"{key}/{worker}", self.device, load, self.zmq_ctx)
        seconds = self.timed(f"ce/{number}/{i}", update)
        if self.rank == Role.TRAINER and i >= self.job["warmup"]:
            ce["h2d"].append(h2d[0])
        if server is not None and not last:
            server.release(last=False)  # the shared pinned pool stays for the next registration
        return seconds

    def _open_wire(self, number: int, nbytes: int) -> PeerWire:
        comm = open_bench_comm(self.store, f"peer-wire/{number}", 2, 0 if self.rank == Role.TRAINER else 1,
                               self.device)
        return PeerWire(comm, nbytes, self.device, self.rank == Role.TRAINER)


class PeerWire:
    """The two-GPU bound: one NCCL send of the model's bytes, trainer -> engine, in one buffer."""

    def __init__(self, comm: Any, nbytes: int, device: torch.device, sender: bool) -> None:
        self.comm, self.sender = comm, sender
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if sender:
            self.buffer.random_(0, 256)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def step(self) -> None:
        if self.sender:
            self.comm.post([(1, self.buffer)], [], self.stream)
        else:
            self.comm.post([], [(0, self.buffer)], self.stream)

    def check(self, store: Any, key: str, publish: bool) -> str:
        """The receiver's checksum against the sender's (published under ``key``); closes the communicator."""
        total = checksum(self.buffer)
        if publish:
            store.set(key, str(total))
        store.wait([key])
        ok = int(store.get(key).decode()) == total
        self.comm.close()
        return "checksum ok" if ok else "CHECKSUM MISMATCH"


def run_process(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    layouts.register()
    run = _Run(rank, job)
    models = [run.model(n, name) for n, name in enumerate(job["models"])]
    run.barrier()
    run.close()
    run.barrier.leave(rank)
    return {"rank": rank, "models": models}


__all__ = ["PeerWire", "run_process"]

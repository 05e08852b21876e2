"""checkpoint-engine's two sides, driven through its own API: a ``ParameterServer`` rank and the engine's receiver."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from refit_core.tools.bench.hftensors import hf_tensors, materialize, scatter

CHECKPOINT = "bench"


def hf_state(model: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The trainer's weights as a HF state dict (per-expert names), what a trainer registers."""
    return {spec.name: materialize(spec, parts, device) for spec, parts in hf_tensors(model)}


def engine_loader(model: Any) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
    """A ``load_weights`` for the vLLM-style engine: each named HF tensor into its places."""
    parts = {spec.name: p for spec, p in hf_tensors(model)}

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if name not in parts:
                raise KeyError(f"the engine holds no tensor named {name!r}")
            scatter(tensor, parts[name])
    return load


def ignore_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
    """The loader of checkpoint-engine rank 0's worker in the two-GPU run: no engine on the trainer's GPU."""


def _device_uuid(device: torch.device) -> str:
    """The name checkpoint-engine gives a GPU in ``req_func``'s socket paths."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid!s}"


class CeServer:
    """One ``ParameterServer`` rank, with its host-to-device time and chosen bucket recorded per update."""

    def __init__(self, rank: int, world: int, address: tuple[str, int], device: torch.device, store: Any) -> None:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)  # it reads them when rank is 0
        import checkpoint_engine.ps as ce_ps

        try:
            ce_ps.get_ip()
            self.ip_note = ""
        except OSError as exc:  # no route and no resolvable hostname: only its metadata holds the address
            ce_ps.get_ip = lambda: "127.0.0.1"
            self.ip_note = f"get_ip failed ({exc}): 127.0.0.1 given"
        self.rank, self.store, self.device = rank, store, device
        self.ps = ce_ps.ParameterServer(rank=rank, world_size=world, master_addr=address[0], master_port=address[1])
        self.h2d: list[float] = []
        self.buckets: list[tuple[int, bool]] = []
        copy, detect = self.ps._copy_to_buffer, self.ps._detect_bucket_size

        def timed_copy(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            copy(*args, **kwargs)
            self.h2d.append(time.perf_counter() - start)

        def recorded_detect(*args: Any, **kwargs: Any) -> tuple[int, bool]:
            out = detect(*args, **kwargs)
            self.buckets.append(out)
            return out

        self.ps._copy_to_buffer, self.ps._detect_bucket_size = timed_copy, recorded_detect
        self.uuid: str = getattr(self.ps, "_device_uuid", None) or _device_uuid(device)

    def register(self, state: dict[str, torch.Tensor] | None) -> None:
        """Register ``state`` (None: this rank holds no checkpoint) and gather every rank's metadata."""
        if state is not None:
            self.ps.register_checkpoint(CHECKPOINT, named_tensors=state, use_shared_memory_pool=True)
        self.ps.gather_metas(CHECKPOINT)

    def update(self, key: str) -> float:
        """One timed ``update``; returns its host-to-device seconds."""
        self.h2d = []

        def req_func(socket_paths: list[tuple[str, str]]) -> None:
            paths = dict(socket_paths)
            if self.uuid not in paths:  # said before the server waits for a worker that never comes
                print(f"checkpoint-engine rank {self.rank}: no socket path for {self.uuid} in {sorted(paths)}",
                      file=sys.stderr, flush=True)
                os._exit(3)
            self.store.set(key, paths[self.uuid])

        self.ps.update(CHECKPOINT, req_func)
        return sum(self.h2d)

    def release(self, last: bool) -> None:
        """Unregister the checkpoint on rank 0 (``last``: its shared pinned pool too)."""
        if self.rank == 0:
            self.ps.unregister_checkpoint(CHECKPOINT, force=last)


def ce_receive(store: Any, key: str, device: torch.device, load: Callable, zmq_ctx: Any) -> None:
    """The engine side of one ``update``: wait for its address, then checkpoint-engine's own receiver."""
    from checkpoint_engine.worker import update_weights_from_ipc

    store.wait([key])
    handle = store.get(key).decode()
    update_weights_from_ipc(zmq_ctx, handle, device.index, run=load)


def ce_settings(server: CeServer | None) -> dict[str, Any]:
    """checkpoint-engine's settings as it ran (with ``server``: the buckets it chose)."""
    import checkpoint_engine

    out: dict[str, Any] = {"version": checkpoint_engine.__version__, "auto_pg": True, "ranks": None,
                           "PS_MEM_FRACTION": os.environ.get("PS_MEM_FRACTION", "0.9 (default)"),
                           "PS_MAX_BUCKET_SIZE_GB": os.environ.get("PS_MAX_BUCKET_SIZE_GB", "8 (default)"),
                           "backend": "torch nccl (default)", "use_shared_memory_pool": True}
    if server is not None:
        sizes = sorted({b for b, _ in server.buckets})
        out["bucket_bytes"] = sizes
        out["h2d_buffer"] = sorted({not disabled for _, disabled in server.buckets})
        if server.ip_note:
            out["note"] = server.ip_note
    return out


__all__ = ["CeServer", "ce_receive", "ce_settings", "engine_loader", "hf_state", "ignore_weights"]

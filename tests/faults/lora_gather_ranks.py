"""Rank programs for the merged-mode LoRA gather test: two train ranks whose adapters' ``gather()`` is a
collective over the trainer's own gloo group (as DTensor ``full_tensor()`` is), one gen rank; train rank 1
fails before ``send()`` in the second step."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from refit_core import LoraFactors, LoraMerge, MergedSourcePiece, RefitOptions, RefitReceiver, RefitSender, TensorSpec
from refit_core.contract.pieces import DestinationPiece
from refit_core.tools.bench.lora import Holder, register

TRAIN, GEN = 2, 1
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj")
SHAPE, R, SCALE = (8, 8), 2, 2.0
TRAINER_GROUP_TIMEOUT_S = 120
"""The trainer's own process group's timeout: what bounded the wait before (125.6 s at timeout_s=10)."""


class CollectiveAdapters:
    """Whole A and B of every module, after a collective over the train ranks' own group each step."""

    def gather(self) -> dict[str, LoraFactors]:
        dist.all_reduce(torch.ones(1))
        return {m: LoraFactors(torch.full((R, SHAPE[1]), 0.5), torch.full((SHAPE[0], R), 0.25)) for m in MODULES}


def spec(module: str) -> TensorSpec:
    return TensorSpec(f"{module}.weight", SHAPE, torch.float32)


def lora_gather_rank(rank: int, report, address: str, group_address: str, timeout_s: float) -> dict:
    """Train rank 0 or 1 holds one merged weight each; the gen rank both. Two steps; train rank 1 raises
    before the second ``send()`` and stays alive past the deadline, as a trainer stuck in its own error
    handling would."""
    pm = register()
    options = RefitOptions(timeout_s=timeout_s, secret="h3-lora", bucket_bytes=1024)
    if rank < TRAIN:
        host, port = group_address.rsplit(":", 1)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=TRAIN,
                                timeout=timedelta(seconds=TRAINER_GROUP_TIMEOUT_S))
        merge = LoraMerge(MODULES[rank], SCALE, CollectiveAdapters())
        s = spec(MODULES[rank])
        holder = Holder([MergedSourcePiece(s, s.full_box(), torch.ones(SHAPE), merge=merge)], True)
        endpoint: RefitSender | RefitReceiver = RefitSender(holder, rendezvous=address, rank=rank, world_size=TRAIN,
                                                            options=options, plugins=pm, host_id=f"train{rank}")
    else:
        pieces = [DestinationPiece(spec(m), spec(m).full_box(), torch.zeros(SHAPE)) for m in MODULES]
        holder = Holder(pieces, False)
        endpoint = RefitReceiver(holder, rendezvous=address, rank=0, world_size=GEN, options=options, plugins=pm,
                                 host_id="gen")
    endpoint.setup()
    out: dict = {"steps": []}
    for step in (1, 2):
        start = time.monotonic()
        try:
            if isinstance(endpoint, RefitSender):
                if step == 2 and rank == 1:
                    out["steps"].append({"error": "failed before send()"})
                    time.sleep(3 * timeout_s)  # its own error handling, still holding the trainer's group
                    break
                endpoint.send(step)
                out["steps"].append({"ok": True})
            else:
                endpoint.receive()
                expected = 1.0 + SCALE * R * 0.5 * 0.25
                out["steps"].append({"ok": True, "merged": all(bool((p.view == expected).all()) for p in pieces)})
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["steps"].append({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start})
            break
    endpoint.close()
    return out

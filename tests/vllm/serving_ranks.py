"""Rank program of ``test_vllm_serving.py`` (spawned, so importable at top level)."""

from __future__ import annotations

from typing import Any


def gather_rank(rank: int, world: int, port: int, states: list[Any]) -> list[Any]:
    """Gather this rank's state over a gloo group; the gathered states as plain rows."""
    import torch.distributed as dist
    from refit_vllm.serving import RankState, Suspect, gather_over

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        r, version, suspect = states[rank]
        gathered = gather_over(RankState(r, version, Suspect(suspect) if suspect else None), dist.group.WORLD, world)
    finally:
        dist.destroy_process_group()
    return [(s.rank, s.version, None if s.suspect is None else s.suspect.name) for s in gathered]

"""Rank program of ``test_vllm_serving.py`` (spawned, so importable at top level)."""

from __future__ import annotations

from typing import Any


def gather_rank(rank: int, world: int, port: int, states: list[Any]) -> list[Any]:
    """Gather this rank's state over a gloo group; the gathered states as plain rows."""
    import torch.distributed as dist
    from refit_core.kit import RankState, Suspect, WorkerReport, gather_reports

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        r, version, suspect = states[rank]
        mine = WorkerReport(RankState(r, version, Suspect(suspect) if suspect else None), failed=rank == 1)
        gathered = gather_reports(mine, dist.group.WORLD, world)
    finally:
        dist.destroy_process_group()
    return [(g.state.rank, g.state.version, None if g.state.suspect is None else g.state.suspect.name, g.failed)
            for g in gathered]

"""``refit bench --timeline out.png``: one refit step as a Gantt chart, every rank's lanes on one time axis.

One row per (rank, lane): the copy lane's packing (sender) or unpacking (receiver), and each
transport lane's transfers (one per CUDA stream on NCCL), coloured by phase, so the overlap of
packing round k+1, sending round k and unpacking round k-1 is visible. Ranks are lined up by their
step's start on the machine's clock (:attr:`~refit_core.run.timing.StepTimeline.start`). Needs
matplotlib (``pip install 'refit-core[plot]'``).
"""

from __future__ import annotations

from collections.abc import Sequence

from refit_core.contract.errors import RefitError
from refit_core.run.timing import Phase, StepTimeline

COLORS = {Phase.HEADER: "tab:gray", Phase.PACK: "tab:blue", Phase.TRANSFER: "tab:orange", Phase.UNPACK: "tab:green"}


def write_timeline_picture(ranks: Sequence[tuple[str, StepTimeline]], path: str, title: str = "") -> str:
    """Draw each ``(rank label, recorded step)`` into the PNG ``path``; returns ``path``."""
    if not ranks:
        raise RefitError("refit bench --timeline: no rank recorded a step (did a refit method run?)")
    try:
        import matplotlib
    except ImportError:
        raise RefitError("refit bench --timeline needs matplotlib: pip install 'refit-core[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(step.start for _, step in ranks)
    rows: list[tuple[str, list[tuple[float, float, Phase]]]] = []
    for label, step in ranks:
        shift = step.start - origin
        for lane, spans in step.lanes().items():
            rows.append((f"{label} {lane}", [((s.start + shift) * 1e3, (s.end - s.start) * 1e3, s.phase)
                                             for s in spans]))
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.6))
    for y, (_, bars) in enumerate(rows):
        for start, width, phase in bars:
            ax.barh(y, max(width, 1e-3), left=start, height=0.7, color=COLORS[phase], edgecolor="none")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first rank's step started")
    ax.set_title(title or "refit step timeline")
    ax.legend(handles=[Patch(color=c, label=p.value) for p, c in COLORS.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["write_timeline_picture"]

"""Pictures of a refit: a plan's traffic (``refit plan --explain``) and a step's timeline (``refit bench --timeline``).

**A plan's traffic** (:func:`write_plan_picture`). Left, a heatmap of bytes from every train rank (rows) to
every gen rank (columns): replicas balanced by the planner show as even rows, a hot sender as a bright row.
Right, the busiest GPU links of the simulated topology (bytes each direction, coloured by link kind), so the
bottleneck is the top bar.

**A step's timeline** (:func:`write_timeline_picture`): one refit step as a Gantt chart, every rank's lanes
on one time axis. One row per (rank, lane): the copy lane's packing (sender) or unpacking (receiver), and
each transport lane's transfers (one per CUDA stream on NCCL), coloured by phase, so the overlap of packing
round k+1, sending round k and unpacking round k-1 is visible. Ranks are lined up by their step's start on
the machine's clock (:attr:`~refit_core.run.timing.StepTimeline.start`).

Both need matplotlib (``pip install 'refit-core[plot]'``), imported only when a picture is drawn.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from refit_core.contract.errors import RefitError
from refit_core.plan.schedule import Schedule
from refit_core.plan.simulate import LinkKind, Simulation
from refit_core.run.timing import Phase, StepTimeline

MAX_BARS = 16
"""The busiest links :func:`write_plan_picture` draws."""
LINK_COLORS = {LinkKind.NVLINK: "tab:green", LinkKind.NIC: "tab:orange", LinkKind.LOCAL: "tab:blue"}
PHASE_COLORS = {Phase.HEADER: "tab:gray", Phase.PACK: "tab:blue", Phase.TRANSFER: "tab:orange",
                Phase.UNPACK: "tab:green"}


def _pyplot(command: str) -> Any:
    """``matplotlib.pyplot`` drawing off screen; a :class:`RefitError` naming ``command`` without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise RefitError(f"{command} needs matplotlib: pip install 'refit-core[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str, dpi: int) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def traffic_matrix(schedule: Schedule) -> list[list[int]]:
    """Bytes from train rank i to gen rank j: ``matrix[i][j]``."""
    matrix = [[0] * schedule.num_dst for _ in range(schedule.num_src)]
    for msgs in schedule.rounds:
        for m in msgs:
            matrix[m.src][m.dst] += m.nbytes
    return matrix


def write_plan_picture(schedule: Schedule, simulation: Simulation, path: str, title: str = "") -> str:
    """Draw ``schedule``'s traffic and ``simulation``'s busiest links into the PNG ``path``; returns ``path``."""
    plt = _pyplot("refit plan --explain")
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    raw = traffic_matrix(schedule)
    peak = max((n for row in raw for n in row), default=0)
    unit, scale = next(((u, float(f)) for u, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                        if peak >= f), ("bytes", 1.0))
    matrix = [[n / scale for n in row] for row in raw]
    fig, (heat, bars) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1.1, 1]})
    image = heat.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
    heat.xaxis.set_major_locator(MaxNLocator(integer=True))
    heat.yaxis.set_major_locator(MaxNLocator(integer=True))
    heat.set_xlabel("gen rank")
    heat.set_ylabel("train rank")
    heat.set_title(f"bytes per rank pair ({schedule.num_src} x {schedule.num_dst})")
    fig.colorbar(image, ax=heat, label=unit)

    loads: dict[tuple[int, LinkKind, str], int] = defaultdict(int, simulation.load_bytes)
    rate = simulation.topology.rate
    top = sorted(loads, key=lambda d: -loads[d] / rate(d[1]))[:MAX_BARS]
    labels = [f"GPU {gpu} {kind.value} {way}" for gpu, kind, way in top]
    seconds = [loads[d] / rate(d[1]) * 1e3 for d in top]
    bars.barh(range(len(top)), seconds, color=[LINK_COLORS[d[1]] for d in top])
    bars.set_yticks(range(len(top)), labels, fontsize=8)
    bars.invert_yaxis()
    bars.axvline(simulation.bound_s * 1e3, color="grey", linestyle="--", label="receiver-side bound")
    if simulation.sender_bound_s > simulation.bound_s:
        bars.axvline(simulation.sender_bound_s * 1e3, color="black", linestyle=":", label="sender-side bound")
    bars.set_xlim(left=0)
    bars.set_xlabel("ms at the link's rate (bytes / GB/s)")
    bars.set_title(f"busiest GPU links: predicted {simulation.predicted_s * 1e3:.3g} ms")
    handles = [Patch(color=color, label=kind.value) for kind, color in LINK_COLORS.items()]
    handles.extend(bars.get_legend_handles_labels()[0])
    bars.legend(handles=handles, loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path, dpi=100)


def write_timeline_picture(ranks: Sequence[tuple[str, StepTimeline]], path: str, title: str = "") -> str:
    """Draw each ``(rank label, recorded step)`` into the PNG ``path``; returns ``path``."""
    if not ranks:
        raise RefitError("refit bench --timeline: no rank recorded a step (did a refit method run?)")
    plt = _pyplot("refit bench --timeline")
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
            ax.barh(y, max(width, 1e-3), left=start, height=0.7, color=PHASE_COLORS[phase], edgecolor="none")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first rank's step started")
    ax.set_title(title or "refit step timeline")
    ax.legend(handles=[Patch(color=c, label=p.value) for p, c in PHASE_COLORS.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _save(plt, fig, path, dpi=110)


__all__ = ["LINK_COLORS", "MAX_BARS", "PHASE_COLORS", "traffic_matrix", "write_plan_picture",
           "write_timeline_picture"]

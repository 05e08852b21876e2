"""``refit plan --explain out.png``: a plan's traffic as a picture.

Left, a heatmap of bytes from every train rank (rows) to every gen rank (columns): replicas balanced
by the planner show as even rows, a hot sender as a bright row. Right, the busiest GPU links of the
simulated topology (bytes each direction, coloured by link kind), so the bottleneck is the top bar.
Needs matplotlib (``pip install 'refit-core[plot]'``).
"""

from __future__ import annotations

from collections import defaultdict

from refit_core.contract.errors import RefitError
from refit_core.plan.schedule import Schedule
from refit_core.plan.simulate import LinkKind, Simulation

MAX_BARS = 16
_COLORS = {LinkKind.NVLINK: "tab:green", LinkKind.NIC: "tab:orange", LinkKind.LOCAL: "tab:blue"}


def traffic_matrix(schedule: Schedule) -> list[list[int]]:
    """Bytes from train rank i to gen rank j: ``matrix[i][j]``."""
    matrix = [[0] * schedule.num_dst for _ in range(schedule.num_src)]
    for msgs in schedule.rounds:
        for m in msgs:
            matrix[m.src][m.dst] += m.nbytes
    return matrix


def write_plan_picture(schedule: Schedule, simulation: Simulation, path: str, title: str = "") -> str:
    """Draw ``schedule``'s traffic and ``simulation``'s busiest links into the PNG ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise RefitError("refit plan --explain needs matplotlib: pip install 'refit-core[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    bars.barh(range(len(top)), seconds, color=[_COLORS[d[1]] for d in top])
    bars.set_yticks(range(len(top)), labels, fontsize=8)
    bars.invert_yaxis()
    bars.axvline(simulation.bound_s * 1e3, color="grey", linestyle="--", label="receiver-side bound")
    if simulation.sender_bound_s > simulation.bound_s:
        bars.axvline(simulation.sender_bound_s * 1e3, color="black", linestyle=":", label="sender-side bound")
    bars.set_xlim(left=0)
    bars.set_xlabel("ms at the link's rate (bytes / GB/s)")
    bars.set_title(f"busiest GPU links: predicted {simulation.predicted_s * 1e3:.3g} ms")
    handles = [Patch(color=color, label=kind.value) for kind, color in _COLORS.items()]
    handles.extend(bars.get_legend_handles_labels()[0])
    bars.legend(handles=handles, loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["traffic_matrix", "write_plan_picture"]

"""Draw refit_core's layers as they are: the rooms of each layer (pyproject's import-linter contract) and
the import arrows between them, counted from the code (grimp), into a PNG for docs/architecture.md.

``python scripts/layers-picture.py [--out docs/images/layers.png]``; an arrow drawn red climbs up a layer
(import-linter fails CI on those, so a picture of main shows none).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "refit_core"
PLUGINS = "refit_vllm refit_sglang refit_megatron refit_dtensor".split()


def layers() -> list[list[str]]:
    """The core's layers, top first, each a list of rooms (``(transports)`` marks an optional one)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c.get("containers") == [PACKAGE])
    return [[room.strip(" ()") for room in layer.split("|")] for layer in contract["layers"]]


def room_arrows(rows: list[list[str]]) -> Counter[tuple[str, str]]:
    """How many module-level imports go from each room to each other room (a room: a folder or module of
    the package, or a whole plugin)."""
    graph = grimp.build_graph(PACKAGE, *PLUGINS)
    rooms = {room for row in rows for room in row}

    def room(module: str) -> str | None:
        top, _, rest = module.partition(".")
        if top != PACKAGE:
            return "plugins"
        name = rest.split(".")[0]
        return name if name in rooms else None

    arrows: Counter[tuple[str, str]] = Counter()
    for module in graph.modules:
        here = room(module)
        for imported in graph.find_modules_directly_imported_by(module):
            there = room(imported)
            if here and there and here != there:
                arrows[(here, there)] += 1
    return arrows


def draw(rows: list[list[str]], arrows: Counter[tuple[str, str]], out: Path) -> None:
    rows = [["plugins"], *rows]
    where: dict[str, tuple[float, float]] = {}
    height = len(rows)
    fig, ax = plt.subplots(figsize=(9, 1.05 * height))
    for level, row in enumerate(rows):
        y = height - level - 0.5
        for i, room in enumerate(row):
            x = (i + 0.5) / len(row) * 8 + 0.5
            where[room] = (x, y)
            face = "#fde8c8" if room == "plugins" else "#dbe8f6"
            ax.add_patch(FancyBboxPatch((x - 1.1, y - 0.25), 2.2, 0.5, boxstyle="round,pad=0.02", fc=face, ec="#335",
                                        zorder=2))
            folder = (ROOT / PACKAGE / room).is_dir()
            ax.text(x, y, room + ("/" if folder else ".py" if room != "plugins" else ""), ha="center", va="center",
                    fontsize=10, family="monospace", zorder=3)
    level_of = {room: level for level, row in enumerate(rows) for room in row}
    for (here, there), count in sorted(arrows.items()):
        if here not in where or there not in where:
            continue
        (x0, y0), (x1, y1) = where[here], where[there]
        up = level_of[there] < level_of[here]
        ax.annotate("", xy=(x1, y1 + 0.27 * (1 if y1 < y0 else -1)), xytext=(x0, y0 - 0.27 * (1 if y1 < y0 else -1)),
                    arrowprops={"arrowstyle": "->", "color": "#c00" if up else "#889", "lw": 0.6 + 0.15 * count ** 0.5,
                                "alpha": 0.7, "connectionstyle": "arc3,rad=0.08"}, zorder=1)
    ax.set_xlim(0, 9)
    ax.set_ylim(0, height)
    ax.axis("off")
    ups = sum(1 for (h, t) in arrows if h in level_of and t in level_of and level_of[t] < level_of[h])
    ax.set_title(f"refit_core's layers: {sum(arrows.values())} imports between rooms, {ups} climbing up "
                 "(plugins import only the public faces)", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/images/layers.png")
    args = parser.parse_args()
    rows = layers()
    draw(rows, room_arrows(rows), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

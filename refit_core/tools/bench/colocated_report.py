"""The colocated benchmark's results: one row per (model, method) against the copy bound, and its tables."""

from __future__ import annotations

import json
import os
from typing import Any

from refit_core.run.timing import StepTrace, breakdown
from refit_core.tools.bench.copybound import MIN_BOUND_SAMPLES
from refit_core.tools.bench.validity import Ratio, bound_rate_problem, check_ratio

GiB = 1 << 30


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, method): the trainer's median step, the fraction of the copy bound, memory."""
    train, gen = results
    rows = []
    for t_model, g_model in zip(train["models"], gen["models"]):
        if g_model.get("skipped"):
            continue
        bound = _median(g_model["methods"][0]["seconds"])
        problem = bound_rate_problem(g_model["bytes"], bound, g_model["device_name"])
        t_by = {m["method"]: m for m in t_model["methods"]}
        for g in g_model["methods"]:
            t = t_by.get(g["method"], g)
            seconds = _median(t["seconds"])
            ratio = check_ratio(bound / seconds if seconds else None, "copy bound", problem)
            rows.append({"model": g_model["model"], "method": g["method"], "bytes": g_model["bytes"],
                         "ms": 1000 * seconds, "of_bound": ratio.value if ratio.valid else None,
                         "of_bound_check": ratio.as_json(),
                         "gbps": g_model["bytes"] / seconds / 1e9 if seconds else 0.0,
                         "checks": g["checks"], "trainer_extra_bytes": t.get("peak_extra_bytes", 0),
                         "engine_extra_bytes": g.get("peak_extra_bytes", 0),
                         "shared_bytes": t.get("shared_bytes", 0), "setup_s": t.get("setup_s", 0.0),
                         "staging_bytes": {"trainer": t.get("staging_bytes"), "engine": g.get("staging_bytes")},
                         "info": {k: g[k] for k in ("links", "copies", "copy_counts", "fills", "chunk_bytes")
                                  if k in g}})
            if "traces" in t and "traces" in g:
                rows[-1]["breakdown_ms"] = _breakdown(t["traces"], g["traces"])
    return rows


def _breakdown(train: list[dict[str, Any]], gen: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each phase of :func:`~refit_core.run.timing.breakdown` over the timed steps."""
    steps = [breakdown(StepTrace(t["marks"], t["gpu_ms"]), StepTrace(g["marks"], g["gpu_ms"]))
             for t, g in zip(train, gen)]
    return {key: _median([s[key] for s in steps]) for key in steps[0]} if steps else {}


BREAKDOWN_NOTE = """
Breakdown columns (ms, medians; `refit_core.run.timing.breakdown`): `total` the trainer's `send`;
`check` its moved-parameter check; `post` writing *ready*; `signal` *ready* written -> the engine read
and checked it; `enqueue` the engine's host time queueing its copies; `device_wait` device time from
queueing to the stream passing its events; `device_contiguous` / `device_strided` / `device_batched`
each launch group's device time, `device_copies` their sum; `observe` copies' end -> the engine saw it;
`ack` the engine saw it -> the trainer read *done*; `tail` copies' end -> the trainer read *done*;
`after` the trainer's work after that. `strided MB`: bytes the large strided copies move.
"""

PHASES = ("total", "check", "post", "signal", "enqueue", "device_wait", "device_contiguous", "device_strided",
          "device_batched", "device_copies", "observe", "ack", "tail", "after")
"""The breakdown table's columns (ms; ``device_*`` on CUDA only)."""


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    """The median phases of every traced refit row, one line each (ms)."""
    traced = [r for r in rows if r.get("breakdown_ms")]
    if not traced:
        return ""
    columns = [p for p in PHASES if any(p in r["breakdown_ms"] for r in traced)]
    lines = ["| model | method | " + " | ".join(columns) + " | launches | strided MB |",
             "|---|---|" + "---|" * len(columns) + "---|---|"]
    for r in traced:
        b = r["breakdown_ms"]
        counts = r["info"].get("copy_counts") or {}
        cells = " | ".join(f"{b[c]:.3f}" if c in b else "-" for c in columns)
        lines.append(f"| {r['model']} | {r['method']} | {cells} | {r['info'].get('copies', '-')} | "
                     f"{counts.get('strided_bytes', 0) / 1e6:.0f} |")
    return "\n".join(lines)


def _memory(peak: int, row: dict[str, Any]) -> str:
    """A process's extra memory: the measured peak (CUDA), else what refit says it staged (CPU)."""
    if peak or row["method"] != "refit" or row["staging_bytes"]["trainer"] is None:
        return f"{peak / GiB:.2f} GiB"
    staged = (row["staging_bytes"]["trainer"] or 0) + (row["staging_bytes"]["engine"] or 0)
    return f"{staged / GiB:.2f} GiB staged"


def table(rows: list[dict[str, Any]]) -> str:
    """Every row as markdown: time, the fraction of the copy bound, rate, each process's extra memory."""
    lines = ["| model | method | GB | ms/step | of copy bound | GB/s | trainer extra | engine extra | launches "
             "| check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        info = r["info"]
        launches = info.get("copies", info.get("fills", "-"))
        lines.append(f"| {r['model']} | {r['method']} | {r['bytes'] / 1e9:.2f} | {r['ms']:.2f} | "
                     f"{Ratio.from_json(r['of_bound_check']).text()} | {r['gbps']:.0f} | "
                     f"{_memory(r['trainer_extra_bytes'], r)} | "
                     f"{_memory(r['engine_extra_bytes'], r)} | {launches} | {', '.join(r['checks'])} |")
    return "\n".join(lines)



def write(prefix: str, report: dict[str, Any], text: str, bound_gib: float, with_breakdown: bool) -> None:
    """``PREFIX.json`` (``report``) and ``PREFIX.md`` (``text``, the tables, and what their columns mean;
    ``with_breakdown``: also the breakdown's)."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(report, f, indent=1)
    block = report["fp8_block"]
    with open(prefix + ".md", "w") as f:
        fp8 = f", engine in block FP8 ({block} x {block})" if block else ""
        f.write(f"# Colocated refit, {report['gpu']} ({report['machine'] or report['device']}), one device, two "
                f"processes{fp8}\n\n"
                f"{text}\n\n`trainer extra` / `engine extra`: each process's peak allocation above its model "
                "during the method's setup and steps (the benchmark's own weight fill excluded; the "
                "trainer's includes the buffers it shares with the engine); on CPU, the bytes refit "
                "reports staged. `of copy bound`: the median one-copy time of the same bytes (every byte, "
                f"in chunks of at most {bound_gib:g} GiB, warm, at least {MIN_BOUND_SAMPLES} copies "
                "interleaved with the methods' steps) divided by the method's step; INVALID when above "
                "1.02 or when the bound is implausibly slow for the GPU. `NAME[K/N layers]`: a slice "
                "of the shape (same per-layer shapes) that fits the GPU. `launches`: copy calls per step "
                "(refit) or buffer fills (ping-pong).\n" + (BREAKDOWN_NOTE if with_breakdown else ""))


__all__ = ["BREAKDOWN_NOTE", "PHASES", "breakdown_table", "summarize", "table", "write"]

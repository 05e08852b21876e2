"""The checkpoint-engine comparison's results: per model and method the median step against the bound."""

from __future__ import annotations

from typing import Any

from refit_core.tools.bench.peer_layout import CE, METHODS, REFIT, Layout, Role
from refit_core.tools.bench.validity import Ratio, bound_rate_problem, check_ratio


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def merge(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: the trainer's times (every rank agreed on each step's largest) and the engine's checks."""
    by_rank = {r["rank"]: r for r in results}
    merged = []
    for t, g in zip(by_rank[Role.TRAINER]["models"], by_rank[Role.ENGINE]["models"]):
        if "skipped" in t:
            merged.append(t)
            continue
        merged.append(dict(t, checks={**t["checks"], **g["checks"]}, times={**t["times"], **{
            k: v for k, v in g["times"].items() if k == "copy-bound"}}))
    return merged


def summarize(models: list[dict[str, Any]], bound: str) -> list[dict[str, Any]]:
    """One row per (model, method): median ms, the ratio of the bound, GB/s, checkpoint-engine's parts."""
    rows = []
    for m in models:
        if "skipped" in m:
            continue
        times, nbytes = m["times"], m["bytes"]
        bound_s = _median(times.get(bound, []))
        problem = bound_rate_problem(nbytes, bound_s, m["device_name"]) if bound == "copy-bound" else None
        if bound_s != bound_s:
            problem = f"{bound} not measured"
        refit_s = _median(times.get(REFIT, []))
        for method in [bound, *[k for k in METHODS if k in times]]:
            seconds = _median(times[method])
            row = {"model": m["model"], "method": method, "bytes": nbytes, "ms": 1000 * seconds,
                   "of_bound": check_ratio(bound_s / seconds if seconds else None, bound, problem).as_json(),
                   "gbps": nbytes / seconds / 1e9 if seconds else 0.0, "check": m["checks"].get(method, "-"),
                   "samples": len(times[method])}
            if method == CE:
                parts = [t - h for t, h in zip(times[CE], m["ce"]["h2d"])]
                gpu = _median(parts)
                row.update(h2d_ms=1000 * _median(m["ce"]["h2d"]), gpu_part_ms=1000 * gpu,
                           gpu_part_of_bound=check_ratio(bound_s / gpu if gpu > 0 else None, bound, problem).as_json(),
                           h2d_gbps=nbytes / _median(m["ce"]["h2d"]) / 1e9 if m["ce"]["h2d"] else 0.0,
                           register_s=_median(m["ce"]["register"]), settings=m.get("ce_settings"))
                if refit_s == refit_s and refit_s > 0:
                    row.update(refit_speedup=seconds / refit_s, refit_speedup_gpu_part=gpu / refit_s)
            rows.append(row)
    return rows


def _ms(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def table(rows: list[dict[str, Any]], bound: str) -> str:
    """The rows as markdown, against ``bound``."""
    lines = [f"| model | method | GB | ms/step | of {bound} | GB/s | h2d ms | gpu part ms | gpu part of {bound} "
             "| refit faster x (end to end / gpu part) | check |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ce = r["method"] == CE
        speed = (f"{r['refit_speedup']:.2f} / {r['refit_speedup_gpu_part']:.2f}"
                 if "refit_speedup" in r else "-")
        lines.append(
            f"| {r['model']} | {r['method']} | {r['bytes'] / 1e9:.2f} | {r['ms']:.2f} | "
            f"{Ratio.from_json(r['of_bound']).text()} | {r['gbps']:.0f} | "
            f"{_ms(r, 'h2d_ms')} | {_ms(r, 'gpu_part_ms')} | "
            f"{Ratio.from_json(r['gpu_part_of_bound']).text() if ce else '-'} | {speed} | {r['check']} |")
    return "\n".join(lines)


NOTE = """
`{bound}`: {bound_text}. `of {bound}`: the bound's median divided by the method's (check_ratio: INVALID
above 1.02{rate}). checkpoint-engine: `ms/step` is its `ParameterServer.update` end to end, from host
memory (its design); `h2d ms` its own host-to-device step (`_copy_to_buffer`, summed over buckets);
`gpu part` = end to end less h2d (a lower bound: its H2D of one bucket overlaps the engine's load of the
previous one). `refit faster x`: checkpoint-engine's time / refit's, end to end and from the GPU part.
Not timed: `register_checkpoint` (the trainer's copy into pinned host memory, `register s` in the JSON)
and `gather_metas`. Every step: all ranks at a barrier, each times to its end (device synchronized), the
largest counts; median of the timed steps, methods interleaved step by step after the warm-up.
"""


def note(layout: Layout, settings: dict[str, Any] | None) -> str:
    """What the table's columns mean on ``layout``, and checkpoint-engine's ``settings`` (None: not run)."""
    if layout.gpus == 1:
        text = NOTE.format(bound="copy-bound", rate=", or when the bound is implausibly slow for the GPU",
                           bound_text="one device copy of the same bytes in chunks, warm, interleaved")
    else:
        text = NOTE.format(bound="wire", rate="",
                           bound_text="one NCCL send of the same bytes, GPU 0 -> GPU 1, interleaved")
    if settings:
        text += "\ncheckpoint-engine settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "\n"
    return text


def all_checked(rows: list[dict[str, Any]]) -> bool:
    """True when every row's check passed (or it has none)."""
    return all(r["check"] in ("bitwise ok", "checksum ok", "-") for r in rows)


__all__ = ["NOTE", "all_checked", "merge", "note", "summarize", "table"]

"""A ``refit bench`` run's results: per method the slowest rank's median step, memory, checks and its
ratio to the wire (and, in a fleet, to the broadcast), summed up from every rank's entries, and the markdown
table of them."""

from __future__ import annotations

import statistics
from typing import Any

from refit_core.kit.models import checkpoint_specs, load_config
from refit_core.tools.bench.methods import is_baseline
from refit_core.tools.bench.broadcast import NAME as BROADCAST
from refit_core.tools.bench.validity import Ratio, Timed, same_bytes_ratio
from refit_core.units import MiB

GiB = 1 << 30


def _setup_reads(s: dict[str, Any]) -> str:
    """What setup read from the store: the planner (every rank's metadata) and any other rank (its part)."""
    if s.get("planner_read_bytes") is None:  # this run's ranks did not include the planner's record
        return f"metadata read per rank up to {s['metadata_bytes'] / 1024:.1f} KiB"
    return (f"the planner (train rank 0) planned in {s['planner_plan_s']:.2f} s and read "
            f"{s['planner_read_bytes'] / 1024:.1f} KiB, any other rank read up to "
            f"{s['other_read_bytes'] / 1024:.1f} KiB")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(model: str, job: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's run from every rank's result: its ranks and, per method (``rows``), the median of the
    slowest rank's timed steps, bytes, rate, each side's largest memory figures, the checks, the setup's
    phases and the ratio to the wire."""
    config = load_config(model)
    n_train = job["num_train"]
    gen = results[n_train:]
    received = sum(r["model_bytes"] for r in gen)
    rows = [_row(name, results, n_train, received) for name in job["methods"]]
    wire = next((r for r in rows if r["method"] == "wire"), None)
    broadcast = next((r for r in rows if r["method"] == BROADCAST), None)
    for row in rows:
        ratio = wire_ratio(row, wire) if row is not broadcast else Ratio(None)  # the wire bounds no collective
        row["ratio_to_wire"] = ratio.value if ratio.valid else None
        row["ratio_to_wire_check"] = ratio.as_json()
        if broadcast is not None and not is_baseline(row["method"]) and row is not broadcast:
            row["ratio_to_broadcast_check"] = broadcast_ratio(row, broadcast).as_json()
        links = row.get("links")
        if links:
            total = sum(links.values())
            remote = [k for k in links if k.split("->")[0] != k.split("->")[1]]
            row["busiest_link_share"] = max(links.values()) / total
            row["links_used"] = len(remote)
    return {
        "model": model, "model_bytes": received, "hf_tensors": len(checkpoint_specs(config, grouped=False)),
        "train": [f"{r['device']} tp{r['tp']}:{r['tp_rank']}" for r in results[:n_train]],
        "gen": [f"{r['device']} tp{r['tp']}:{r['tp_rank']}" for r in gen],
        "device_names": sorted({r["device_name"] for r in results}),
        "build_s": max(r["build_s"] for r in results), "rows": rows, "broadcast_note": job.get("broadcast_note"),
    }


def _row(name: str, results: list[dict[str, Any]], n_train: int, received: int) -> dict[str, Any]:
    """Method ``name``'s row, without its ratio to the wire."""
    entries = [r["methods"][name] for r in results]
    e0 = entries[0]
    timed = e0["times_s"][e0["warmup"]:]
    t = _median(timed)
    info = {k: v for e in entries for k, v in e["info"].items()}
    moved = e0["info"].get("wire_bytes", results[0]["model_bytes"]) if is_baseline(name) else received
    moved = info.get("bytes_moved", moved)
    row = {"method": name, "time_s": t, "times_s": timed, "bytes": moved, "gbps": moved / t / 1e9,
           "checks": sorted({e.get("check") for e in entries if e.get("check")}), "info": info}
    for side, sel in (("sender", results[:n_train]), ("receiver", results[n_train:])):
        for key in ("peak_extra_bytes", "after_extra_bytes", "outside_torch_bytes"):  # the side's largest
            values = [r["methods"][name].get(key) for r in sel]
            row[f"{side}_{key}"] = max(values) if None not in values else None
    if "links" in e0:
        row["links"] = e0["links"]
    setups = [e["setup"] for e in entries if e.get("setup")]
    if setups:
        row["setup"] = _setup(setups)
    return row


def _setup(setups: list[dict[str, Any]]) -> dict[str, Any]:
    """The slowest rank per setup phase; what the planner (train rank 0) and the others read."""
    out = {k: max((s[k] or 0.0) for s in setups) for k in setups[0] if k != "planner"}
    planner = [s for s in setups if s.get("planner")]
    out["planner_plan_s"] = planner[0]["plan_s"] if planner else None
    out["planner_read_bytes"] = planner[0]["metadata_bytes"] if planner else None
    out["other_read_bytes"] = max((s["metadata_bytes"] for s in setups if not s.get("planner")), default=0)
    return out


def _timed(row: dict[str, Any]) -> Timed:
    return Timed(row["method"], row["time_s"], row["bytes"])


def wire_ratio(row: dict[str, Any], wire: dict[str, Any] | None) -> Ratio:
    """``row``'s time against the wire's (1.0 = at the wire), a result only if both moved the same bytes
    (the wire over refit's pairs) and ``row`` does not beat the wire (:func:`same_bytes_ratio`)."""
    if wire is None:
        return Ratio(None)
    skipped = wire["info"].get("wire_skipped_pairs")
    problem = f"the wire could not time pairs on one device {skipped}" if skipped else None
    sent = sum(row.get("links", {}).values()) or row["bytes"]
    if sent < row["bytes"]:  # a relay: the rest goes from replica to replica, over pairs the wire has not
        problem = (f"the train ranks send {sent:,} of {row['bytes']:,} bytes, the rest goes between gen ranks: "
                   "the wire of the train ranks' pairs is no bound")
    return same_bytes_ratio(_timed(row), _timed(wire), "wire moving the same bytes over the same pairs", problem)


def broadcast_ratio(row: dict[str, Any], broadcast: dict[str, Any]) -> Ratio:
    """``row``'s time against the broadcast's (1.0 = at the broadcast): a fleet's refit lands one replica's
    bytes on every replica, as the broadcast does; a result only on the same bytes and if ``row`` does not
    beat the broadcast (:func:`same_bytes_ratio`)."""
    return same_bytes_ratio(_timed(row), _timed(broadcast), "broadcast of the same bytes to every replica")


def _broadcast_lines(summary: dict[str, Any]) -> list[str]:
    """The fleet's reference: what the broadcast moved and each refit method's time against it, or why the
    broadcast did not run."""
    if summary.get("broadcast_note"):
        return ["", f"broadcast (the reference of a fleet) not run: {summary['broadcast_note']}"]
    row = next((r for r in summary["rows"] if r["method"] == BROADCAST), None)
    if row is None:
        return []
    info = row["info"]
    lines = ["", f"broadcast (the reference of a fleet): {info['broadcast_bytes']:,} bytes from the train "
                 f"rank to each of {info['broadcast_replicas']} replicas in {info['broadcast_buckets']} bucket(s) of "
                 f"{info['broadcast_bucket_bytes'] / MiB:g} MiB, {row['time_s'] * 1e3:.1f} ms; x broadcast "
                 "(method time / broadcast time, and the fraction of the broadcast's rate):"]
    for r in summary["rows"]:
        if "ratio_to_broadcast_check" in r:
            lines.append(f"- {r['method']}: {Ratio.from_json(r['ratio_to_broadcast_check']).times_text()}")
    return lines


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def table(summary: dict[str, Any]) -> str:
    """One model's results as markdown: its head line, the methods' table, links, setup and infos."""
    head = (f"{summary['model']}: {summary['model_bytes'] / 1e9:.2f} GB, {summary['hf_tensors']} HF tensors; "
            f"train {', '.join(summary['train'])} -> gen {', '.join(summary['gen'])} "
            f"({', '.join(summary['device_names'])})")
    lines = [head, "",
             "| method | time (ms) | GB/s | x wire (same bytes, same pairs) | sender peak extra | "
             "receiver peak extra | extra after (send/recv) | outside torch (send/recv) | check |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in summary["rows"]:
        ratio = Ratio.from_json(r["ratio_to_wire_check"]).text()
        lines.append(f"| {r['method']} | {r['time_s'] * 1e3:.1f} | {r['gbps']:.1f} | {ratio} | "
                     f"{_gib(r['sender_peak_extra_bytes'])} | {_gib(r['receiver_peak_extra_bytes'])} | "
                     f"{_gib(r['sender_after_extra_bytes'])} / {_gib(r['receiver_after_extra_bytes'])} | "
                     f"{_gib(r.get('sender_outside_torch_bytes'))} / {_gib(r.get('receiver_outside_torch_bytes'))} | "
                     f"{'; '.join(r['checks']) or '-'} |")
    for r in summary["rows"]:
        if "busiest_link_share" in r:
            lines.append("")
            lines.append(f"{r['method']}: links {r['links']}; busiest link carries {r['busiest_link_share']:.0%}; "
                         f"{r['links_used']} GPU-to-GPU link(s) used")
    for r in summary["rows"]:
        if "setup" in r:
            s = r["setup"]
            lines.append("")
            lines.append(f"{r['method']} setup (slowest rank per phase): {s['total_s']:.2f} s = pieces "
                         f"{s['pieces_s']:.2f} + metadata {s['metadata_s']:.2f} + plan {s['plan_s']:.2f} + agree "
                         f"{s['agree_s']:.2f} + transport {s['transport_s']:.2f} + bind {s['bind_s']:.2f} s; "
                         + _setup_reads(s))
    lines += _broadcast_lines(summary)
    infos = [f"{r['method']}: {r['info']}" for r in summary["rows"] if r["info"]]
    if infos:
        lines += ["", *infos]
    return "\n".join(lines)


__all__ = ["broadcast_ratio", "summarize", "table", "wire_ratio"]

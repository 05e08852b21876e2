"""``refit bench --fp8-block BN,BK``: a BF16 trainer into a block-FP8 engine, side by side with BF16.

Every model runs twice in one ``refit bench`` call: into the BF16 vLLM-style layout (``wire``,
``refit``), then into its block-FP8 twin (``wire`` over the bytes FP8 refit moves, ``refit``
quantizing on the sender, and ``refit-quantize-after``: BF16 refit into a BF16 copy, then
quantization on the engine). Both runs check every byte (FP8 values and scales against refit's
eager quantizer on the receiving GPU). The comparison reports bytes moved (FP8 / BF16), FP8 refit
against the wire moving the same bytes, and the times of the three ways to get FP8 weights there.

Every ratio to a wire is a time ratio against the wire moving the same payload: FP8 refit against the
FP8 run's wire (the FP8 bytes), BF16 refit + quantize-after (which moves BF16) against the BF16 run's
wire (the BF16 bytes); each goes through :func:`~refit_core.tools.bench.validity.check_ratio`, so one
that beats its wire prints as ``INVALID``. A ratio is stored as ``KEY`` (None when invalid) and
``KEY_check`` (value, valid, reason).
"""

from __future__ import annotations

from typing import Any

from refit_core.tools.bench.validity import Ratio, check_ratio

BASELINES_WITHOUT_FP8 = ("per-tensor", "packed")
"""Baselines that move HF tensors in one dtype: they have no FP8 variant."""
QUANTIZE_AFTER = "refit-quantize-after"


def fp8_methods(methods: list[str]) -> list[str]:
    """The methods of the FP8 run: the BF16 run's, less baselines without FP8, plus quantize-after."""
    kept = [m for m in methods if m.split("@")[0] not in BASELINES_WITHOUT_FP8]
    return kept + ([QUANTIZE_AFTER] if QUANTIZE_AFTER not in kept else [])


def _row(summary: dict[str, Any], method: str) -> dict[str, Any] | None:
    return next((r for r in summary["rows"] if r["method"] == method), None)


def fp8_comparison(bf16: dict[str, Any], fp8: dict[str, Any]) -> dict[str, Any]:
    """The FP8-vs-BF16 numbers of one model (``bf16`` and ``fp8`` are ``refit bench`` summaries)."""
    out: dict[str, Any] = {"model": bf16["model"], "fp8_block": fp8["fp8_block"],
                           "bf16_bytes": bf16["model_bytes"], "fp8_bytes": fp8["model_bytes"],
                           "bytes_ratio": fp8["model_bytes"] / bf16["model_bytes"]}
    rows = {("bf16", m): _row(bf16, m) for m in ("wire", "refit")}
    rows.update({("fp8", m): _row(fp8, m) for m in ("wire", "refit", QUANTIZE_AFTER)})
    for (kind, method), row in rows.items():
        if row is not None:
            out[f"{kind}_{method}_ms"] = row["time_s"] * 1e3
            out[f"{kind}_{method}_checks"] = row["checks"]
    fp8_refit, fp8_wire = rows[("fp8", "refit")], rows[("fp8", "wire")]
    bf16_refit, quantize_after = rows[("bf16", "refit")], rows[("fp8", QUANTIZE_AFTER)]
    _wire_ratio(out, "fp8_refit_ratio_to_wire", fp8_refit, fp8_wire)
    _wire_ratio(out, "quantize_after_ratio_to_bf16_wire", quantize_after, rows[("bf16", "wire")])
    if fp8_refit and bf16_refit:
        out["fp8_speedup_vs_bf16_refit"] = bf16_refit["time_s"] / fp8_refit["time_s"]
    if fp8_refit and quantize_after:
        out["fp8_speedup_vs_quantize_after"] = quantize_after["time_s"] / fp8_refit["time_s"]
    return out


def _wire_ratio(out: dict[str, Any], key: str, row: dict[str, Any] | None, wire: dict[str, Any] | None) -> None:
    """``out[key]``: ``wire``'s time over ``row``'s, checked; invalid unless both moved the same bytes."""
    if row is None or wire is None:
        return
    problem = None if row["bytes"] == wire["bytes"] else (
        f"{row['method']} moved {row['bytes']:,} bytes, the wire {wire['bytes']:,}: not the same bytes")
    ratio = check_ratio(wire["time_s"] / row["time_s"], "wire moving the same payload", problem)
    out[key] = ratio.value if ratio.valid else None
    out[key + "_check"] = ratio.as_json()


def _ratio_text(c: dict[str, Any], key: str) -> str:
    return Ratio.from_json(c.get(key + "_check")).text()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def fp8_table(comparisons: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`fp8_comparison` results."""
    lines = ["| model | BF16 / FP8 bytes | FP8 / BF16 | wire FP8 (ms) | **refit FP8** (ms) | **x FP8 wire** | "
             "refit BF16 (ms) | BF16 refit + quantize after (ms) | quantize-after x BF16 wire | "
             "FP8 speedup vs BF16 / vs quantize-after | checks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in comparisons:
        checks = sorted({check for key, value in c.items() if key.endswith("_checks") for check in value})
        lines.append(
            f"| {c['model']} (blocks {c['fp8_block']}) | {c['bf16_bytes'] / 1e9:.2f} / {c['fp8_bytes'] / 1e9:.2f} GB | "
            f"{c['bytes_ratio']:.3f} | {_ms(c.get('fp8_wire_ms'))} | {_ms(c.get('fp8_refit_ms'))} | "
            f"{_ratio_text(c, 'fp8_refit_ratio_to_wire')} | {_ms(c.get('bf16_refit_ms'))} | "
            f"{_ms(c.get(f'fp8_{QUANTIZE_AFTER}_ms'))} | {_ratio_text(c, 'quantize_after_ratio_to_bf16_wire')} | "
            f"{_x(c.get('fp8_speedup_vs_bf16_refit'))} / "
            f"{_x(c.get('fp8_speedup_vs_quantize_after'))} | {'; '.join(checks) or '-'} |")
    lines += ["", "`x FP8 wire`: the FP8 run's wire time (the FP8 bytes, same pairs) over FP8 refit's; "
              "`quantize-after x BF16 wire`: the BF16 run's wire time (the BF16 bytes it moves) over "
              "BF16 refit + quantize-after's. Time ratios on the same payload; above 1.02 is INVALID."]
    return "\n".join(lines)

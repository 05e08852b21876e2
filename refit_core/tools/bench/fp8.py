"""``refit bench --fp8-block BN,BK``: a BF16 trainer into a block-FP8 engine, side by side with BF16.

Every model runs twice in one ``refit bench`` call: into the BF16 vLLM-style layout (``wire``,
``refit``), then into its block-FP8 twin (``wire`` over the bytes FP8 refit moves, ``refit``
quantizing on the sender, and ``refit-quantize-after``: BF16 refit into a BF16 copy, then
quantization on the engine). Both runs check every byte (FP8 values and scales against refit's
eager quantizer on the receiving GPU). The comparison reports bytes moved (FP8 / BF16), FP8 refit
against the wire moving the same bytes, and the times of the three ways to get FP8 weights there.
"""

from __future__ import annotations

from typing import Any

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
    if fp8_refit and fp8_wire:
        out["fp8_refit_ratio_to_wire"] = fp8_wire["time_s"] / fp8_refit["time_s"]
    bf16_refit, quantize_after = rows[("bf16", "refit")], rows[("fp8", QUANTIZE_AFTER)]
    if fp8_refit and bf16_refit:
        out["fp8_speedup_vs_bf16_refit"] = bf16_refit["time_s"] / fp8_refit["time_s"]
    if fp8_refit and quantize_after:
        out["fp8_speedup_vs_quantize_after"] = quantize_after["time_s"] / fp8_refit["time_s"]
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def fp8_table(comparisons: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`fp8_comparison` results."""
    lines = ["| model | BF16 / FP8 bytes | FP8 / BF16 | wire FP8 (ms) | **refit FP8** (ms) | **x wire** | "
             "refit BF16 (ms) | BF16 refit + quantize after (ms) | FP8 speedup vs BF16 / vs quantize-after | checks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in comparisons:
        checks = sorted({check for key, value in c.items() if key.endswith("_checks") for check in value})
        lines.append(
            f"| {c['model']} (blocks {c['fp8_block']}) | {c['bf16_bytes'] / 1e9:.2f} / {c['fp8_bytes'] / 1e9:.2f} GB | "
            f"{c['bytes_ratio']:.3f} | {_ms(c.get('fp8_wire_ms'))} | {_ms(c.get('fp8_refit_ms'))} | "
            f"{_x(c.get('fp8_refit_ratio_to_wire'))} | {_ms(c.get('bf16_refit_ms'))} | "
            f"{_ms(c.get(f'fp8_{QUANTIZE_AFTER}_ms'))} | {_x(c.get('fp8_speedup_vs_bf16_refit'))} / "
            f"{_x(c.get('fp8_speedup_vs_quantize_after'))} | {'; '.join(checks) or '-'} |")
    return "\n".join(lines)

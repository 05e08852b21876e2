"""How fast refit's FP8 quantizers turn a model's BF16 linear weights into block-FP8, side by side.

For the Llama-3-8B and Qwen3-30B-A3B shapes (the linear weights an FP8 engine holds quantized) on
one GPU: the copy bound (a plain copy that writes the same bytes as the quantizers, FP8 values and
scales, into the same places, reading as many from the BF16 sources), the eager and the compiled
per-tensor quantizer, and the batched Triton kernel refit's pack step runs (one launch for every
tensor). Each time is the median of ``--iters`` synchronized runs after two warm-up runs. GB/s
counts BF16 bytes read; ``x copy bound`` goes through
:func:`~refit_core.tools.bench.validity.check_ratio` (INVALID above 1.02, or for a bound implausibly
slow for the GPU). Every quantizer's output is checked bit for bit against the batched kernel's, and
the batched kernel against the reference quantizer on a sample. A shape that does not fit the GPU
runs as a slice of its layers (``NAME[K/N layers]``) or is skipped with a one-line reason.

    python benchmarks/quantizer_speed.py [--models llama-3-8b-shape,qwen3-30b-a3b-shape] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from refit_core.kit.models import checkpoint_specs, load_config
from refit_core.run.copies import CopyProgram
from refit_core.run.quant.batched import quantize_batch
from refit_core.run.quant.boxes import BoxToQuantize
from refit_core.run.quant.fast import Quantizer
from refit_core.run.quant.reference import reference_quantize
from refit_core.tools.bench.copybound import median_seconds
from refit_core.tools.bench.fit import Fit, fit_layers
from refit_core.tools.bench.layouts import fp8_specs
from refit_core.tools.bench.validity import Ratio, bound_rate_problem, check_ratio

GiB = 1 << 30
WARMUP = 2
MEMORY_RESERVE = 2 * GiB
COPY = "copy bound (same bytes written)"


def needed_bytes(model_bytes: int) -> int:
    """GPU memory the measurement of a ``model_bytes`` checkpoint needs at most: the BF16 sources and
    the FP8 output (values and scales, about half), with room for the per-tensor quantizers' temporaries."""
    return int(1.7 * model_bytes) + 2 * GiB


def fit(model: str, memory_gib: float | None) -> Fit:
    """How ``model`` runs on this GPU (``memory_gib`` overrides its memory less the reserve)."""
    budget = int(memory_gib * GiB) if memory_gib is not None else \
        torch.cuda.get_device_properties(0).total_memory - MEMORY_RESERVE
    return fit_layers(model, load_config(model), budget, needed_bytes)


def _timed(fn: Callable[[], None], iters: int) -> float:
    """The median of ``iters`` synchronized runs of ``fn`` on GPU 0 after ``WARMUP`` untimed ones."""
    return median_seconds(fn, iters, torch.device("cuda", 0), warmup=WARMUP)


def measure(model: str, iters: int, how: Fit) -> dict[str, Any]:
    config = how.config(load_config(model))
    hp = {s.name: s for s in checkpoint_specs(config)}
    quantized = [s for s in fp8_specs(hp, (128, 128)).values() if s.quant is not None]
    sources = [torch.randn(s.shape, dtype=torch.bfloat16, device="cuda") for s in quantized]
    nbytes = sum(t.numel() * 2 for t in sources)
    boxes, offset = [], 0
    for source, spec in zip(sources, quantized):
        scales = -(-(offset + source.numel()) // 16) * 16
        boxes.append(BoxToQuantize(source, spec.quant, offset, scales))
        offset = -(-(scales + 4 * math.prod(spec.quant.scale_shape(tuple(source.shape)))) // 16) * 16
    buffer = torch.empty(offset, dtype=torch.uint8, device="cuda")
    batch = quantize_batch(boxes, Quantizer())
    assert batch is not None
    batch.warm_up(set())
    # the copy bound writes what the quantizers write (values and scales, in place), reading as many bytes
    copy_dst, copy_src = [], []
    for box in boxes:
        raw = box.source.view(-1).view(torch.uint8)
        numel = box.source.numel()
        scale_bytes = 4 * math.prod(box.quant.scale_shape(tuple(box.source.shape)))
        copy_dst += [buffer[box.values_offset:box.values_offset + numel],
                     buffer[box.scales_offset:box.scales_offset + scale_bytes]]
        copy_src += [raw[:numel], raw[numel:numel + scale_bytes]]
    written = sum(t.numel() for t in copy_dst)

    # as refit's colocated copies move them (neighbours merged, wide words, few launches): a byte-wise
    # multi-tensor copy runs at half the device's copy rate and would flatter every quantizer
    program = CopyProgram(list(zip(copy_dst, copy_src)))

    def copy() -> None:
        program.run()

    def per_tensor(quantizer: Quantizer) -> Callable[[], None]:
        def run() -> None:
            for box in boxes:
                shape = tuple(box.source.shape)
                values = buffer[box.values_offset:box.values_offset + box.source.numel()].view(box.quant.dtype)
                scale_shape = box.quant.scale_shape(shape)
                scales = buffer[box.scales_offset:box.scales_offset + 4 * math.prod(scale_shape)].view(torch.float32)
                quantizer.quantize_into(box.source, values.view(shape), scales.view(scale_shape), box.quant)
        return run

    times = {COPY: _timed(copy, iters), "batched Triton (refit's pack step)": _timed(lambda: batch.run(buffer), iters)}
    expected = buffer.cpu()  # on the host: a large model leaves no room for a second buffer
    for name, quantizer in (("compiled per tensor", Quantizer(compiled=True)), ("eager per tensor",
                                                                                 Quantizer(compiled=False))):
        buffer.zero_()
        times[name] = _timed(per_tensor(quantizer), max(3, iters // 4))
        assert torch.equal(buffer.cpu(), expected), f"{name} differs from the batched kernel"
    sample = boxes[0]
    values, scales = reference_quantize(sample.source, sample.quant)
    got = expected[sample.values_offset:sample.values_offset + sample.source.numel()]
    assert torch.equal(got, values.view(torch.uint8).view(-1).cpu()), "batched kernel differs from the reference"
    bound = times[COPY]
    problem = bound_rate_problem(written, bound, torch.cuda.get_device_name())
    return {"model": how.label, "tensors": len(sources), "bf16_bytes": nbytes, "written_bytes": written,
            "rows": [{"method": k, "ms": v * 1e3, "GB/s": nbytes / v / 1e9,
                      "x copy": check_ratio(bound / v, "copy bound", problem).as_json()} for k, v in times.items()]}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-3-8b-shape,qwen3-30b-a3b-shape")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per method (the median; at least 10)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="memory a shape may use (default: the GPU's less 2 GiB); else sliced or skipped")
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args()
    results = []
    lines = [f"# FP8 quantizer speed on {torch.cuda.get_device_name()}", "",
             "BF16 linear weights -> block-FP8 128 x 128 (values + fp32 scales), one GPU; bitwise equal outputs.", ""]
    for model in args.models.split(","):
        how = fit(model, args.memory_gib)
        if how.skipped:
            lines += [f"{how.reason}", ""]
            print(how.reason, flush=True)
            continue
        try:
            result = measure(model, max(10, args.iters), how)
        except torch.cuda.OutOfMemoryError as exc:  # the estimate was short: say so, go on with the next shape
            reason = f"skipped {how.label}: out of GPU memory ({str(exc).splitlines()[0]})"
            lines += [reason, ""]
            print(reason, flush=True)
            torch.cuda.empty_cache()
            continue
        results.append(result)
        lines += [f"## {result['model']}: {result['tensors']} tensors, {result['bf16_bytes'] / 1e9:.2f} GB BF16, "
                  f"{result['written_bytes'] / 1e9:.2f} GB written", "",
                  "| quantizer | ms | GB/s (BF16 read) | x copy bound |", "|---|---:|---:|---:|"]
        lines += [f"| {r['method']} | {r['ms']:.2f} | {r['GB/s']:.0f} | {Ratio.from_json(r['x copy']).text()} |"
                  for r in result["rows"]]
        lines.append("")
        print("\n".join(lines[-len(result["rows"]) - 5:]), flush=True)
    lines.append("`x copy bound`: the copy bound's time (a copy writing the quantizers' bytes, values and scales, "
                 "into the same places) over the quantizer's; INVALID above 1.02 or for a bound implausibly slow "
                 "for the GPU.")
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()

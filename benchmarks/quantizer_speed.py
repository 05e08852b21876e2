"""How fast refit's FP8 quantizers turn a model's BF16 linear weights into block-FP8, side by side.

For the Llama-3-8B and Qwen3-30B-A3B shapes (the linear weights an FP8 engine holds quantized) on
one GPU: a plain copy of the same BF16 tensors (the memory bound), the eager and the
compiled per-tensor quantizer, and the batched Triton kernel refit's pack step runs (one launch for
every tensor). GB/s counts BF16 bytes read; every quantizer's output is checked bit for bit against
the batched kernel's, and the batched kernel against the reference quantizer on a sample.

    python benchmarks/quantizer_speed.py [--models llama-3-8b-shape,qwen3-30b-a3b-shape] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch

from refit_core.kit.models import checkpoint_specs, load_config
from refit_core.run.quant.batched import quantize_batch
from refit_core.run.quant.boxes import BoxToQuantize
from refit_core.run.quant.fast import Quantizer
from refit_core.run.quant.reference import reference_quantize
from refit_core.tools.bench.layouts import fp8_specs


def _timed(fn: Callable[[], None], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def measure(model: str, iters: int) -> dict[str, object]:
    config = load_config(model)
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
    copy_target = torch.empty(max(t.numel() for t in sources), dtype=torch.bfloat16, device="cuda")
    flat_targets = [copy_target[:t.numel()] for t in sources]  # one reused target: the model may fill the GPU

    def copy() -> None:
        torch._foreach_copy_(flat_targets, [t.view(-1) for t in sources])

    def per_tensor(quantizer: Quantizer) -> Callable[[], None]:
        def run() -> None:
            for box in boxes:
                shape = tuple(box.source.shape)
                values = buffer[box.values_offset:box.values_offset + box.source.numel()].view(box.quant.dtype)
                scale_shape = box.quant.scale_shape(shape)
                scales = buffer[box.scales_offset:box.scales_offset + 4 * math.prod(scale_shape)].view(torch.float32)
                quantizer.quantize_into(box.source, values.view(shape), scales.view(scale_shape), box.quant)
        return run

    times = {"copy (memory bound)": _timed(copy, iters), "batched Triton (refit's pack step)": _timed(
        lambda: batch.run(buffer), iters)}
    expected = buffer.cpu()  # on the host: a large model leaves no room for a second buffer
    for name, quantizer in (("compiled per tensor", Quantizer(compiled=True)), ("eager per tensor",
                                                                                 Quantizer(compiled=False))):
        buffer.zero_()
        times[name] = _timed(per_tensor(quantizer), max(1, iters // 4))
        assert torch.equal(buffer.cpu(), expected), f"{name} differs from the batched kernel"
    sample = boxes[0]
    values, scales = reference_quantize(sample.source, sample.quant)
    got = expected[sample.values_offset:sample.values_offset + sample.source.numel()]
    assert torch.equal(got, values.view(torch.uint8).view(-1).cpu()), "batched kernel differs from the reference"
    bound = times["copy (memory bound)"]
    return {"model": model, "tensors": len(sources), "bf16_bytes": nbytes,
            "rows": [{"method": k, "ms": v * 1e3, "GB/s": nbytes / v / 1e9, "x copy": bound / v}
                     for k, v in times.items()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-3-8b-shape,qwen3-30b-a3b-shape")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args()
    results = []
    lines = [f"# FP8 quantizer speed on {torch.cuda.get_device_name()}", "",
             "BF16 linear weights -> block-FP8 128 x 128 (values + fp32 scales), one GPU; bitwise equal outputs.", ""]
    for model in args.models.split(","):
        result = measure(model, args.iters)
        results.append(result)
        lines += [f"## {model}: {result['tensors']} tensors, {result['bf16_bytes'] / 1e9:.2f} GB BF16", "",
                  "| quantizer | ms | GB/s (BF16 read) | x copy bound |", "|---|---:|---:|---:|"]
        lines += [f"| {r['method']} | {r['ms']:.2f} | {r['GB/s']:.0f} | {r['x copy']:.3f} |" for r in result["rows"]]
        lines.append("")
        print("\n".join(lines[-len(result["rows"]) - 5:]), flush=True)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()

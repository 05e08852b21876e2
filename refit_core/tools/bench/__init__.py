"""``refit bench``: the wire, two baselines and refit, side by side on the same model and bytes.

``refit_core.tools.bench.main(argv)`` is the CLI entry (``refit bench --help``); the synthetic
Megatron-style and vLLM-style layouts live in :mod:`refit_core.tools.bench.layouts`, the timed methods in
:mod:`refit_core.tools.bench.methods`. ``benchmarks/run_gpu.sh`` runs the whole benchmark on a 2-GPU machine.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from refit_core.tools.bench.runner import main as run

    return run(argv)


__all__ = ["main"]

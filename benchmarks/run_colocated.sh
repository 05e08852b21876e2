#!/usr/bin/env bash
# Colocated refit on ONE GPU (made for nvidia-h200; also called from run_gpu.sh): the trainer
# (Megatron-style layout) and the engine (vLLM-style layout) are two processes on GPU 0; in one run,
# per shape: the copy bound (one on-GPU copy of the same bytes), the ping-pong baseline (HF tensors
# through 2 x 1 GiB IPC buffers) and refit (CUDA IPC, straight out of the trainer's memory).
# Results: $OUT/colocated-<machine>-<date>.{json,md}, <machine> from the GPUs (nvidia-h200 on one
# H200; set MACHINE to override). Takes ~1-2 minutes; only GPU 0 is used.
#
#   OUT=/somewhere bash benchmarks/run_colocated.sh
#   STEPS=colocated OUT=/somewhere bash benchmarks/run_gpu.sh     # the same, through the GPU script
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PY:-python3}
source benchmarks/machine.sh
MACHINE=${MACHINE:-$(machine_name)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests/example_plugin:$PYTHONPATH PYTHONUNBUFFERED=1
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} $PY -m refit_core.bench.colocated \
  --models ${COLOCATED_MODELS:-llama-3-8b-shape,qwen3-30b-a3b-shape} --device cuda --iters ${ITERS:-5} --warmup 1 \
  --timeout-s 150 --machine "$MACHINE" --out "$OUT/colocated-$MACHINE-$(date -u +%F)"

#!/usr/bin/env bash
# Colocated refit on ONE GPU (made for nvidia-h200; also called from run_gpu.sh): the trainer
# (Megatron-style layout) and the engine (vLLM-style layout) are two processes on GPU 0; in one run,
# per shape: the copy bound (one on-GPU copy of every byte, in chunks, warm, the median of >= 10 copies
# interleaved with the other methods' steps), the ping-pong baseline (HF tensors
# through 2 x 1 GiB IPC buffers) and refit (CUDA IPC, straight out of the trainer's memory).
# Then the Qwen3-30B-A3B shape again with one trainer parameter per expert (SKIP_SEQUENTIAL=1 skips it),
# and both shapes into a block-FP8 engine (SKIP_FP8=1 skips it).
# Results: $OUT/colocated-<machine>-<date>.{json,md}, colocated-<machine>-sequential-<date>.{json,md} and
# colocated-<machine>-fp8-<date>.{json,md},
# <machine> from the GPUs (nvidia-h200 on one H200; set MACHINE to override). Takes ~2-4 minutes; only
# GPU 0 is used. A shape that does not fit the GPU (Qwen3-30B-A3B on an 80 GB H100) runs as a slice of its
# layers, same per-layer shapes, named NAME[K/N layers] in the table (or is skipped with a one-line reason).
# COLOCATED_METHODS=copy-bound,refit,refit:+confirm picks the methods (default: copy bound, ping-pong, refit);
# COLOCATED_ARGS adds arguments (--breakdown).
# VARIANTS=1: instead, one run that decides how the engine moves its strided copies: the Llama-3-8B
# shape (VARIANT_MODELS to change) with the copy bound and refit once per StridedCopy variant (kernel,
# blocks, foreach, memcpy2d), each bitwise checked, with --breakdown (where each step's time goes):
# $OUT/colocated-<machine>-variants-<date>.{json,md}. ~1-2 minutes.
#
#   OUT=/somewhere bash benchmarks/run_colocated.sh
#   STEPS=colocated OUT=/somewhere bash benchmarks/run_gpu.sh     # the same, through the GPU script
#   VARIANTS=1 STEPS=colocated OUT=/somewhere bash benchmarks/run_gpu.sh   # the strided-copy variants only
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PY:-python3}
source benchmarks/machine.sh
MACHINE=${MACHINE:-$(machine_name)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests/example_plugin:$PYTHONPATH PYTHONUNBUFFERED=1
run() {  # run SUFFIX MODELS [ARGS...]: one benchmark run, its results in $OUT/colocated-$MACHINE[-SUFFIX]-<date>
  local suffix=$1 models=$2; shift 2
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} $PY -m refit_core.tools.bench.colocated \
    --models "$models" --device cuda --iters ${ITERS:-5} --warmup ${WARMUP:-3} ${COLOCATED_METHODS:+--methods $COLOCATED_METHODS} ${COLOCATED_ARGS:-} \
    --timeout-s 150 --machine "$MACHINE" --out "$OUT/colocated-$MACHINE$suffix-$(date -u +%F)" "$@"
}
if [[ -n "${VARIANTS:-}" ]]; then
  run "-variants" "${VARIANT_MODELS:-llama-3-8b-shape}" --variants
  exit $?
fi
run "" "${COLOCATED_MODELS:-llama-3-8b-shape,qwen3-30b-a3b-shape}"; rc=$?
# the trainer with one parameter per expert (Megatron's SequentialMLP: 12,288 source tensors of 3-6 MB
# into the engine's stacked w13 / w2), in a run of its own so the main table never waits on it
if [[ -z "${COLOCATED_MODELS:-}" && -z "${SKIP_SEQUENTIAL:-}" ]]; then
  run "-sequential" "qwen3-30b-a3b-shape:sequential" || rc=$?
fi
# the engine in block FP8 (128 x 128, as vLLM's FP8 checkpoints): refit quantizes straight out of the
# trainer's memory in batched launches (SKIP_FP8=1 skips it)
if [[ -z "${COLOCATED_MODELS:-}" && -z "${SKIP_FP8:-}" ]]; then
  run "-fp8" "llama-3-8b-shape,qwen3-30b-a3b-shape" --fp8-block 128 || rc=$?
fi
exit $rc

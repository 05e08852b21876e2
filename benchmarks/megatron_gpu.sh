#!/usr/bin/env bash
# The megatron part of the GPU check (called by run_gpu.sh, step "megatron"; runs alone too):
# a Llama-3-8B-shaped megatron-core GPTModel (local spec, bf16, random weights, GPU 0) refit through
# refit-plugin-megatron into the vLLM-style layout on GPU 1, side by side with the wire.
# megatron-core travels as a wheel (benchmarks/fetch_gpu_wheels.sh puts it in .whl/).
#   OUT=/somewhere bash benchmarks/megatron_gpu.sh
#   MEGATRON_NCCL=auto,2/0 bash benchmarks/megatron_gpu.sh  # one refit run per NCCL setting, side by side
#                                                         # (auto: the plan's; K: comms_per_link; K/C: and max_ctas)
#   MEGATRON_SOURCE=synthetic bash benchmarks/megatron_gpu.sh  # refit bench's Megatron-style model, same process
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PY:-python3}
DATE=$(date -u +%F)
mkdir -p "$OUT"
if ! $PY -c "import megatron.core" 2>/dev/null; then
  ls .whl/megatron_core-*.whl >/dev/null 2>&1 || { echo "megatron: no .whl/megatron_core-*.whl (run benchmarks/fetch_gpu_wheels.sh)"; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-megatron \
    .whl/megatron_core-*.whl || exit 2
  export PYTHONPATH=/tmp/site-megatron:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PWD/plugins/megatron:$PYTHONPATH
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e plugins/megatron 2>&1 | tail -2
$PY benchmarks/megatron_bench.py --device cuda --model llama-3-8b-shape --steps ${MEGATRON_STEPS:-6} \
  --timeout-s ${MEGATRON_TIMEOUT:-240} --nccl ${MEGATRON_NCCL:-auto} --source ${MEGATRON_SOURCE:-megatron} \
  --out "$OUT/${MACHINE:-gpu}-megatron${MEGATRON_SOURCE:+-$MEGATRON_SOURCE}-$DATE"

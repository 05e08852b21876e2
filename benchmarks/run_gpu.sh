#!/usr/bin/env bash
# The whole GPU check in one go, for a 2-GPU machine (made for nvidia-h200-x2; the colocated step alone,
# STEPS=colocated, needs one GPU and is made for nvidia-h200):
#   1. environment (GPUs, link topology, torch / NCCL / nccl4py versions),
#   2. `refit bench` on the Llama-3-8B and Qwen3-30B-A3B shapes: wire, per-tensor, packed, refit,
#   3. the GPU tests (tests/gpu),
#   4. multi-rank reshards of the Llama shape with several ranks per GPU (pairwise communicators):
#      TP2 (2 ranks on GPU 0) -> TP2 (2 ranks on GPU 1), and TP2 -> TP1 x DP2, under an MPS daemon (MPS=0: without),
#   5. `refit demo --train dtensor --gen dtensor --device cuda` (FSDP2/DTensor over NCCL, verified).
#   6. colocated: the trainer and the engine as two processes on GPU 0 (CUDA IPC), Llama-3-8B and
#      Qwen3-30B-A3B shapes (and Qwen3 with one trainer parameter per expert): copy bound, ping-pong
#      baseline, refit (benchmarks/run_colocated.sh; one GPU is enough). VARIANTS=1: instead, the Llama
#      shape once per StridedCopy variant and with overlap_check, with a per-phase breakdown (~2 min).
#   7. megatron: a Llama-3-8B-shaped megatron-core model through refit-plugin-megatron vs the wire
#      (benchmarks/megatron_gpu.sh; needs .whl/megatron_core-*.whl from benchmarks/fetch_gpu_wheels.sh).
#   8. timeline (not in the default STEPS): `refit bench --timeline` on the Llama-3-8B shape, GPU 0 -> GPU 1:
#      the pack / transfer / unpack lanes of one step as a PNG (CUDA events), with the setup breakdown.
#   9. relay (not in the default STEPS; needs 4 GPUs, nvidia-h200-x4): 1 train rank on GPU 0 -> 3 engine
#      replicas on GPUs 1-3, both shapes: NCCL broadcast of the same bytes (the reference), direct fanout,
#      the pipelined relay (a chain: the trainer feeds replica 0, each replica the next), and the relay by
#      broadcast (NCCL's own, in place and staged).
#      relay-fp8: the same into block-FP8 destinations (Llama shape).
#      reshard-x4 (not in the default STEPS; 4 GPUs): TP2 on GPUs 0,1 -> TP1 x DP2 on GPUs 2,3, both shapes.
#   Every ratio is on the same bytes: a multi-rank wire moves refit's bytes over refit's pairs, all at once;
#   a ratio above its bound, or over an implausible copy bound, prints INVALID (refit_core/tools/bench/validity.py).
#  10. FP8 destinations (`fp8`): the quantizers alone (benchmarks/quantizer_speed.py), then BF16
#      Megatron-style source -> block-FP8 vLLM-style destination, side by side with BF16 refit and BF16
#      refit + quantize-after (refit_core/tools/bench/fp8.py). FP8_TIMELINE=1 also draws each step's lanes.
#  11. peer (not in the default STEPS; one GPU): checkpoint-engine 0.4.x, the real peer, through its own API
#      (ParameterServer.register_checkpoint / gather_metas / update, update_weights_from_ipc in the engine
#      process) beside refit colocated and the copy bound, both shapes, bitwise (benchmarks/peer_checkpoint_engine.py).
#      peer2 (not in the default STEPS; two GPUs): the same over its NCCL broadcast, GPU 0 -> GPU 1, beside
#      refit and the wire. Both install checkpoint-engine and its dependencies from the carried .whl-peer/.
#  12. lora (not in the default STEPS; two GPUs): `refit bench --lora r=64` on the Llama-3-8B shape, GPU 0 ->
#      GPU 1: full refit vs adapter mode vs merged mode, bytes and time, and the merge's own time.
# Results and logs go to $OUT (default benchmarks/results). nccl4py is installed from .whl/ if present.
#
#   OUT=/somewhere bash benchmarks/run_gpu.sh            # everything
#   STEPS="bench" bash benchmarks/run_gpu.sh             # some steps: env bench tests reshard reshard-dp demo
#                                                        # colocated megatron fp8
#   STEPS="env timeline" bash benchmarks/run_gpu.sh       # steps outside the default list: timeline, relay and
#                                                        # reshard-x4 (4 GPUs)
#   STEPS="env peer" bash benchmarks/run_gpu.sh          # checkpoint-engine beside refit, one GPU (carry .whl-peer)
#   STEPS="env peer2" bash benchmarks/run_gpu.sh         # the same over two GPUs (its NCCL broadcast)
#   STEPS="megatron fp8" MEGATRON_NCCL=auto,2/0 FP8_METHODS=wire,refit,refit@comms=4 bash benchmarks/run_gpu.sh
#                                                        # megatron / FP8 knobs (FP8_MODELS too;
#                                                        # FP8_QUANTIZERS=0 skips the quantizers alone)
#   STEPS="tests" GPU_TESTS=tests/gpu/test_fp8_gpu.py bash benchmarks/run_gpu.sh   # some GPU tests only
#   STEPS="bench" BENCH_MODELS=llama-3-8b-shape BENCH_METHODS=wire,refit,wire@copy,refit@mode=staged BENCH_ITERS=10 \
#     BENCH_ARGS="--timeline /tmp/t.png" bash benchmarks/run_gpu.sh   # the bench step's knobs
set -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
STEPS=${STEPS:-"env bench tests reshard reshard-dp demo colocated megatron fp8"}
source benchmarks/machine.sh
MACHINE=${MACHINE:-$(machine_name)}  # nvidia-h200-x2 on two H200s, nvidia-h200 on one
DATE=$(date -u +%F)
PY=${PY:-python3}
mkdir -p "$OUT"
LOG="$OUT/run.log"

if ls .whl/nccl4py-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PWD/tests/example_plugin:$PYTHONPATH
# Plugins are found through entry points: install refit and its plugins (no dependencies: the
# machine has torch and transformers) so that the tests and `refit demo` discover them.
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . -e plugins/dtensor -e tests/example_plugin \
  2>&1 | tail -3 | tee -a "$LOG"
# the per-step bound-memory check's compiled loop (refit_core/endpoints/compiled_check.py), built once, as
# scripts/setup-env.sh builds it: every step of every run below checks through it
$PY -c "from refit_core.endpoints.compiled_check import build; build()" 2>&1 | tail -3 | tee -a "$LOG"

step() { [[ " $STEPS " == *" $1 "* ]] && echo "== $1 at $(date -u +%T)" | tee -a "$LOG"; }

# limit SECONDS CMD...: run CMD in a process group of its own; end that group (the benchmark's rank
# processes included) if it runs past SECONDS.
limit() {
  local seconds=$1; shift
  setsid "$@" &
  local pid=$!
  # The watchdog keeps no descriptor of ours open (else whoever reads our output waits for it).
  setsid bash -c "sleep $seconds; echo '!! $1 ran past ${seconds}s: stopping it' >>'$LOG';
    kill -TERM -- -$pid 2>/dev/null; sleep 5; kill -KILL -- -$pid 2>/dev/null" </dev/null >/dev/null 2>&1 &
  local watchdog=$!
  wait "$pid"; local rc=$?
  kill -- "-$watchdog" 2>/dev/null
  return $rc
}

# bench_run NAME SECONDS STEP_TIMEOUT PREFIX "refit bench ARGS...": one `refit bench` run, stopped after SECONDS,
# its command line recorded in the results (PREFIX.md / .json), its exit status in the log.
bench_run() {
  local name=$1 seconds=$2 step_timeout=$3 prefix=$4 cmd=$5
  limit "$seconds" $PY -m refit_core.tools.bench ${cmd#refit bench } --timeout-s "$step_timeout" \
    --command "$cmd" --out "$prefix" 2>&1 | tee -a "$LOG"
  echo "$name exit: $?" | tee -a "$LOG"
}

if step env; then
  {
    echo "== $(date -u) on $(hostname)"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    nvidia-smi topo -m
    $PY - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
try:
    print("torch nccl", torch.cuda.nccl.version())
except Exception as exc:
    print("torch nccl: -", exc)
try:
    import cuda.core, nccl.core as nccl
    print("cuda.core", getattr(cuda.core, "__version__", "?"), "nccl4py", nccl.__version__, nccl.get_version())
except Exception as exc:
    print("nccl4py import failed:", type(exc).__name__, exc)
EOF
  } 2>&1 | tee -a "$LOG"
fi

if step bench; then
  bench_run bench ${BENCH_TIMEOUT:-300} 120 "$OUT/$MACHINE-bench-$DATE" \
    "refit bench --models ${BENCH_MODELS:-llama-3-8b-shape,qwen3-30b-a3b-shape} --methods ${BENCH_METHODS:-wire,per-tensor,packed,refit,refit@comms=1,refit@mode=staged,wire@copy} --train-gpus 0 --gen-gpus 1 --machine $MACHINE${BENCH_ITERS:+ --iters $BENCH_ITERS}${BENCH_ARGS:+ $BENCH_ARGS}"
fi

if step tests; then
  limit ${TESTS_TIMEOUT:-480} $PY -m pytest ${GPU_TESTS:-tests/gpu} -q -x -p no:cacheprovider 2>&1 | tail -30 | tee -a "$LOG"
  echo "tests exit: $?" | tee -a "$LOG"
fi

# mps_start / mps_stop: the reshard steps put two ranks on each GPU. Without MPS their processes time-slice
# the GPU: an NCCL kernel spins through its slice while its partner on the other GPU waits for its own,
# and one step took anywhere from the wire's 47 ms to 268 ms (2026-11-26). Under an MPS daemon their
# kernels run side by side, as in one process. MPS=0 runs them time-sliced.
mps_start() {
  [ "${MPS:-1}" = 1 ] || return 0
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "mps: nvidia-cuda-mps-control not found: the ranks sharing a GPU time-slice it" | tee -a "$LOG"; return 0
  fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/refit-mps CUDA_MPS_LOG_DIRECTORY=/tmp/refit-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "mps: daemon started for the ranks sharing a GPU" | tee -a "$LOG"
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

[[ " $STEPS " == *" reshard "* || " $STEPS " == *" reshard-dp "* ]] && mps_start
if step reshard; then
  bench_run reshard ${RESHARD_TIMEOUT:-110} 60 "$OUT/$MACHINE-reshard-$DATE" \
    "refit bench --models llama-3-8b-shape --methods wire,refit,refit@comms=1 --train-tp 2 --gen-tp 2 --train-gpus 0,0 --gen-gpus 1,1 --machine $MACHINE"
fi

# Each rank of this layout exchanges with two peers at once: under MPS, 4 communicators per pair (the
# default) deadlocked and 2 ran at the wire (2026-11-27; the transport warns at setup).
RESHARD_DP_REFIT=refit
[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && RESHARD_DP_REFIT=refit@comms=2
if step reshard-dp; then
  bench_run reshard-dp ${RESHARD_TIMEOUT:-110} 60 "$OUT/$MACHINE-reshard-dp-$DATE" \
    "refit bench --models llama-3-8b-shape --methods wire,$RESHARD_DP_REFIT,refit@comms=1 --train-tp 2 --gen-tp 1 --gen-dp 2 --train-gpus 0,0 --gen-gpus 1,1 --machine $MACHINE"
fi
mps_stop
if step demo; then
  limit ${DEMO_TIMEOUT:-240} $PY -m refit_core demo --train dtensor --gen dtensor --device cuda --steps 2 \
    2>&1 | tail -8 | tee -a "$LOG"
  echo "demo exit: $?" | tee -a "$LOG"
fi
if step colocated; then
  limit ${COLOCATED_TIMEOUT:-480} env OUT="$OUT" PY="$PY" MACHINE="$MACHINE" bash benchmarks/run_colocated.sh 2>&1 | tee -a "$LOG"
  echo "colocated exit: $?" | tee -a "$LOG"
fi
if step timeline; then
  bench_run timeline ${TIMELINE_TIMEOUT:-150} 60 "$OUT/timeline-$MACHINE-$DATE" \
    "refit bench --models llama-3-8b-shape --methods wire,refit --train-gpus 0 --gen-gpus 1 --machine $MACHINE --timeline $OUT/timeline-$MACHINE-$DATE.png"
fi
if step relay; then
  # NCCL's broadcast of one replica's bytes to the 3 replica GPUs is the reference (it runs by itself with --gen-dp).
  for model in ${RELAY_MODELS:-llama-3-8b-shape qwen3-30b-a3b-shape}; do
    bench_run relay ${RELAY_TIMEOUT:-150} 120 "$OUT/$MACHINE-fleet-$model-$DATE" \
      "refit bench --models $model --methods ${RELAY_METHODS:-refit,refit@replicas=3+relay=1,refit@replicas=3+relay=1+broadcast=1,refit@mode=staged+replicas=3+relay=1+broadcast=1} --gen-dp 3 --train-gpus 0 --gen-gpus 1,2,3 --machine $MACHINE"
  done
fi
if step relay-fp8; then
  # block-FP8 destinations through the relay: the trainers quantize, replicas forward the FP8 values and scales
  bench_run relay-fp8 ${RELAY_TIMEOUT:-150} 120 "$OUT/$MACHINE-fleet-fp8-$DATE" \
    "refit bench --models llama-3-8b-shape --fp8-block 128,128 --methods ${RELAY_FP8_METHODS:-refit,refit@replicas=3+relay=1,refit@replicas=3+relay=1+broadcast=1} --gen-dp 3 --train-gpus 0 --gen-gpus 1,2,3 --machine $MACHINE"
fi
if step reshard-x4; then
  bench_run reshard-x4 ${RESHARD_TIMEOUT:-240} 120 "$OUT/$MACHINE-reshard-x4-$DATE" \
    "refit bench --models ${RESHARD_MODELS:-llama-3-8b-shape,qwen3-30b-a3b-shape} --methods ${RESHARD_METHODS:-wire,refit} --train-tp 2 --gen-tp 1 --gen-dp 2 --train-gpus 0,1 --gen-gpus 2,3 --machine $MACHINE"
fi
if step megatron; then
  OUT="$OUT" PY="$PY" MACHINE="$MACHINE" limit ${MEGATRON_TIMEOUT:-300} bash benchmarks/megatron_gpu.sh 2>&1 | tail -12 | tee -a "$LOG"
  echo "megatron exit: $?" | tee -a "$LOG"
fi
fp8_bench() {
  # Llama-3-8B and Qwen3-30B-A3B shapes, each into BF16 (wire, refit) and block-FP8 128 x 128 (wire over the
  # FP8 bytes, refit quantizing on the sender, BF16 refit + quantize-after), every byte checked. Four
  # runs (two per model) and the quantizer's compilation: run this step alone (STEPS=fp8).
  # Preflight: what the FP8 bench imports (refit's bench and quantizer; needed) and what it runs better
  # with (triton compiles the quantizer, else it runs eagerly; nccl4py, else torch's NCCL), and two
  # GPUs: named before any rank starts.
  $PY - <<'EOF' 2>&1 | tee -a "$LOG" || { echo "fp8 exit: preflight failed" | tee -a "$LOG"; return 1; }
import importlib, torch
def missing(names):
    out = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            out.append(f"{name} ({type(exc).__name__}: {exc})")
    return out
needed = missing(["refit_core.tools.bench.runner", "refit_core.tools.bench.fp8", "refit_core.run.quant.fast"])
optional = missing(["triton", "nccl.core"])
print("fp8 preflight: torch", torch.__version__, "gpus", torch.cuda.device_count(), "float8", torch.float8_e4m3fn,
      "missing:", needed or "none", "optional missing:", optional or "none")
raise SystemExit(1 if needed or torch.cuda.device_count() < 2 else 0)
EOF
  # the quantizers alone on GPU 0: copy bound, eager, compiled per tensor, batched Triton (refit's pack step)
  [ "${FP8_QUANTIZERS:-1}" = 1 ] && limit 240 $PY benchmarks/quantizer_speed.py --out "$OUT/quantizer-speed-$MACHINE-$DATE" 2>&1 | tee -a "$LOG"
  local cmd="refit bench --models ${FP8_MODELS:-llama-3-8b-shape,qwen3-30b-a3b-shape} --methods ${FP8_METHODS:-wire,refit} --fp8-block 128,128 --train-gpus 0 --gen-gpus 1 --machine $MACHINE"
  [ -n "${FP8_TIMELINE:-}" ] && cmd="$cmd --timeline $OUT/timeline-fp8-$MACHINE-$DATE.png"
  limit ${FP8_TIMEOUT:-540} $PY -m refit_core.tools.bench ${cmd#refit bench } --timeout-s 150 \
    --command "$cmd" --out "$OUT/$MACHINE-fp8-$DATE" 2>&1 | tee -a "$LOG"
  echo "fp8 exit: $?" | tee -a "$LOG"
}
if step fp8; then
  fp8_bench
fi
# peer_bench STEP GPUS: checkpoint-engine (installed from .whl-peer/ into /tmp/peer-site, only for this
# step) beside refit on both shapes; results in $OUT/STEP-$MACHINE-$DATE.{md,json}.
peer_bench() {
  local name=$1 gpus=$2
  if ! ls .whl-peer/checkpoint_engine-*.whl >/dev/null 2>&1; then
    echo "$name exit: no .whl-peer/checkpoint_engine-*.whl here (run with carry: [\".whl-peer\"])" | tee -a "$LOG"
    return 1
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peer-site \
    .whl-peer/*.whl 2>&1 | tail -3 | tee -a "$LOG"
  limit ${PEER_TIMEOUT:-540} env PYTHONPATH="/tmp/peer-site:$PYTHONPATH" $PY benchmarks/peer_checkpoint_engine.py \
    --gpus "$gpus" --models "${PEER_MODELS:-llama-3-8b-shape,qwen3-30b-a3b-shape}" --iters "${PEER_ITERS:-5}" \
    --timeout-s 150 --machine "$MACHINE" --out "$OUT/$name-$MACHINE-$DATE" 2>&1 | tee -a "$LOG"
  echo "$name exit: $?" | tee -a "$LOG"
}
if step lora; then
  bench_run lora ${LORA_TIMEOUT:-240} 120 "$OUT/$MACHINE-lora-$DATE" \
    "refit bench --models llama-3-8b-shape --lora r=64 --train-gpus 0 --gen-gpus 1 --machine $MACHINE"
fi
if step peer; then
  peer_bench peer 1
fi
if step peer2; then
  peer_bench peer2 2
fi
echo "== done at $(date -u +%T)" | tee -a "$LOG"

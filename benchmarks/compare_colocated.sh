#!/usr/bin/env bash
# The colocated step (benchmarks/run_colocated.sh, one GPU) of an older checkout and of this one, alternating
# on one machine, so a refactor shows its colocated ratios unchanged within the run-to-run noise:
#
#   git archive OLD refit_core benchmarks plugins/dtensor tests pyproject.toml README.md | tar -x -C .base
#   BASE=.base ORDER="base head" OUT=/somewhere bash benchmarks/compare_colocated.sh
#
# ORDER lists the runs (base / head, any number, in that order; default "head base head base"); each run
# writes $OUT/<run><n>/colocated-<machine>-<date>.{json,md}. COLOCATED_MODELS defaults to the two headline
# shapes (no sequential-expert or FP8 runs), ITERS / WARMUP pass through.
set -o pipefail
cd "$(dirname "$0")/.."
BASE=$(cd "${BASE:?set BASE to the older checkout}" && pwd)
OUT=${OUT:-benchmarks/results}
ORDER=${ORDER:-"head base head base"}
export COLOCATED_MODELS=${COLOCATED_MODELS:-llama-3-8b-shape,qwen3-30b-a3b-shape}
n=0
for run in $ORDER; do
  n=$((n + 1))
  dir=$([[ $run == base ]] && echo "$BASE" || pwd)
  echo "== $run (run $n) from $dir at $(date -u +%T)"
  # the older checkout's own plugins shadow the installed ones (they import that checkout's public names)
  (cd "$dir" && PYTHONPATH="$dir/plugins/dtensor:$dir/tests/example_plugin:${PYTHONPATH:-}" OUT="$OUT/$run$n" \
    bash benchmarks/run_colocated.sh) || echo "!! $run (run $n) failed: $?"
done
for table in "$OUT"/*/colocated-*.md; do
  echo "== $table"
  grep -E "^\| *(llama|qwen)" "$table" || tail -5 "$table"
done

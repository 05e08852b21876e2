#!/usr/bin/env bash
# Packaging as users get it: build wheels of refit-core, every plugin under plugins/ and the example
# plugin, install them (not editable) into a clean virtualenv, then run what a user runs first there:
# `refit plugins`, `refit check-plugin` for every plugin, and a real two-program refit (`refit demo`).
# Runs from a temporary folder, so nothing can be imported from the work tree. CI calls it (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/refit-wheels.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. scripts/installer.sh   # venv_install: uv (pip where uv cannot be had), with this machine's pip settings
start=$SECONDS

# the wheels users install from this repository (docs/install.md), and the example plugin's
bash scripts/build-wheels.sh --example "$WORK/wheels"
echo "check-wheels: built ($((SECONDS - start)) s)"

"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# torch 2.13.0: the CPU build (see DEVELOPERS.md), with the wheels in one resolution
venv_install "$WORK/venv" torch==2.13.0 "$WORK"/wheels/*.whl
echo "check-wheels: installed into a clean virtualenv ($((SECONDS - start)) s)"
cd "$WORK"

# every module comes from the virtualenv's site-packages, none from a source tree
"$VPY" - <<'PY'
import importlib, importlib.metadata as md, sys
for module, dist in [("refit_core", "refit-core"), ("refit_dtensor", "refit-plugin-dtensor"),
                     ("refit_vllm", "refit-plugin-vllm"), ("refit_toy", "refit-plugin-toy"),
                     ("refit_megatron", "refit-plugin-megatron"), ("refit_sglang", "refit-plugin-sglang"),
                     ("refit_verl", "refit-plugin-verl")]:
    path = importlib.import_module(module).__file__
    if "site-packages" not in path:
        sys.exit(f"check-wheels: {module} imported from {path}, not from the installed wheel")
    if md.distribution(dist).read_text("direct_url.json") and "editable" in md.distribution(dist).read_text("direct_url.json"):
        sys.exit(f"check-wheels: {dist} is an editable install")
    print(f"check-wheels: {dist} {md.version(dist)} (requires-python {md.metadata(dist)['Requires-Python']}) from {path}")
PY

plugins=(toy dtensor vllm megatron sglang verl)
"$WORK/venv/bin/refit" plugins | tee "$WORK/plugins.txt"
for plugin in "${plugins[@]}"; do
    grep -q "^$plugin  *refit-plugin-$plugin " "$WORK/plugins.txt" || { echo "check-wheels: refit plugins does not list $plugin" >&2; exit 1; }
done
if grep -q BROKEN "$WORK/plugins.txt"; then echo "check-wheels: a plugin failed to import" >&2; exit 1; fi
# every suite at once (megatron, sglang, verl: model-free, without their frameworks), each one's verdict in
# turn, and a failing one's whole report
declare -A checks
for plugin in "${plugins[@]}"; do
    "$WORK/venv/bin/refit" check-plugin "$plugin" > "$WORK/check-$plugin.txt" 2>&1 &
    checks[$plugin]=$!
done
failed=0
for plugin in "${plugins[@]}"; do
    if wait "${checks[$plugin]}"; then tail -1 "$WORK/check-$plugin.txt"
    else cat "$WORK/check-$plugin.txt" >&2; failed=1
    fi
done
[ "$failed" = 0 ] || { echo "check-wheels: a plugin failed its checks" >&2; exit 1; }
echo "check-wheels: plugins conform ($((SECONDS - start)) s)"
# one real refit between two programs, verified bitwise (only the toy plugin loaded: faster ranks)
REFIT_PLUGINS=toy "$WORK/venv/bin/refit" demo --train toy --gen toy --steps 2 --timeout 300
echo "check-wheels: OK in $((SECONDS - start)) s"

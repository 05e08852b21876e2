"""checkpoint-engine (pip package 0.4.x, through its own API) beside refit: one GPU or two.

    python benchmarks/peer_checkpoint_engine.py --gpus 1 --out benchmarks/results/peer-nvidia-h200-DATE
    python benchmarks/peer_checkpoint_engine.py --gpus 2 --out benchmarks/results/peer2-nvidia-h200-x2-DATE

The whole harness is refit_core/tools/bench/peer.py (see its docstring for what is timed and how);
benchmarks/run_gpu.sh runs it as STEPS=peer (one GPU) and STEPS=peer2 (two GPUs), after installing
checkpoint-engine and its dependencies from the carried wheels in .whl-peer/.
"""

import sys

from refit_core.tools.bench.peer import main

if __name__ == "__main__":
    sys.exit(main())

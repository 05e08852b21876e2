#!/usr/bin/env bash
# Wheels the GPU machine (Python 3.12, no network) needs beside its own packages, into .whl/
# (git-ignored). Run here, before a GPU run that carries .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
# megatron-core: 0.16.1, the version the CPU tests run (0.17+ need Python 3.12 and are untested here);
# it requires torch, numpy and packaging>=24.2, which the GPU image has (einops too).
download megatron-core==0.16.1
# nccl4py (refit's NCCL backend: one communicator per pair of ranks) and what it needs beside the image's
# torch (which brings NCCL itself): cuda-core, cuda-pathfinder and cuda-bindings for CUDA 13 (~18 MB).
download nccl4py==0.6.0 "cuda-core~=1.0" "cuda-pathfinder>=1.5.4,<2" "cuda-bindings~=13.0"

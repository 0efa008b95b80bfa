#!/usr/bin/env bash
# Transformer Engine for deviceless GPU compilation on a machine without a GPU (compile-only):
# TE's Python package, its prebuilt core library for jax's CUDA 13, and its JAX extension built
# from the sdist against the jax in .venv; then the driver stand-in (scripts/cuda_stub/) that lets
# TE's libraries load where there is no NVIDIA driver. Run after scripts/setup.sh. Idempotent.
# About 5 min and 0.6 GB on 2 cores (the build compiles one C++ file at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
TE_VERSION=2.20.2
PIP=(.venv/bin/python -m pip install -q)
if ! .venv/bin/python -c "import transformer_engine_jax" 2>/dev/null; then
    # build requirements of the extension: pybind11's CMake files, cuDNN's frontend headers (only
    # the headers: --no-deps skips its 0.5 GB CUTLASS DSL), NVTX headers, and cuRAND (TE's core
    # library links it)
    "${PIP[@]}" "pybind11[global]" nvidia-nvtx nvidia-curand setuptools wheel
    "${PIP[@]}" --no-deps nvidia-cudnn-frontend
    "${PIP[@]}" --no-deps "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION"
    NVTE_FRAMEWORK=jax NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS=${MAX_JOBS:-2} \
        "${PIP[@]}" --no-build-isolation --no-deps "transformer-engine-jax==$TE_VERSION"
fi
.venv/bin/python scripts/cuda_stub/build.py

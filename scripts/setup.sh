#!/usr/bin/env bash
# Create .venv with everything moe-jax and its tests need (CPU, plus XLA's GPU compiler and
# Transformer Engine for the deviceless GPU compile checks). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: on these machines 2.13.0 is a CPU build on disk; an unpinned torch
# pulled in by transformers would download a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# XLA's GPU compiler (jax's CUDA plugin and the CUDA wheels: about 4.4 GB, 2-3 min) at exactly
# jax's version: it compiles for GPU targets on this machine without a GPU (moe_jax/gpu.py).
JAX_VERSION=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("jax"))')
.venv/bin/python -m pip install -q "jax[cuda13]==$JAX_VERSION"
# Transformer Engine for the deviceless `te` backend checks (about 5 min: its JAX extension is
# built from source here; compile-only on a machine without a GPU).
bash scripts/setup_te.sh

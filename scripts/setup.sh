#!/usr/bin/env bash
# Create .venv with everything moe-jax and its tests need (CPU). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: on these machines 2.13.0 is a CPU build on disk; an unpinned torch
# pulled in by transformers would download a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"

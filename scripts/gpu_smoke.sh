#!/usr/bin/env bash
# GPU smoke check (no network): a random 0.5B-shape Qwen2 trains a few GRPO steps on one
# NVIDIA GPU and prints rollout/training throughput, MFU, weight-sync time and peak memory.
# Runs on a CPU too, smaller (--shape cpu). Extra arguments go to scripts/gpu_smoke.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" scripts/gpu_smoke.py "$@"

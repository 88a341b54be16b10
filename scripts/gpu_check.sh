#!/usr/bin/env bash
# The one-shot GPU check (scripts/gpu_check.py): on one NVIDIA GPU, without network, vLLM or
# Hydra (torch, transformers, accelerate and peft are all it needs), under 8 minutes; writes
# one JSON (--out, default runs/gpu_check.json) and prints a short table.
#     bash scripts/gpu_check.sh [--out PATH]
#     bash scripts/gpu_check.sh --cpu        # the same code on tiny shapes, ~1 minute (CI)
# The repository is used in place (PYTHONPATH), so nothing needs installing there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" scripts/gpu_check.py "$@"

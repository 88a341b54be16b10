#!/usr/bin/env bash
# Creates .venv-trl from nothing: Hugging Face TRL beside the CPU build of torch and the
# transformers of the main environment, for benchmarks/vs_trl.py and the tests marked `trl`:
#
#     bash scripts/setup_trl_env.sh
#     .venv/bin/python -m pytest -q -m trl
#
# A separate environment so that selfcest's own never gets TRL's dependencies, and so that
# the TRL side of the benchmark cannot import selfcest. Pins: requirements/trl.txt. Takes
# 1.5 minutes on a busy 2-core machine, and 1.5 GB.
#
# Environment: PYTHON (default python3), VENV (default .venv-trl).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-trl}

start=$(date +%s)
# --clear: always start from nothing, so a half-finished earlier attempt cannot leak in.
"$PYTHON" -m venv --clear "$VENV"
# One pip command, torch pinned in it (requirements/trl.txt): any looser torch requirement
# lets pip fetch a multi-GB CUDA build instead of the CPU build of 2.13.0.
"$VENV/bin/pip" install --quiet -r requirements/trl.txt
"$VENV/bin/pip" check
"$VENV/bin/python" -c "import trl, transformers; print('trl', trl.__version__, 'transformers', transformers.__version__, 'ready in $VENV')"
echo "setup took $(( $(date +%s) - start )) s"

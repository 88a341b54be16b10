#!/usr/bin/env bash
# Run pytest under 12 float setups: torch's CPU kernels (ATEN_CPU_CAPABILITY) x MKL's code
# path (MKL_CBWR), so that a test depending on one machine's rounding shows up on this one.
# Usage: scripts/float_setups.sh [pytest arguments...]; prints one line per setup, exits 1
# if any setup failed. A failing setup's log is kept in runs/float_setups/.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
logs=runs/float_setups
mkdir -p "$logs"
failed=0
for capability in avx512 avx2 default; do
    for cbwr in AUTO COMPATIBLE SSE4_2 AVX2; do
        setup="ATEN_CPU_CAPABILITY=$capability MKL_CBWR=$cbwr"
        log="$logs/$capability-$cbwr.log"
        if ATEN_CPU_CAPABILITY=$capability MKL_CBWR=$cbwr "$python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1; then
            echo "pass  $setup  $(tail -n 1 "$log")"
            rm "$log"
        else
            echo "FAIL  $setup  $(tail -n 1 "$log")  (log: $log)"
            failed=1
        fi
    done
done
exit $failed

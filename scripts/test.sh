#!/usr/bin/env bash
# The README's test command: installs (idempotent) and runs the test suite.
# Default: everything except tests marked `slow`-only heavy runs listed in LILICORR_TEST_MARKERS.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export PYTHONUNBUFFERED=1
# one torch thread per process: on 2 shared cores more threads spin against each other
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
markers=${LILICORR_TEST_MARKERS:-}
if [ -n "$markers" ]; then
  exec python -m pytest -q -m "$markers" "$@"
fi
exec python -m pytest -q "$@"

#!/usr/bin/env bash
# The README's test command: installs (idempotent) and runs the test suite.
# Runs the whole suite, slow and integration tests included (10-15 minutes on 2 cores);
# LILICORR_TEST_MARKERS (a pytest -m expression) or extra pytest arguments select a subset.
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

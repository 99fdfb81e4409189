#!/usr/bin/env bash
# Sets everything up, then runs the test suite (CPU only, offline): all of it with no arguments, the fast dev loop
# with `scripts/test.sh -m "not slow"`; any other pytest arguments pass through.
# One torch/OpenMP thread unless set: the tiny test models gain nothing from more, and on a busy machine idle OpenMP
# threads spinning for a core made the suite several times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q "$@"

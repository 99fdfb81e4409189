#!/usr/bin/env bash
# Sets everything up, then runs the test suite (CPU only, offline). With no arguments: all of it, the main suite in
# .venv and then the vLLM plugin's suite in .venv-vllm (scripts/test-vllm.sh). With arguments (the fast dev loop is
# `scripts/test.sh -m "not slow"`): the main suite only, the arguments passed through to pytest.
# One torch/OpenMP thread unless set: the tiny test models gain nothing from more, and on a busy machine idle OpenMP
# threads spinning for a core made the suite several times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ]; then
  scripts/test-vllm.sh
fi

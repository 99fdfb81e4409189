#!/usr/bin/env bash
# Sets everything up, then runs the test suite (CPU only, offline).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q "$@"

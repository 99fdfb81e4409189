#!/usr/bin/env bash
# Sets everything up, then runs the main job: speculative generation on the default small target.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
HF_HUB_OFFLINE=1 .venv/bin/python examples/01_generate.py "$@"

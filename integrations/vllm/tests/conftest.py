"""Fixtures for the plugin's tests: the target, exported card folders, one vLLM engine at a time.

The exported folders come from the project's own exporter, run in the project's venv by subprocess
(`HF_RETRACE_PYTHON`, default `.venv/bin/python -m hf_retrace.cli` of this checkout), since this venv has no hf_retrace.
"""

import atexit
import gc
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # without a bind vLLM computes on one core
# the default target sits where hf_retrace caches it (scripts/test-vllm.sh makes it there): the user's cache, read
# before the line below points HF_RETRACE_CACHE at this run's own
USER_CACHE = os.environ.get("HF_RETRACE_CACHE") or "~/.cache/hf_retrace"
# the proposer's step-cost files (keyed by the drafter's config: one for the tests' random drafters, but where a
# test sets its own cache) go to a cache of this run, not the user's: no test reads a file an earlier run left, and
# ~/.cache/hf_retrace/cost does not fill with dead files
os.environ["HF_RETRACE_CACHE"] = tempfile.mkdtemp(prefix="hf-retrace-test-cache-")
atexit.register(shutil.rmtree, os.environ["HF_RETRACE_CACHE"], ignore_errors=True)

REPO = Path(__file__).resolve().parents[3]
TARGET = Path(os.environ.get("HF_RETRACE_TARGET") or f"{USER_CACHE}/smollm2-135m-instruct").expanduser()
HF_RETRACE_PYTHON = os.environ.get("HF_RETRACE_PYTHON", f"{REPO}/.venv/bin/python -m hf_retrace.cli")

# Prompts with repeats (prompt lookup), common phrasing (datastore) and free text (the drafter).
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List the planets of the solar system in order from the Sun, one per line:\n",
    "Question: Tom has 3 apples and buys 5 more. How many apples does Tom have?\nAnswer:",
    "Write a Python function that reverses a string, then explain how it works.\n",
]
MAX_TOKENS = 48


def export_card(card: str, out_dir: Path) -> Path:
    """`hf-retrace export --format vllm --drafter model_cards/<card> --output <out_dir>`."""
    drafter = REPO / "model_cards" / card
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    command = [*shlex.split(HF_RETRACE_PYTHON), "export", "--format", "vllm", "--drafter", str(drafter),
               "--output", str(out_dir), "--target", str(TARGET), "--overwrite"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode:
        raise RuntimeError(f"export of {card} failed:\n{result.stderr[-3000:]}")
    return out_dir


@pytest.fixture(scope="package")
def target() -> str:
    if not (TARGET / "config.json").is_file():
        # a failure, not a skip: without the target the lossless checks would silently not run
        pytest.fail(f"no target at {TARGET}: scripts/test-vllm.sh makes it (hf_retrace.data.assets.ensure_default_target)")
    return str(TARGET)


@pytest.fixture(scope="package")
def exports(tmp_path_factory):
    """`card -> exported folder`, made on first use."""
    root = tmp_path_factory.mktemp("exports")
    made = {}

    def get(card: str) -> Path:
        if card not in made:
            made[card] = export_card(card, root / card)
        return made[card]

    return get


def make_llm(target: str, speculative_config=None, **engine_args):
    """An eager engine on `target`; `engine_args` go to `vllm.LLM` (e.g. `max_num_batched_tokens`)."""
    from vllm import LLM

    return LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
               speculative_config=speculative_config, **engine_args)  # fmt: skip


def close_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="package")
def plain_greedy(target):
    """vLLM's own greedy output (no speculation) on PROMPTS: one engine start-up for the whole run."""
    llm = make_llm(target)
    try:
        return greedy(llm)
    finally:
        close_llm(llm)


def run_speculative(target: str, folder: Path, stats_file: Path, num_speculative_tokens: int = 3):
    """Greedy outputs on PROMPTS with `folder` as the DFlash drafter, and the proposer's counters (or `None` when
    the hf-retrace proposer did not run)."""
    from hf_retrace_vllm import STATS_ENV

    os.environ[STATS_ENV] = str(stats_file)
    try:
        llm = make_llm(target, {"method": "dflash", "model": str(folder),
                                "num_speculative_tokens": num_speculative_tokens})  # fmt: skip
        try:
            outputs = greedy(llm)
        finally:
            close_llm(llm)
    finally:
        del os.environ[STATS_ENV]
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else None
    return outputs, stats

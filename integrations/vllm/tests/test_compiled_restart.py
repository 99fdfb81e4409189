"""An engine with the plugin in vLLM's default compiled mode (no `enforce_eager`), started twice in separate processes
on one compile cache (`VLLM_CACHE_ROOT`), as a user restarting a server does. The second start used to die with
"Fatal Python error: _Py_CheckRecursiveCall": vLLM 0.32 on CPU fails to load its own compiled artifacts and compiles
again, and during that compile the garbage collector freed the oneDNN handle of the drafter's discarded embedding
(model.py, `_release_own_embedding`). Both starts must succeed and give plain compiled vLLM's greedy output."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import MAX_TOKENS, PROMPTS
from test_lossless_random import write_drafter


TARGET_LAYERS = 3  # the default target cut to its first layers: a compile of seconds rather than minutes


ENGINE = '''
import json, sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    target, folder, prompts, out = sys.argv[1:]
    spec = {"method": "dflash", "model": folder, "num_speculative_tokens": 3} if folder != "-" else None
    llm = LLM(model=target, dtype="float32", max_model_len=1024, max_num_seqs=8, seed=0, speculative_config=spec)
    prompts, max_tokens = json.loads(prompts)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    with open(out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outputs], f)
'''
CACHE_LOADED = "Directly load AOT compilation"  # vLLM's log line when a start reuses compiled artifacts


def start_engine(script, target, folder, out, cache_root) -> str:
    """One engine start in a fresh process; returns its log (stdout + stderr)."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root)}
    env.pop("VLLM_DISABLE_COMPILE_CACHE", None)
    prompts = json.dumps([PROMPTS, MAX_TOKENS])
    result = subprocess.run([sys.executable, str(script), target, str(folder), prompts, str(out)], env=env,
                            capture_output=True, text=True, timeout=1800)  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"engine start failed (rc {result.returncode}):\n{log[-4000:]}"
    return log


@pytest.fixture(scope="module")
def small_pair(target, tmp_path_factory):
    """(target, drafter): the default target's first `TARGET_LAYERS` layers, and a random hf-retrace drafter (anchor
    term, reduced vocabulary, ReTrace) reading its layers 0 and 1."""
    root = tmp_path_factory.mktemp("small-pair")
    small = root / "target"
    small.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (Path(target) / name).exists():
            shutil.copy(Path(target) / name, small / name)
    config = json.loads((Path(target) / "config.json").read_text())
    config["num_hidden_layers"] = TARGET_LAYERS
    (small / "config.json").write_text(json.dumps(config, indent=2))
    keep = ("model.embed_tokens.", "model.norm.", *(f"model.layers.{i}." for i in range(TARGET_LAYERS)))
    tensors = {k: v for k, v in load_file(Path(target) / "model.safetensors").items() if k.startswith(keep)}
    save_file(tensors, small / "model.safetensors", metadata={"format": "pt"})
    drafter = root / "drafter"
    write_drafter(drafter, plain=False)
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 1]
    config["num_target_layers"] = TARGET_LAYERS
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    return str(small), drafter


def test_restart_on_compile_cache_is_lossless(small_pair, tmp_path):
    target, folder = small_pair
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    cache = tmp_path / "vllm-cache"
    start_engine(script, target, "-", tmp_path / "plain.json", cache)  # plain vLLM, compiled too
    first_log = start_engine(script, target, folder, tmp_path / "first.json", cache)
    second_log = start_engine(script, target, folder, tmp_path / "second.json", cache)
    plain = json.loads((tmp_path / "plain.json").read_text())
    first = json.loads((tmp_path / "first.json").read_text())
    second = json.loads((tmp_path / "second.json").read_text())

    for log in (first_log, second_log):
        # the crash's cause: a oneDNN GEMM handle freed by the garbage collector inside torch.compile's tracing
        assert "CPUDNNLGEMMHandler.__del__" not in log
    # the second start read the first one's artifacts (vLLM 0.32 on CPU may still fail to load them and recompile)
    assert CACHE_LOADED in second_log or "Compiling model again due to a load failure" in second_log
    assert first == plain
    assert second == plain

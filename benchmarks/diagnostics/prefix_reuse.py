"""How much of a returning prompt vLLM's prefix cache reuses, with and without an hf-retrace drafter.

Runs the same prompts twice on one engine (the second call stands for a conversation's next turn, or a shared system
prompt) and prints, per call, the prompt tokens, those read from the prefix cache (each output's
`num_cached_tokens`), and the call's seconds. Runs in `.venv-vllm` with the CPU preloads, the engine in this process:

    scripts/vllm-env.sh .venv-vllm/bin/python benchmarks/diagnostics/prefix_reuse.py prompts.json \\
        [--drafter EXPORTED_FOLDER [--block-drop]]

`--no-prefix-caching --calls 3` times the prefill itself: every call computes every prompt token, so the calls of
an engine with a drafter beside those of vLLM alone (engines alternated, each alone on the cores) show what the
drafter adds to a prefill.

`prompts.json`: a JSON list of prompts, each a list of token ids. Without `--drafter`, vLLM alone. `--block-drop`
puts back vLLM's own rule for EAGLE-like drafters (the last block of every hit is computed again), which the plugin
turns off for hf-retrace folders (`hf_retrace_vllm/patches.py`, hook point 6), so one checkout measures both.
"""

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="a JSON list of token-id lists")
    parser.add_argument("--target", default=os.path.expanduser("~/.cache/hf_retrace/smollm2-135m-instruct"))
    parser.add_argument("--drafter", default=None, help="an `hf-retrace export --format vllm` folder")
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--block-drop", action="store_true", help="vLLM's EAGLE rule: drop each hit's last block")
    parser.add_argument("--max-new-tokens", type=int, default=1, help="1: the calls time the prefill alone")
    parser.add_argument("--calls", type=int, default=2, help="calls of the same prompts, one after another")
    parser.add_argument("--no-prefix-caching", action="store_true", help="every call computes every prompt token")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process, where the patch below acts
    from vllm import LLM, SamplingParams
    from vllm.config import SpeculativeConfig

    if args.block_drop:  # vLLM's own rule, marked as patched so that the plugin's install() leaves it alone
        import hf_retrace_vllm
        from hf_retrace_vllm.contract import MARK

        hf_retrace_vllm.register()
        original = SpeculativeConfig.use_eagle_block_drop.__wrapped__

        def use_eagle_block_drop(self) -> bool:
            return original(self)

        setattr(use_eagle_block_drop, MARK, True)
        SpeculativeConfig.use_eagle_block_drop = use_eagle_block_drop
    with open(args.prompts) as f:
        prompts = [{"prompt_token_ids": ids} for ids in json.load(f)]
    spec = None
    if args.drafter:
        spec = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(model=args.target, dtype="float32", max_model_len=4096, speculative_config=spec, seed=0,
              max_num_seqs=len(prompts), enable_prefix_caching=not args.no_prefix_caching)  # fmt: skip
    print(f"block size {llm.llm_engine.vllm_config.cache_config.block_size}, "
          f"block drop {bool(spec) and llm.llm_engine.vllm_config.speculative_config.use_eagle_block_drop()}")
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    for call in ["first"] + ["again"] * (args.calls - 1):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        total = sum(len(p["prompt_token_ids"]) for p in prompts)
        cached = sum(o.num_cached_tokens or 0 for o in outputs)
        print(f"{call}: {len(prompts)} prompts, {total} prompt tokens, {cached} from the prefix cache, "
              f"{total - cached} computed, {seconds:.2f} s")


if __name__ == "__main__":
    main()

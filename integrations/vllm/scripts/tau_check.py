"""Quick fidelity check of an exported drafter in vLLM: tau of the hf-retrace proposer (pooled over cycles of all
prompts, bonus included), its cycles by source, and whether greedy output equals vLLM's plain greedy.

    .venv-vllm/bin/python integrations/vllm/scripts/tau_check.py --drafter EXPORTED_DIR --prompts prompts.jsonl \
        --max-new-tokens 64

`--prompts`: a `.jsonl` of `{"input_ids": [...]}` records, the format `hf-retrace bench --prompt-sets` reads, so both
engines see the same token ids. Each request runs alone (batch 1), as in the transformers bench.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.expanduser("~/.cache/hf_retrace/smollm2-135m-instruct"))
    parser.add_argument("--drafter", required=True, help="an `hf-retrace export --format vllm` folder")
    parser.add_argument("--prompts", required=True, help='.jsonl of {"input_ids": [...]}')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hf_retrace_vllm import STATS_ENV, read_stats

    prompts = [TokensPrompt(prompt_token_ids=json.loads(line)["input_ids"]) for line in open(args.prompts) if line.strip()]
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    stats_file = Path(tempfile.mkdtemp()) / "stats.json"
    results = {}
    for name, spec in (("plain", None), ("speculative", {"method": "dflash", "model": args.drafter,
                                                         "num_speculative_tokens": args.num_speculative_tokens})):
        if spec is not None:
            os.environ[STATS_ENV] = str(stats_file)
        llm = LLM(model=args.target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                  speculative_config=spec)  # fmt: skip
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warmup
        before = read_stats(stats_file) if spec is not None else None
        start, outputs, tokens = time.perf_counter(), [], 0
        for prompt in prompts:  # one at a time: batch 1
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            outputs.append(list(out.token_ids))
            tokens += len(out.token_ids)
        results[name] = (outputs, tokens / (time.perf_counter() - start))
        if spec is not None:
            stats = _difference(read_stats(stats_file), before)  # without the warmup request
        llm.llm_engine.engine_core.shutdown()
        del llm
    same = [a == b for a, b in zip(results["plain"][0], results["speculative"][0])]
    print(json.dumps({
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "lossless": all(same), "lossless_per_prompt": same,
        "plain_tok_s": round(results["plain"][1], 2), "speculative_tok_s": round(results["speculative"][1], 2),
        "proposer": stats,
    }, indent=1))  # fmt: skip


def _difference(after: dict, before: dict) -> dict:
    """Counters of the measured requests: `after - before`, and their tau."""
    out = {key: {s: after[key][s] - before[key][s] for s in after[key]} for key in ("cycles", "committed")}
    for key in ("drafter_forwards", "conditioned_blocks", "retained_slots"):
        out[key] = after[key] - before[key]
    out["tau"] = sum(out["committed"].values()) / max(sum(out["cycles"].values()), 1)
    return out


if __name__ == "__main__":
    main()

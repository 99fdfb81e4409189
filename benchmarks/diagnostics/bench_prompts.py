"""Writes the serving bench's greedy prompts of one group as a JSON list of token-id lists (the input of
`prefix_reuse.py`), the same ids `serving_paired.py` sends at that concurrency. Runs in the project's venv:

    .venv/bin/python benchmarks/diagnostics/bench_prompts.py --group pool_eval --concurrency 32 > prompts.json
"""

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench's modules

from serving import DEFAULT_TARGET  # noqa: E402
from serving_methods import GROUPS, PromptPlan, encode_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", choices=list(GROUPS), default="pool_eval")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts-per-set", type=int, default=8)
    parser.add_argument("--prompt-seed", type=int, default=10_000)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from hf_retrace.data.assets import ensure_default_target

    ensure_default_target(DEFAULT_TARGET)
    plan = PromptPlan(args.num_prompts_per_set, 1, [args.concurrency], [])
    prompts = encode_prompts(AutoTokenizer.from_pretrained(str(DEFAULT_TARGET)), plan, args.prompt_seed)
    picked = plan.pick(prompts, args.concurrency, sampled=False)
    json.dump([p.token_ids for p in picked if p.group == args.group], sys.stdout)


if __name__ == "__main__":
    main()

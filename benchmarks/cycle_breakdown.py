# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Where a speculative cycle's time goes, on the default target (SmolLM2-135M-Instruct, fp32, CPU).

Every part is timed by wrapping the call that does it, during real `generate(..., assistant_model=drafter)` runs:

- verification: the target's forwards (one per cycle, B tokens; plus the prefill, reported apart);
- drafter: the drafter's forward (layers, norms, context projection), without the conditioning inside it;
- conditioning: `apply_rejected_trajectory` (ReTrace's W_c / W_v / gate on the retained slots);
- draft head: the draft lm head on the B-1 drafted rows (`draft_logits_dtype`, reduced vocabulary when set);
- bookkeeping: everything else in the cycle (transformers' candidate and cache handling, crops, concatenations).

Also printed: a 1-token target decoding step, and the verification forward's cost in those steps, for each B.
Usage: `python benchmarks/cycle_breakdown.py --drafter model_cards/smollm2-135m-dflash --block-sizes 8,16`
(`--compile`: the drafter under `torch.compile`; `--skinny-gemm`: target and drafter with `hf_retrace.skinny_gemm`;
`--num-assistant-tokens K --confidence-threshold T` override the drafter config's verification setting, and
`--prompt-lookup-num-tokens M` its prompt lookup, 0 for none: then every cycle is drafted).
A drafter trained with B = 16 run at B = 8 drafts the first 7 slots of its block (the time is what matters here).
"""

import argparse
import functools
import time
from collections import defaultdict

import torch
from transformers import DynamicCache

from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import load_default_target
from hf_retrace.models.draft_head_retrace import DraftLMHead
from hf_retrace.skinny_gemm import DEFAULT_TUNE_ROWS, enable_skinny_gemm


PROMPTS = [
    "Write a Python function that returns the sum of squares of a list.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
]


class Timers:
    def __init__(self):
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def wrap(self, obj, name: str, label: str):
        original = getattr(obj, name)

        @functools.wraps(original)  # keeps the signature transformers inspects
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(obj, name, timed)


def run(target, tokenizer, drafter, max_new_tokens: int) -> dict:
    timers = Timers()
    in_target = []  # non-empty while the target's own forward runs
    original_forward = target.forward

    @functools.wraps(original_forward)  # generate reads the forward's signature (position_ids, ...)
    def target_forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        start = time.perf_counter()
        in_target.append(True)
        try:
            out = original_forward(*args, **kwargs)
        finally:
            in_target.pop()
        label = "verification" if ids is not None and ids.shape[1] <= drafter.config.block_size else "prefill"
        timers.seconds[label] += time.perf_counter() - start
        timers.calls[label] += 1
        return out

    target.forward = target_forward
    own = {name: drafter.__dict__.get(name) for name in ("forward", "apply_rejected_trajectory")}  # e.g. compiled
    timers.wrap(drafter, "forward", "drafter (incl. conditioning)")
    timers.wrap(drafter, "apply_rejected_trajectory", "conditioning")
    head_original = DraftLMHead.forward
    lm_head = target.get_output_embeddings()
    lm_original = lm_head.forward

    @functools.wraps(lm_original)
    def lm_head_forward(*args, **kwargs):  # the target's own head scores drafts when draft_logits_dtype is unset
        start = time.perf_counter()
        try:
            return lm_original(*args, **kwargs)
        finally:
            if not in_target:  # outside the target's own forward: the generator scoring drafts
                timers.seconds["draft head"] += time.perf_counter() - start

    lm_head.forward = lm_head_forward

    def head_forward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return head_original(self, *args, **kwargs)
        finally:
            timers.seconds["draft head"] += time.perf_counter() - start

    DraftLMHead.forward = head_forward
    total, cycles, lookups, datastore = 0.0, 0, 0, 0
    try:
        for prompt in PROMPTS:
            inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)  # fmt: skip
            start = time.perf_counter()
            target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
            total += time.perf_counter() - start
            cycles += len(drafter.last_generation_stats.acceptance_lengths)
            lookups += drafter.last_generation_stats.num_lookup_cycles
            datastore += drafter.last_generation_stats.num_datastore_cycles
    finally:
        target.forward = original_forward
        DraftLMHead.forward = head_original
        for name, method in own.items():
            if method is None:
                delattr(drafter, name)
            else:
                setattr(drafter, name, method)
        lm_head.forward = lm_original
    s = timers.seconds
    parts = {
        "verification": s["verification"],
        "drafter": s["drafter (incl. conditioning)"] - s["conditioning"],
        "conditioning": s["conditioning"],
        "draft head": s["draft head"],
    }
    parts["bookkeeping"] = total - s["prefill"] - sum(parts.values())
    per_cycle_ms = {k: 1000 * v / cycles for k, v in parts.items()}
    return {"cycles": cycles, "lookups": lookups, "datastore": datastore, "per_cycle_ms": per_cycle_ms}


@torch.no_grad()
def decode_step_ms(target, length: int, repeats: int = 10) -> float:
    ids = torch.randint(100, 1000, (1, 200))
    cache = DynamicCache(config=target.config)
    target(ids, cache=cache, use_cache=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target(torch.randint(100, 1000, (1, length)), cache=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-length)  # back to the 200-token prefix
    return 1000 * sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="model_cards/smollm2-135m-dflash")
    parser.add_argument("--block-sizes", default="8,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--draft-logits-dtype", default=None, help="e.g. bfloat16 (slow on CPUs without bf16 units)")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="time a reduced draft vocabulary: the K most frequent tokens of --pool")  # fmt: skip
    parser.add_argument("--pool", default="data/smollm2-pool")
    parser.add_argument(
        "--compile", action="store_true",
        help="torch.compile the drafter's forward (dynamic shapes; two warm-up generations first)",
    )  # fmt: skip
    parser.add_argument("--skinny-gemm", action="store_true", help="few-row linears as a transposed GEMM")
    parser.add_argument("--num-assistant-tokens", type=int, default=None, help="verify only the first k drafts")
    parser.add_argument("--confidence-threshold", type=float, default=None, help="stop drafts below this probability")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=None, help="prompt lookup in front (0: off)")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_default_target(torch.float32)
    if args.skinny_gemm:
        enable_skinny_gemm(target, tune_rows=DEFAULT_TUNE_ROWS)
    one = decode_step_ms(target, 1)
    print(f"target 1-token decoding step: {one:.1f} ms; draft head dtype {args.draft_logits_dtype or 'float32'}")
    for block_size in map(int, args.block_sizes.split(",")):
        drafter = ReTraceDrafterModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
        drafter.config.block_size = block_size
        if drafter.anchor_broadcast is not None:
            drafter.anchor_broadcast.block_size = block_size
        drafter.generation_config.draft_logits_dtype = args.draft_logits_dtype
        if args.num_assistant_tokens is not None:  # else the drafter config's
            drafter.generation_config.num_assistant_tokens = args.num_assistant_tokens
        if args.confidence_threshold is not None:
            drafter.generation_config.assistant_confidence_threshold = args.confidence_threshold
        if args.prompt_lookup_num_tokens is not None:
            drafter.generation_config.prompt_lookup_num_tokens = args.prompt_lookup_num_tokens or None
        if args.skinny_gemm:
            enable_skinny_gemm(drafter, tune_rows=DEFAULT_TUNE_ROWS)
        config = drafter.generation_config
        if config.datastore_num_tokens:  # the datastore index is built once per drafter, before any timing
            sizes = (config.datastore_max_ngram_size, config.datastore_min_ngram_size)
            drafter.datastore(config.datastore_num_tokens, *sizes)
        if args.draft_vocab_size:
            from hf_retrace.trainer.draft_vocab import most_frequent_tokens
            from hf_retrace.data.pool import read_token_shards

            rows = read_token_shards(args.pool)  # ranked as the trainer ranks them (responses, prompts, ids)
            drafter.set_draft_vocab(most_frequent_tokens(
                [r["response_ids"] for r in rows], args.draft_vocab_size, prompts=[r["prompt_ids"] for r in rows],
                vocab_size=drafter.config.vocab_size,
            ))  # fmt: skip
        if args.compile:  # an instance attribute: `run` wraps it like the plain forward
            drafter.forward = torch.compile(drafter.forward, dynamic=True)
            start = time.perf_counter()
            run(target, tokenizer, drafter, args.max_new_tokens)  # compiles, and recompiles on new shapes
            print(f"torch.compile warm-up generations: {time.perf_counter() - start:.0f} s")
        k = drafter.generation_config.num_assistant_tokens
        width = min(block_size, (k or block_size) + 1)  # a full cycle's tokens
        verify = decode_step_ms(target, width)
        result = run(target, tokenizer, drafter, args.max_new_tokens)
        parts = result["per_cycle_ms"]
        overhead = sum(v for k, v in parts.items() if k != "verification")
        print(f"\ndraft vocabulary: {drafter.config.draft_vocab_size or 'full'}")
        print(f"B = {block_size}: {width}-token forward {verify:.1f} ms = {verify / one:.2f} decoding steps; "
              f"{result['cycles']} cycles, {result['lookups']} of them prompt lookup, {result['datastore']} datastore "
              "lookup")  # fmt: skip
        for name, ms in parts.items():
            print(f"  {name:<14}{ms:>8.1f} ms/cycle")
        print(f"  non-verification work = {overhead / parts['verification']:.0%} of the verification forward")


if __name__ == "__main__":
    main()

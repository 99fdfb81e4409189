"""Cost of scoring drafts: the 15-row draft lm head in fp32 vs a bf16 copy (`draft_logits_dtype`), alone and inside
a full speculative cycle on the default target (SmolLM2-135M-Instruct, fp32, so output is checked token for token).

    python benchmarks/draft_logits_cost.py [--drafter model_cards/smollm2-135m-retrace] [--num-threads 1]

Prints (1) medians of the head alone on `last_hidden_state[:, 1:]` of a `[1, B, H]` state (what the in-tree generator
passes): the fp32 target head, a plain bf16 cast of that 3-D slice, and `DraftLMHead` (bf16, flattened to 2-D); for a
drafter with a reduced draft vocabulary, also its fp32 head on the `k` rows verified, as `linear` and as
`DraftLMHead`'s GEMM on the transposed weight; (2) ms per verification cycle, tau and a lossless check for
`draft_logits_dtype` unset vs `"bfloat16"`, on one prompt, alternating the two settings `--repeats` times.
"""

import argparse
import statistics
import time

import torch

from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import load_default_target
from hf_retrace.models.draft_head_retrace import draft_lm_head


PROMPT = "Write a Python function that returns the sum of squares of a list."


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def head_costs(target, rows: int) -> dict[str, float]:
    head = target.get_output_embeddings()
    bf16 = draft_lm_head(head, "bfloat16")
    states = torch.randn(1, rows + 1, head.weight.shape[1])[:, 1:]  # the generator's slice: 3-D strides kept
    return {
        "fp32 target head, 3-D slice": median_ms(lambda: head(states)),
        "bf16 copy, 3-D slice": median_ms(lambda: torch.nn.functional.linear(states.bfloat16(), bf16.weight)),
        "bf16 copy, 2-D (DraftLMHead)": median_ms(lambda: bf16(states)),
    }


@torch.no_grad()
def reduced_head_costs(target, drafter) -> dict[str, float]:
    """The fp32 head of a reduced draft vocabulary on the `k` rows the generator scores (`num_assistant_tokens`):
    `linear` on the [K, H] slice against `DraftLMHead`'s GEMM on the contiguous [H, K] transpose."""
    head, ids = target.get_output_embeddings(), drafter.draft_vocab_ids
    k = drafter.generation_config.num_assistant_tokens or drafter.config.block_size - 1
    draft_head = draft_lm_head(head, "float32", ids)
    states = torch.randn(1, k + 1, head.weight.shape[1])[:, 1:]
    flat, rows = states.reshape(k, -1), head.weight.detach()[ids]
    return {
        f"fp32 {len(ids)}-row slice, {k} rows, linear": median_ms(lambda: torch.nn.functional.linear(flat, rows)),
        f"fp32 {len(ids)}-row DraftLMHead, {k} rows": median_ms(lambda: draft_head(states)),
    }


def cycle_costs(target, tokenizer, drafter, max_new_tokens: int, repeats: int) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    reference = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    for _ in range(repeats):
        for dtype in (None, "bfloat16"):
            drafter.generation_config.draft_logits_dtype = dtype
            target.generate(**inputs, assistant_model=drafter, max_new_tokens=8, do_sample=False)  # warmup
            start = time.perf_counter()
            out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
            elapsed = time.perf_counter() - start
            stats = drafter.last_generation_stats
            print(f"draft_logits_dtype={dtype!s:9} {1000 * elapsed / len(stats.acceptance_lengths):6.1f} ms/cycle "
                  f"tau {stats.tau:.3f} lossless {out.tolist() == reference.tolist()}")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="model_cards/smollm2-135m-retrace")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_default_target(torch.float32)
    drafter = ReTraceDrafterModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    costs = head_costs(target, drafter.config.block_size - 1)
    if drafter.draft_vocab_ids is not None:
        costs |= reduced_head_costs(target, drafter)
    for name, ms in costs.items():
        print(f"{name:44} {ms:6.1f} ms")
    cycle_costs(target, tokenizer, drafter, args.max_new_tokens, args.repeats)


if __name__ == "__main__":
    main()

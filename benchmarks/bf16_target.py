# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""A bf16 target against the fp32 one: target-only greedy speed, and how often and how closely the outputs diverge.

For each held-out prompt, interleaved, the same target runs greedy decoding in fp32 and in bf16 (its weights cast).
Printed per prompt set: tokens/s of each, how many prompts diverge from the fp32 tokens and where first, and at each
first divergence the logit gap `z[a] - z[b]` between the fp32 token `a` and the bf16 token `b`, under the fp32 logits
and under the bf16 logits (a small gap: a near tie that bf16 rounding flipped). The lossless check of the package stays
in fp32; this measures what a bf16 target would trade.

Usage: `python benchmarks/bf16_target.py --prompt-sets gsm_symbolic:8,humaneval:8,open_ended:8 --max-new-tokens 64`
"""

import argparse
import copy
import time

import torch

from hf_retrace.data.assets import load_default_target
from hf_retrace.bench.run import encode_prompt_set, parse_prompt_sets
from hf_retrace.data.prompts import EVAL_SEED_OFFSET


@torch.inference_mode()
def greedy(model, input_ids: torch.LongTensor, max_new_tokens: int) -> tuple[torch.LongTensor, torch.Tensor, float]:
    """`(new_tokens [n], logits [n, V] in fp32, seconds)` of target-only greedy decoding."""
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    seconds = time.perf_counter() - start
    new = out.sequences[0, input_ids.shape[1] :]
    return new, torch.stack(out.logits, dim=1)[0].float(), seconds


def first_divergence(a: torch.LongTensor, b: torch.LongTensor) -> int | None:
    """Index of the first differing token of two greedy outputs (`None` if one is a prefix of the other)."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-sets", default="gsm_symbolic:8,humaneval:8,open_ended:8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    fp32, tokenizer = load_default_target(torch.float32)
    models = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16)}
    print(f"{'set':<14}{'fp32 tok/s':>11}{'bf16 tok/s':>11}{'diverged':>10}  first divergence at (gap fp32 / bf16)")
    for name, count in parse_prompt_sets(args.prompt_sets):
        tokens, seconds, divergences = {k: 0 for k in models}, {k: 0.0 for k in models}, []
        prompts = encode_prompt_set(name, count, tokenizer, EVAL_SEED_OFFSET)
        for input_ids in prompts:
            outs = {}
            for key, model in models.items():  # interleaved: both dtypes see the same machine state
                outs[key] = greedy(model, input_ids, args.max_new_tokens)
                tokens[key] += len(outs[key][0])
                seconds[key] += outs[key][2]
            (a, logits_a, _), (b, logits_b, _) = outs["fp32"], outs["bf16"]
            i = first_divergence(a, b)
            if i is not None:  # both saw the same prefix up to i, so their logits at i are comparable
                gap32 = float(logits_a[i, a[i]] - logits_a[i, b[i]])
                gap16 = float(logits_b[i, a[i]] - logits_b[i, b[i]])
                divergences.append(f"{i} ({gap32:.3f} / {gap16:.3f})")
        speed = {k: tokens[k] / seconds[k] for k in models}
        print(f"{name:<14}{speed['fp32']:>11.2f}{speed['bf16']:>11.2f}{len(divergences):>5}/{len(prompts):<4}  "
              + ", ".join(divergences))  # fmt: skip


if __name__ == "__main__":
    main()

"""Cost of ReTrace conditioning per decoding cycle, on the default target (SmolLM2-135M-Instruct), CPU or GPU.

One fresh drafter sized for the target, `ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=B)`,
with non-zero random ReTrace weights (W_v is zero at init; randomising it makes the conditioning change the drafts),
is run greedily with `retrace_mode="off"` and `"corrected"` (same weights), interleaved with target-only decoding over
a few evaluation prompts, with the `hf-retrace bench` machinery (same timers, same lossless check). Conditioning time
= reading the verification features + building the rejected trajectory + projecting its target features + the
drafter's `retrace` submodule. Target: conditioning < 1% of the cycle (paper: 0.40% on Qwen3-4B / A800).
fp32 by default (exact lossless check); with `--dtype bf16` near-tie logits can flip (see `hf_retrace.bench.run`).

    python benchmarks/conditioning_cost.py [--block-size 16] [--num-prompts 3] [--max-new-tokens 64] [--repeats 2]

A random drafter is rejected almost always (tau ~ 1), so nearly every round is conditioned with L = B - 2 retained
slots: the worst case for the conditioning share.
"""

import argparse
import sys
import tempfile

import torch

from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import load_default_target
from hf_retrace.bench.methods import Method, MethodSpec
from hf_retrace.bench.run import DTYPES, encode_prompt_set, run_interleaved
from hf_retrace.bench.report import add_logit_gaps, check_lossless, summarize
from hf_retrace.data.prompts import EVAL_SEED_OFFSET


def make_drafter(target, block_size: int, seed: int) -> ReTraceDrafterModel:
    torch.manual_seed(seed)
    drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=block_size)
    with torch.no_grad():
        drafter.retrace.value_proj.weight.normal_(0.0, drafter.config.initializer_range)
    return drafter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (interleaved each time)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads (1: no oversubscription)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    target, tokenizer = load_default_target(DTYPES[args.dtype])
    target = target.to(device)
    prompts = encode_prompt_set("gsm_symbolic", args.num_prompts, tokenizer, EVAL_SEED_OFFSET)
    with tempfile.TemporaryDirectory() as folder:
        make_drafter(target, args.block_size, args.seed).save_pretrained(folder)
        specs = [MethodSpec("ar", "ar"), MethodSpec("off", "drafter", folder, "off"),
                 MethodSpec("corrected", "drafter", folder, "corrected")]  # fmt: skip
        methods = [Method(spec, DTYPES[args.dtype], target.device) for spec in specs]
    prompt_sets = [(f"gsm_symbolic/pass{r}", prompts) for r in range(args.repeats)]
    generations = run_interleaved(
        target, methods, prompt_sets, {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    )
    failures = check_lossless(generations)
    add_logit_gaps(target, prompt_sets, generations, failures)
    rows = [row for row in summarize(generations, methods, failures, greedy=True) if row["prompt_set"] == "pooled"]

    print(
        f"\nReTrace conditioning cost: SmolLM2-135M-Instruct target ({args.dtype}, {device}, "
        f"{torch.get_num_threads()} threads), 1-layer drafter, block {args.block_size}, {args.num_prompts} "
        f"gsm_symbolic prompts x {args.repeats} passes, greedy, max_new_tokens {args.max_new_tokens}; "
        "tau pooled over cycles."
    )
    print(f"{'mode':<10} {'tau':>6} {'cycles':>7} {'cond. rounds':>12} {'ms/cycle':>9} {'cond. ms/cycle':>15} "
          f"{'cond. share':>12} {'tokens/s':>9} {'lossless':>8}")  # fmt: skip
    for r in rows:
        is_drafter = r["retrace_mode"] is not None
        print(
            f"{r['method']:<10} {r['tau']:>6.3f} {r['num_cycles']:>7} {r['num_conditioned_rounds']:>12} "
            f"{r['cycle_ms']:>9.2f} {r['conditioning_ms_per_cycle'] if is_drafter else float('nan'):>15.4f} "
            f"{100 * r['conditioning_share'] if is_drafter else float('nan'):>11.3f}% {r['tokens_per_s']:>9.2f} "
            f"{'yes' if r['lossless'] else 'NO':>8}"
        )
    off, corrected = (next(r for r in rows if r["method"] == name) for name in ("off", "corrected"))
    share = corrected["conditioning_share"]
    print(f"\ncycle time corrected - off: {corrected['cycle_ms'] - off['cycle_ms']:+.2f} ms "
          f"({100 * (corrected['cycle_ms'] / off['cycle_ms'] - 1):+.2f}%; wall-clock difference, noisy)")  # fmt: skip
    verdict = "PASS" if share < 0.01 else "FAIL"
    print(f"conditioning share of the corrected cycle: {100 * share:.3f}% -> target < 1%: {verdict}")
    for failure in failures:
        print(f"LOSSLESS CHECK FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

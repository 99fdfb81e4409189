"""What a target forward of `R` rows costs after a long cached context, by kernel: the cost of verifying `R - 1`
drafts in transformers, batch 1.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/verification_rows.py [--context 1000] [--rows 1,2,3,4,6,8,12,16]

The default target (SmolLM2-135M-Instruct, fp32, 2 threads) after `--context` tokens of an unseen codeio prompt;
each row count is timed `--repeats` times (median), the cache cropped back after each forward. Three settings in
one run, each in a fresh process so the attention switch (an environment variable) is its own: torch's kernels;
the tuned few-row kernels (`hf_retrace.skinny_gemm`); those plus masked GQA attention (`hf_retrace.cpu_attention`).
Prints ms per forward and the tuned kernel per row count (`0`: torch's linear, `w`: transposed at width `w`, `-P`:
MKL-packed for `P` rows), then what the tuning weighs: ms of one pass over the target's linears per kernel and rows
(best of 3; the packed kernel at its pack widths only).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


SETTINGS = ("stock", "skinny", "skinny+gqa")


def measure(setting: str, context: int, rows: list[int], repeats: int) -> dict:
    import torch

    from hf_retrace.bench.run import load_target
    from hf_retrace.cpu_attention import enable_masked_gqa_sdpa
    from hf_retrace.data.assets import ensure_default_target
    from hf_retrace.data.prompts import EVAL_SEED_OFFSET, load_prompts
    from hf_retrace.skinny_gemm import (
        DEFAULT_TUNE_ROWS, PACK_WIDTHS, enable_skinny_gemm_where_it_pays, packed_cost, packing_available, width_costs,
    )  # fmt: skip

    torch.set_num_threads(2)
    target, tokenizer = load_target(str(ensure_default_target()), torch.float32, "cpu")
    widths, passes = None, None
    if setting == "stock":  # the tuning's own timings, before any routing
        weights = [m.weight for m in target.modules() if type(m) is torch.nn.Linear]
        passes = {"linear": width_costs(weights, 16, 3, stock=True), "transposed": width_costs(weights, 16, 3)}
        if packing_available():
            passes["packed"] = {w: packed_cost(weights, w, 3) for w in PACK_WIDTHS}
    else:
        enable_skinny_gemm_where_it_pays(target, DEFAULT_TUNE_ROWS, "target")
        widths = next(m.forward.args[2] for m in target.modules() if "forward" in m.__dict__)
    if setting == "skinny+gqa":
        enable_masked_gqa_sdpa(target, "target")
    ids = []
    for messages in load_prompts("codeio", 8, EVAL_SEED_OFFSET):  # the first prompt long enough
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        if len(ids) >= context:
            break
    prompt = torch.tensor([ids[:context]])
    result = {}
    with torch.no_grad():
        cache = target(prompt, use_cache=True).past_key_values
        for r in rows:
            seconds = []
            for i in range(repeats + 2):  # two untimed warm-ups a count
                x = torch.randint(1000, 2000, (1, r))
                start = time.perf_counter()
                target(x, cache=cache, use_cache=True)
                if i >= 2:
                    seconds.append(time.perf_counter() - start)
                cache.crop(-r)
            result[r] = 1e3 * statistics.median(seconds)
    return {"ms": result, "widths": widths, "passes": passes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)  # one setting, in a child process
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.setting:
        print(json.dumps(measure(args.setting, args.context, rows, args.repeats)))
        return
    results = {}
    for setting in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_SDPA_FORCE_GQA"}
        out = subprocess.run([sys.executable, __file__, "--setting", setting, "--context", str(args.context),
                              "--rows", args.rows, "--repeats", str(args.repeats)],
                             capture_output=True, text=True, env=env, check=True)  # fmt: skip
        results[setting] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"target forward after {args.context} cached tokens, ms (median of {args.repeats})\n")
    print("| rows | " + " | ".join(SETTINGS) + " |\n|---:|" + "---:|" * len(SETTINGS))
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{results[s]['ms'][str(r)]:.1f}" for s in SETTINGS) + " |")
    print(f"\ntuned kernel per row count 0..{len(results['skinny']['widths']) - 1}: {results['skinny']['widths']}")
    passes = results["stock"]["passes"]
    packed = {int(w): s for w, s in passes.get("packed", {}).items()}
    print("\none pass over the target's linears, ms (best of 3)\n\n| rows | linear | transposed | packed for rows |")
    print("|---:|---:|---:|---:|")
    for r in range(1, len(passes["linear"])):
        cell = f"{packed[r] * 1e3:.1f}" if r in packed else ""
        print(f"| {r} | {passes['linear'][r] * 1e3:.1f} | {passes['transposed'][r] * 1e3:.1f} | {cell} |")
    for w in sorted(w for w in packed if w >= len(passes["linear"])):
        print(f"| {w} | | | {packed[w] * 1e3:.1f} |")


if __name__ == "__main__":
    main()

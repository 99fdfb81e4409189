"""Speculative generation on the default small target (SmolLM2-135M-Instruct, offline) with the best drafter the
repo ships: prints the text, tau (tokens committed per verification cycle) and tokens/s vs target-only greedy.

    python examples/01_generate.py [--drafter FOLDER] [--prompt "..."] [--max-new-tokens 128] [--repeats 3]
                                   [--no-skinny-gemm]

The best shipped drafter is the DFlash one (`model_cards/smollm2-135m-dflash`, verifying 3 drafts a cycle); the ReTrace
drafter (`--drafter model_cards/smollm2-135m-retrace`) is within noise of its DFlash control and slower here. Target
alone and speculative runs alternate `--repeats` times and the medians are compared, so a slow moment of a shared
CPU does not land on one side only. Both run the same target with `hf_retrace.skinny_gemm` enabled (fp32 linears
over a few rows as a transposed GEMM: on a CPU, verifying 4 tokens then costs about one decoding step instead of
1.6; `--no-skinny-gemm` runs torch's stock linears on both sides).
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

import hf_retrace  # noqa: F401  (makes `assistant_model=drafter` pick ReTrace)
from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import load_default_target
from hf_retrace.cpu_attention import enable_masked_gqa_sdpa
from hf_retrace.skinny_gemm import enable_skinny_gemm_where_it_pays


SHIPPED = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-dflash"


def timed_generate(target, inputs, **kwargs):
    start = time.perf_counter()
    out = target.generate(**inputs, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=str(SHIPPED), help="drafter folder; a fresh one if it does not exist")
    question = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell in total?"
    parser.add_argument("--prompt", default=question)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs of each; medians compared")
    parser.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=True,
                        help="few-row fp32 linears on the kernel tuned fastest per row count, and masked GQA "
                        "attention for verification forwards, for target and drafter alike (the default of "
                        "hf-retrace bench too)")
    args = parser.parse_args()

    torch.manual_seed(0)
    # float32: in bf16 the B-token verification forward and the 1-token target-only forward round differently, so
    # near-tie argmaxes can flip and "identical to target-only greedy" would not hold token for token.
    target, tokenizer = load_default_target(torch.float32)
    if Path(args.drafter, "config.json").is_file():
        drafter, source = ReTraceDrafterModel.from_pretrained(args.drafter, dtype=torch.float32).eval(), args.drafter
    else:  # no trained drafter shipped yet: a fresh one (output is the target's either way, just slower)
        drafter, source = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=8).eval(), "fresh"
    if args.skinny_gemm:  # the same patched target serves both sides of the comparison
        enable_skinny_gemm_where_it_pays(target, name="target")
        enable_skinny_gemm_where_it_pays(drafter, name="drafter")
        enable_masked_gqa_sdpa(target, name="target")  # verification forwards: no copies of the K/V heads
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    timed_generate(target, inputs, max_new_tokens=8)  # warmup
    timed_generate(target, inputs, max_new_tokens=8, assistant_model=drafter)  # and the drafter's datastore index

    ar_times, spec_times = [], []
    for _ in range(args.repeats):
        ar, seconds = timed_generate(target, inputs, max_new_tokens=args.max_new_tokens)
        ar_times.append(seconds)
        spec, seconds = timed_generate(target, inputs, max_new_tokens=args.max_new_tokens, assistant_model=drafter)
        spec_times.append(seconds)
    ar_s, spec_s = statistics.median(ar_times), statistics.median(spec_times)
    if spec.tolist() != ar.tolist():
        raise SystemExit("LOSSLESS CHECK FAILED: speculative output differs from target-only greedy output")
    new = spec.shape[1] - inputs["input_ids"].shape[1]
    stats = drafter.last_generation_stats
    print(tokenizer.decode(spec[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    config = drafter.config
    print(f"\ndrafter: {source} (skinny_gemm={args.skinny_gemm}, retrace_mode={config.retrace_mode}, "
          f"block_size={config.block_size}, "
          f"num_assistant_tokens={drafter.generation_config.num_assistant_tokens}, "
          f"assistant_confidence_threshold={drafter.generation_config.assistant_confidence_threshold}, "
          f"prompt_lookup_num_tokens={drafter.generation_config.prompt_lookup_num_tokens}, "
          f"datastore_num_tokens={drafter.generation_config.datastore_num_tokens})")
    kinds = [f"{stats.num_lookup_cycles} prompt lookup"] * bool(stats.num_lookup_cycles)
    kinds += [f"{stats.num_datastore_cycles} datastore lookup"] * bool(stats.num_datastore_cycles)
    lookups = f", {' and '.join(kinds)}" if kinds else ""
    print(f"tau (pooled over {len(stats.acceptance_lengths)} cycles{lookups}): {stats.tau:.2f}")
    kind = "ReTrace" if config.retrace_mode != "off" else "DFlash"
    print(f"target-only greedy: {new / ar_s:.1f} tok/s | {kind} speculative: {new / spec_s:.1f} tok/s "
          f"| speedup {ar_s / spec_s:.2f}x (medians of {args.repeats}) | lossless: identical {new} tokens")


if __name__ == "__main__":
    main()

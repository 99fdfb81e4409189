"""Target forward time for L new tokens on a cached prefix (L = 1, 2, 3, 4, 6, 8, 12, 16): the cost of verifying a
block of L tokens vs one decoding step, which is what block size and the verified length trade against. Prints the
median of several runs, and how much of it is the lm head alone (`[L, hidden] x [hidden, vocab]`, the largest
matrix, read in full by every forward): on a CPU, a BLAS may run a product of a few rows as one matrix-vector
product per row, so 2 or 3 rows cost 2 or 3 times one row until a wider kernel takes over.

    python benchmarks/verification_cost.py [--prefix 200] [--repeats 7] [--dtype fp32] [--skinny-gemm]

`--skinny-gemm` also times every L with `hf_retrace.skinny_gemm` enabled (fp32 only; widths tuned once up to
`--tune-rows`, as the bench and the main command do; `--tune-rows 0` for the untuned kernel), alternating with the
stock linears so that both columns see the same machine load, and prints the two side by side.
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_retrace.data.assets import load_default_target
from hf_retrace.skinny_gemm import DEFAULT_TUNE_ROWS, disable_skinny_gemm, enable_skinny_gemm


def forward_ms(target, prefix: torch.Tensor, num_new: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=target.config)
        target(prefix, cache=cache, use_cache=True)
        block = torch.randint(0, target.config.vocab_size, (1, num_new))
        start = time.perf_counter()
        target(block, cache=cache, use_cache=True, output_hidden_states=True)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def lm_head_ms(target, num_new: int, repeats: int) -> float:
    hidden = torch.randn(1, num_new, target.config.hidden_size, dtype=target.dtype)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.lm_head(hidden)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--skinny-gemm", action="store_true", help="also time with hf_retrace.skinny_gemm enabled")
    parser.add_argument("--tune-rows", type=int, default=DEFAULT_TUNE_ROWS, help="skinny GEMM widths tuned up to this")
    args = parser.parse_args()
    target, _ = load_default_target(torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    prefix = torch.randint(0, target.config.vocab_size, (1, args.prefix))
    with torch.no_grad():
        base = forward_ms(target, prefix, 1, args.repeats)
        base_head = lm_head_ms(target, 1, args.repeats)
        skinny_base, skinny_forwards = None, {}
        if args.skinny_gemm:  # tune the widths once; then toggle between the routed and the stock forwards
            enable_skinny_gemm(target, tune_rows=args.tune_rows)
            skinny_forwards = {m: m.forward for m in target.modules() if type(m) is torch.nn.Linear}
            disable_skinny_gemm(target)
        for num_new in (1, 2, 3, 4, 6, 8, 12, 16):
            ms, head = forward_ms(target, prefix, num_new, args.repeats), lm_head_ms(target, num_new, args.repeats)
            line = (
                f"verify {num_new:>2} tokens: {ms:7.1f} ms  ({ms / base:.2f}x one decoding step)   lm head "
                f"{head:5.1f} ms ({head / base_head:.2f}x one row)   the rest {ms - head:6.1f} ms "
                f"({(ms - head) / (base - base_head):.2f}x)"
            )
            if args.skinny_gemm:
                for module, forward in skinny_forwards.items():
                    module.forward = forward
                skinny = forward_ms(target, prefix, num_new, args.repeats)
                disable_skinny_gemm(target)
                skinny_base = skinny_base or skinny  # L = 1 comes first
                line += (f"   | skinny GEMM {skinny:7.1f} ms ({skinny / skinny_base:.2f}x its own step, "
                         f"{skinny / ms:.2f}x stock)")
            print(line, flush=True)


if __name__ == "__main__":
    main()

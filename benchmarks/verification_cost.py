"""Target forward time for L new tokens on a cached prefix (L = 1, 2, 4, 6, 8, 12, 16): the cost of verifying a block of
L tokens vs one decoding step, which is what block size trades against. Prints the median of several runs.

    python benchmarks/verification_cost.py [--prefix 200] [--repeats 7] [--dtype fp32]
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_retrace.data.assets import load_default_target


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    target, _ = load_default_target(torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    prefix = torch.randint(0, target.config.vocab_size, (1, args.prefix))
    with torch.no_grad():
        base = forward_ms(target, prefix, 1, args.repeats)
        for num_new in (1, 2, 4, 6, 8, 12, 16):
            ms = forward_ms(target, prefix, num_new, args.repeats)
            print(f"verify {num_new:>2} tokens: {ms:7.1f} ms  ({ms / base:.2f}x one decoding step)")


if __name__ == "__main__":
    main()

# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""What one pass of transposed GEMMs over the target's linears costs at every row count, and the widths
`enable_skinny_gemm(..., tune_rows=N)` pads row counts to (`hf_retrace.skinny_gemm.tune_widths`).

Usage:

```bash
python benchmarks/skinny_widths.py [--max-rows 24] [--num-threads 2] [--repeats 3]
```
"""

import argparse
import time

import torch
from torch import nn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=24)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)

    from hf_retrace.bench.run import load_target
    from hf_retrace.skinny_gemm import cheapest_widths, width_costs

    target, _ = load_target("default", torch.float32, "cpu")
    weights = [m.weight for m in target.modules() if type(m) is nn.Linear]
    start = time.perf_counter()
    cost = width_costs(weights, args.max_rows, args.repeats)
    seconds = time.perf_counter() - start
    widths = cheapest_widths(cost)  # what `enable_skinny_gemm(..., tune_rows=max_rows)` pads to
    print(f"# {len(weights)} linears, {args.num_threads} threads, best of {args.repeats}; timing took {seconds:.1f} s")
    for rows in range(1, args.max_rows + 1):
        padded = widths[rows]
        note = f"  -> padded to {padded} ({cost[padded] / cost[1]:.2f}x)" if padded != rows else ""
        print(f"rows {rows:3d}: {cost[rows] * 1e3:7.2f} ms  ({cost[rows] / cost[1]:.2f}x one row){note}")


if __name__ == "__main__":
    main()

"""Response-generation throughput of the target (tokens/s of real response tokens) across dtypes and batch sizes,
to size `training/generate_data.py` runs.

Usage:

```bash
HF_HUB_OFFLINE=1 python benchmarks/data_generation_throughput.py --dtypes float32,bfloat16 --batch-sizes 32,64 \
    --num-prompts 64 --max-new-tokens 64
```

Measured on the 2-core dev box, shared with other jobs (so only the ratio is meaningful): SmolLM2-135M, 120-token
prompts, one decode step at batch 32 took 0.57 s in float32 against 1.06 s in bfloat16, hence the float32 default of
`generate_data.py` on CPU.
"""

import argparse
import tempfile
import time

import torch

from hf_retrace.data.assets import load_default_target
from hf_retrace.data.responses import generate_responses
from hf_retrace.data.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-set", default="gsm_symbolic")
    args = parser.parse_args()
    prompts = load_prompts(args.prompt_set, num_prompts=args.num_prompts, seed=0)
    print(f"{'dtype':>9} {'batch':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for dtype in args.dtypes.split(","):
        target, tokenizer = load_default_target(getattr(torch, dtype))
        for batch_size in map(int, args.batch_sizes.split(",")):
            with tempfile.TemporaryDirectory() as output_dir:
                start = time.perf_counter()
                responses = generate_responses(
                    target, tokenizer, prompts, output_dir, max_new_tokens=args.max_new_tokens, batch_size=batch_size
                )
                seconds = time.perf_counter() - start
            tokens = sum(len(ids) for ids in responses["response_ids"])
            print(f"{dtype:>9} {batch_size:>5} {tokens:>7} {seconds:>8.1f} {tokens / seconds:>7.1f}")


if __name__ == "__main__":
    main()

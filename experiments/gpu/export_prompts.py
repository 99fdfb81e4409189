"""Writes the prompts a GPU pool run will answer (`.gpu/prompts.npz`): every training prompt the sources have that the
committed pool has not answered yet, as uint16 ids in pool-stream order. The GPU machine has none of the prompt
sources (reasoning-gym, the stdlib, the Debian corpora), so the prompts travel as ids.

    python experiments/gpu/export_prompts.py [--mix gsm_symbolic:10000,stdlib:6516,open_ended:19720]

Seeds and splits are the pool's: reasoning-gym seeds below `EVAL_SEED_OFFSET`, the `train` split of the finite sets,
so no bench prompt is among them.
"""

import argparse
from pathlib import Path

import numpy as np

from hf_retrace.data.assets import load_default_target
from hf_retrace.data.pool import pool_prompt_stream, read_token_shards
from hf_retrace.scripts.build_pool import pool_sources


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", default="gsm_symbolic:10000,stdlib:6516,open_ended:19720")
    parser.add_argument("--pool-dir", default="data/smollm2-pool", help="prompts answered here are left out")
    parser.add_argument("--max-prompt-tokens", type=int, default=448, help="the committed pool's setting")
    parser.add_argument("--output", default=".gpu/prompts.npz")
    args = parser.parse_args()
    _, tokenizer = load_default_target()
    sources = pool_sources(args.mix, 0, tokenizer, args.max_prompt_tokens)
    answered = {tuple(row["prompt_ids"]) for row in read_token_shards(args.pool_dir)}
    stream = [item for item in pool_prompt_stream(sources) if tuple(item.prompt_ids) not in answered]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.output, tokens=np.concatenate([np.asarray(i.prompt_ids, dtype=np.uint16) for i in stream]),
        lengths=np.array([len(i.prompt_ids) for i in stream], dtype=np.int64),
        source=np.array([i.source for i in stream]),
    )  # fmt: skip
    size = Path(args.output).stat().st_size / 2**20
    print(f"{len(stream)} prompts ({len(answered)} already in {args.pool_dir} left out) -> {args.output}, {size:.1f} MiB")


if __name__ == "__main__":
    main()

# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""What a datastore lookup costs: the index build of a drafter's datastore, then `NgramDatastore.candidates` timed at
every 4th position of the target's greedy continuations cached by `benchmarks/replay_tau.py --continuations`.

    python benchmarks/datastore_lookup.py --drafter model_cards/smollm2-135m-dflash \
        --continuations runs/replay/continuations.json
"""

import argparse
import json
import time
from pathlib import Path

import torch

from hf_retrace import ReTraceDrafterModel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="a drafter folder with a datastore")
    parser.add_argument("--continuations", required=True, help="JSON cache written by replay_tau.py --continuations")
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    drafter = ReTraceDrafterModel.from_pretrained(args.drafter)
    config = drafter.generation_config
    if config.datastore_num_tokens is None:
        parser.error(f"{args.drafter} has no datastore lookup (datastore_num_tokens is null): `hf-retrace datastore`")
    start = time.perf_counter()
    sizes = (config.datastore_max_ngram_size, config.datastore_min_ngram_size)
    index = drafter.datastore(config.datastore_num_tokens, *sizes)
    print(f"index of {drafter.datastore_size} tokens built in {time.perf_counter() - start:.2f} s")
    sequences = json.loads(Path(args.continuations).read_text())["sequences"]
    contexts = [torch.tensor(s[: p + 1]) for s in sequences for p in range(len(s) - 64, len(s) - 1, 4)]
    start = time.perf_counter()
    hits = sum(index.candidates(context) is not None for context in contexts)
    per_lookup = (time.perf_counter() - start) / len(contexts)
    print(f"{len(contexts)} lookups ({hits} found a match): {per_lookup * 1e3:.3f} ms each")


if __name__ == "__main__":
    main()

# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Builds the drafter's training pool with a batch kept full: token shards (small, committable) and the target's
features (big, rebuildable), resumably. `hf_retrace.data.pool` documents the formats.

```bash
# the SmolLM2 pool (~1M response tokens, fp32 greedy); rerun the same command to resume
hf-retrace build-pool --pool-dir data/smollm2-pool --feature-dir data_cache/smollm2-features
# on a fresh machine with the committed token shards: rebuild only the features (and the target's greedy ids, for
# training with completion_only_loss=False)
hf-retrace build-pool --pool-dir data/smollm2-pool --feature-dir data_cache/smollm2-features \\
    --features-only --target-ids
```

Prompt seeds: reasoning-gym sets use seeds `--seed ..` (below `EVAL_SEED_OFFSET`); `stdlib` and `open_ended` use their
`train` split, whose items never appear in the `eval` split that the bench reads.
"""

import argparse
import logging

import torch

from ..data.pool import build_pool, cache_pool_features, cache_target_ids, pool_prompt_stream
from ..data.prompts import SPLIT_SETS
from ..data.responses import _prompt_ids
from ..cli import UsageError, check_exists, exits_on_usage_error
from .generate_data import check_args, load_target, parse_mix, select_prompts


# no codeio: reasoning-gym crashes on some of its seeds (an int64 in json.dumps)
DEFAULT_MIX = "gsm_symbolic:3200,stdlib:2300,open_ended:3000"


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a path")
    parser.add_argument("--mix", default=DEFAULT_MIX, help="comma-separated name:num_prompts")
    parser.add_argument("--pool-dir", default="data/smollm2-pool", help="token shards (commit these)")
    parser.add_argument("--feature-dir", default="data_cache/smollm2-features", help="feature shards (big)")
    parser.add_argument("--layer-ids", default="1,14,27", help="target layers to cache (a superset of the drafters')")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=64, help="decoding slots kept full")
    parser.add_argument("--shard-rows", type=int, default=128, help="rows per checkpoint shard")
    parser.add_argument("--max-response-tokens", type=int, default=None, help="stop once the pool holds this many")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop taking new prompts after this long")
    parser.add_argument("--seed", type=int, default=0, help="first prompt seed of the reasoning-gym sets")
    parser.add_argument("--features-only", action="store_true", help="only compute missing feature shards")
    parser.add_argument("--no-features", action="store_true", help="tokens only (features later, --features-only)")
    parser.add_argument(
        "--target-ids", action="store_true",
        help="then add the target's greedy ids to every feature shard lacking them (for completion_only_loss=False)",
    )  # fmt: skip
    parser.add_argument("--num-threads", type=int, default=None)
    return parser


def main(args: argparse.Namespace) -> None:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target(args.target, torch.float32)  # fp32: the bench's target, and faster on CPU
    layer_ids = [int(i) for i in args.layer_ids.split(",")]
    if args.features_only:
        cache_pool_features(target, args.pool_dir, args.feature_dir, layer_ids=layer_ids, target_name=args.target)
    else:
        _generate(args, target, tokenizer, layer_ids)
    if args.target_ids:
        cache_target_ids(target, args.feature_dir)


def pool_sources(mix: str, seed: int, tokenizer, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
    """`{source: prompt ids}` of a `--mix`: reasoning-gym sets from `seed`, the finite sets' `train` split (what
    [`pool_prompt_stream`] interleaves)."""
    sources = {}
    for name, count in parse_mix(mix):
        split = "train" if name in SPLIT_SETS else None
        prompts = select_prompts(name, count, seed, tokenizer, max_prompt_tokens, split=split)
        sources[name] = [_prompt_ids(tokenizer, p) for p in prompts]
    return sources


def stop_and_pad_ids(target, tokenizer) -> tuple[set[int], int]:
    """(end-of-response ids, pad id) of a pool's generation: the tokenizer's and generation config's EOS tokens, and
    the pad token (EOS when there is none)."""
    eos = target.generation_config.eos_token_id
    eos = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return eos, tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def _generate(args: argparse.Namespace, target, tokenizer, layer_ids: list[int]) -> None:
    sources = pool_sources(args.mix, args.seed, tokenizer, args.max_prompt_tokens)
    eos, pad = stop_and_pad_ids(target, tokenizer)
    total = build_pool(
        target, pool_prompt_stream(sources), args.pool_dir, None if args.no_features else args.feature_dir,
        eos_token_ids=eos, layer_ids=layer_ids, target_name=args.target, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, shard_rows=args.shard_rows, max_response_tokens=args.max_response_tokens,
        max_seconds=args.max_seconds, pad_token_id=pad,
    )  # fmt: skip
    logging.getLogger("build_pool").warning(f"done: {total} response tokens in {args.pool_dir}")


def check_pool_args(args: argparse.Namespace) -> None:
    """[`UsageError`] for a bad `--mix` or `--target` (as `generate-data` checks them), `--layer-ids` that are not
    comma-separated ints, or `--features-only` on a pool folder that does not exist."""
    if not args.features_only:
        check_args(args.mix, args.seed, args.target)
    elif args.target != "default":
        check_exists(args.target, "--target", "model folder")
    if not all(part.strip().isdigit() for part in args.layer_ids.split(",")):
        raise UsageError(f"--layer-ids must be comma-separated target layers such as 1,14,27, got {args.layer_ids!r}")
    if args.features_only:
        check_exists(args.pool_dir, "--pool-dir", "pool folder", repo_id_ok=False)


@exits_on_usage_error("hf-retrace build-pool")
def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace build-pool [--pool-dir ...] [--feature-dir ...] [--features-only]` (also what
    `training/build_pool.py` runs)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    args = make_parser(prog="hf-retrace build-pool").parse_args(argv)
    check_pool_args(args)
    main(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main())

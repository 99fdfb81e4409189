"""Attaches a datastore to a drafter: the target's own responses from token pools, for datastore lookup (REST) in
front of the drafter (`config.datastore_num_tokens`).

    hf-retrace datastore --drafter runs/r9-card --pool data/smollm2-pool --pool data/smollm2-pool-complete \
        --num-tokens 3 --output runs/r9-datastore

The responses are stored with the weights (`datastore_token_ids`, int32, ~4 bytes per token); the n-gram index is
built when the drafter first generates (~1 s per n-gram size per million tokens). `--pool DIR[:END]` uses the first
`END` rows of a pool folder only, so rows held out for evaluation stay out.
"""

import argparse

from .draft_vocab import parse_pool


def main(args: argparse.Namespace) -> None:
    from ..data.pool import read_token_shards
    from ..models.modeling_retrace import ReTraceDrafterModel

    responses = []
    for spec in args.pool:
        path, end = parse_pool(spec)
        rows = read_token_shards(path)
        if end is not None and not 0 < end <= len(rows):
            raise ValueError(f"--pool {spec}: END must be in [1, {len(rows)}] ({path} has {len(rows)} rows)")
        responses += [row["response_ids"] for row in rows[:end] if row["response_ids"]]
    if not responses:
        raise ValueError(f"--pool {args.pool}: no responses found (expected token shards under DIR/tokens/)")
    drafter = ReTraceDrafterModel.from_pretrained(args.drafter, dtype="auto")
    drafter.set_datastore(responses)
    config = drafter.config
    config.datastore_num_tokens = args.num_tokens
    config.datastore_max_ngram_size, config.datastore_min_ngram_size = args.max_ngram_size, args.min_ngram_size
    config.check_datastore(args.num_tokens, args.max_ngram_size, args.min_ngram_size, config.datastore_size)
    drafter.save_pretrained(args.output)
    print(f"{args.output}: datastore of {len(responses)} responses, {config.datastore_size} tokens with separators")


def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace datastore --drafter DIR --pool DIR[:END] [--pool ...] --num-tokens M --output DIR`."""
    parser = argparse.ArgumentParser(prog="hf-retrace datastore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="a drafter folder")
    parser.add_argument("--pool", action="append", required=True, help="DIR[:END], repeatable: token pools to store")
    parser.add_argument("--num-tokens", type=int, default=3, help="candidates per datastore lookup")
    parser.add_argument("--max-ngram-size", type=int, default=6, help="longest n-gram looked up (tried first)")
    parser.add_argument("--min-ngram-size", type=int, default=3, help="shortest n-gram looked up")
    parser.add_argument("--output", required=True, help="where to save the drafter with its datastore")
    main(parser.parse_args(argv))
    return 0

"""Re-ranks a trained drafter's reduced draft vocabulary on token pools, without retraining.

The draft vocabulary only selects rows of the target's frozen lm head (`ReTraceDrafterModel.set_draft_vocab`), so a
drafter can be given a vocabulary ranked on data it was not trained with (a new pool source whose identifiers the old
one misses), or a larger one, and saved: the `K` most frequent response tokens of the pools, then prompt-only tokens,
then the smallest unused ids ([`most_frequent_tokens`]).

    hf-retrace draft-vocab --drafter runs/r7 --pool data/smollm2-pool:5634 --pool data/smollm2-pool-complete \
        --size 12288 --output runs/r7-v12k

`--pool DIR[:END]` ranks on the first `END` rows of a pool folder (all rows without `:END`), so rows held out for
evaluation stay out of the ranking.
"""

import argparse

from datasets import concatenate_datasets

from ..cli import UsageError, check_exists, exits_on_usage_error


def parse_pool(spec: str) -> tuple[str, int | None]:
    """`"DIR"` or `"DIR:END"` -> (DIR, END or None)."""
    path, sep, end = spec.rpartition(":")
    if not sep or not end.isdigit():
        return spec, None
    return path, int(end)


def main(args: argparse.Namespace) -> None:
    from ..data.pool import load_pool_dataset
    from ..models.modeling_retrace import ReTraceDrafterModel
    from ..trainer.draft_vocab import coverage
    from .train import rank_draft_vocab

    parts = []
    for spec in args.pool:
        path, end = parse_pool(spec)
        rows = load_pool_dataset(path)
        if end is not None:
            if not 0 < end <= len(rows):
                raise ValueError(f"--pool {spec}: END must be in [1, {len(rows)}] ({path} has {len(rows)} rows)")
            rows = rows.select(range(end))
        parts.append(rows)
    drafter = ReTraceDrafterModel.from_pretrained(args.drafter, dtype="auto")
    ids, responses = rank_draft_vocab(concatenate_datasets(parts), args.size, drafter.config.vocab_size)
    before = "full vocabulary" if drafter.draft_vocab_ids is None else f"{drafter.config.draft_vocab_size} tokens"
    old = 1.0 if drafter.draft_vocab_ids is None else coverage(responses, drafter.draft_vocab_ids.tolist())
    drafter.set_draft_vocab(ids)
    drafter.save_pretrained(args.output)
    print(
        f"{args.output}: {args.size} tokens cover {coverage(responses, ids):.2%} of {len(responses)} pool responses "
        f"(the loaded drafter's {before}: {old:.2%})"
    )


def check_args(args: argparse.Namespace) -> None:
    """[`UsageError`] for a missing drafter or pool folder, or a size below 1."""
    check_exists(args.drafter, "--drafter", "drafter folder")
    for spec in args.pool:
        check_exists(parse_pool(spec)[0], "--pool", "pool folder", repo_id_ok=False)
    if args.size < 1:
        raise UsageError(f"--size is the number of draft vocabulary tokens and must be >= 1, got {args.size}")


@exits_on_usage_error("hf-retrace draft-vocab")
def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace draft-vocab --drafter DIR --pool DIR[:END] [--pool ...] --size K --output DIR`."""
    parser = argparse.ArgumentParser(prog="hf-retrace draft-vocab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="a drafter folder")
    parser.add_argument("--pool", action="append", required=True, help="DIR[:END], repeatable: token pools to rank on")
    parser.add_argument("--size", type=int, required=True, help="K, the draft vocabulary size")
    parser.add_argument("--output", required=True, help="where to save the drafter with its new vocabulary")
    args = parser.parse_args(argv)
    check_args(args)
    main(args)
    return 0

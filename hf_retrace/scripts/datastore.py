"""Attaches a datastore to a drafter: the target's own responses from token pools, for datastore lookup (REST) in
front of the drafter (`generation_config.datastore_num_tokens`).

    hf-retrace datastore --drafter runs/r9-card --pool data/smollm2-pool --pool data/smollm2-pool-complete \
        --num-tokens 3 --output runs/r9-datastore

The responses go to `datastore.safetensors` beside the weights (uint16 for vocabularies up to 65535 tokens, ~2 bytes
per token), the lookup settings to `generation_config.json`; `model.safetensors` and `config.json` are not rewritten
(with `--output` another folder, they are copied byte for byte). The n-gram index is built when the drafter first
generates (~1 s per n-gram size per million tokens). `--pool DIR[:END]` uses the first `END` rows of a pool folder
only, so rows held out for evaluation stay out.
"""

import argparse
import shutil
from pathlib import Path

from ..cli import UsageError, check_exists, exits_on_usage_error
from .draft_vocab import parse_pool


def read_responses(pools: list[str]) -> list[list[int]]:
    """The non-empty `response_ids` of the token pools `DIR[:END]`."""
    from ..data.pool import read_token_shards

    responses = []
    for spec in pools:
        path, end = parse_pool(spec)
        rows = read_token_shards(path)
        if end is not None and not 0 < end <= len(rows):
            raise UsageError(f"--pool {spec}: END must be in [1, {len(rows)}] ({path} has {len(rows)} rows)")
        responses += [row["response_ids"] for row in rows[:end] if row["response_ids"]]
    if not responses:
        raise UsageError(f"--pool {pools}: no responses found (expected token shards under DIR/tokens/)")
    return responses


def attach_datastore(folder, output, responses: list[list[int]], **settings) -> None:
    """Writes the drafter of `folder` with the datastore `responses` and the datastore `settings` (keys of the
    drafter's `generation_config`, e.g. `datastore_num_tokens=3`) to `output` (may be `folder`).

    Only `datastore.safetensors` and `generation_config.json` are written; the other files of `folder` are copied
    unchanged when `output` is another folder.
    """
    from ..models.modeling_retrace import ReTraceDrafterModel

    folder, output = Path(folder), Path(output)
    drafter = ReTraceDrafterModel.from_pretrained(folder, dtype="auto")
    drafter.set_datastore(responses)
    for key, value in settings.items():
        setattr(drafter.generation_config, key, value)
    drafter.decoding_settings()  # bad settings fail before anything is written
    if output.resolve() != folder.resolve():
        shutil.copytree(folder, output, dirs_exist_ok=True)
    drafter.save_pretrained_decoding_files(output)


def main(args: argparse.Namespace) -> None:
    responses = read_responses(args.pool)
    settings = dict(datastore_num_tokens=args.num_tokens, datastore_max_ngram_size=args.max_ngram_size,
                    datastore_min_ngram_size=args.min_ngram_size)  # fmt: skip
    attach_datastore(args.drafter, args.output, responses, **settings)
    size = sum(len(response) + 1 for response in responses)
    print(f"{args.output}: datastore of {len(responses)} responses, {size} tokens with separators")


def check_args(args: argparse.Namespace) -> None:
    """[`UsageError`] for a missing drafter or pool folder, or lookup sizes out of range, before any pool is read."""
    check_exists(args.drafter, "--drafter", "drafter folder", repo_id_ok=False)
    if not (Path(args.drafter) / "config.json").is_file():
        raise UsageError(f"--drafter {args.drafter!r}: no config.json there; pass a drafter folder (save_pretrained)")
    for spec in args.pool:
        check_exists(parse_pool(spec)[0], "--pool", "pool folder", repo_id_ok=False)
    if args.num_tokens < 1:
        raise UsageError(f"--num-tokens (candidates per lookup) must be >= 1, got {args.num_tokens}")
    if not 1 <= args.min_ngram_size <= args.max_ngram_size:
        raise UsageError(
            f"need 1 <= --min-ngram-size <= --max-ngram-size, got {args.min_ngram_size} and {args.max_ngram_size}"
        )


@exits_on_usage_error("hf-retrace datastore")
def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace datastore --drafter DIR --pool DIR[:END] [--pool ...] --num-tokens M --output DIR`."""
    parser = argparse.ArgumentParser(prog="hf-retrace datastore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="a drafter folder")
    parser.add_argument("--pool", action="append", required=True, help="DIR[:END], repeatable: token pools to store")
    parser.add_argument("--num-tokens", type=int, default=3, help="candidates per datastore lookup")
    parser.add_argument("--max-ngram-size", type=int, default=6, help="longest n-gram looked up (tried first)")
    parser.add_argument("--min-ngram-size", type=int, default=3, help="shortest n-gram looked up")
    parser.add_argument("--output", required=True, help="where to write the drafter (may be --drafter)")
    args = parser.parse_args(argv)
    check_args(args)
    main(args)
    return 0

# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""`hf-retrace replay`: the bench's greedy DFlash tau, replayed offline, one target forward per prompt.

The target's greedy continuations are generated once (and kept in `--continuations`, a JSON file, for the next run);
then each drafter is scored by [`hf_retrace.bench.replay`]: the acceptance at every anchor, and the cycles greedy
decoding runs over them. `tau` is pooled over cycles exactly as `hf-retrace bench` reports it; `anchor_mean` is
`1 +` the mean acceptance over all anchors, what the trainer's `eval_acceptance` estimates. `--check-bench
results.json` compares the replayed cycles with a bench run's, prompt by prompt (the bench run of the same prompts,
`--max-new-tokens` and `--draft-logits-dtype`, a method named like the `--drafter`). `--prompt-lookup-num-tokens 3`
adds each arm again with prompt lookup in front of the drafter (`generation_config.prompt_lookup_num_tokens`), and
`--datastore` with each drafter's datastore lookup behind it (`generation_config.datastore_num_tokens`).
`--num-assistant-tokens 2,3` and `--confidence-thresholds 0.3,0.4` add arms that verify fewer drafts per cycle (the
decoding settings of those names); `verified` is the mean tokens per verification forward. `--block-sizes 16,9`
replays each drafter with the block it runs cut to `B` slots (anchor + `B-1` masks, `B` up to its trained
`block_size`; arms `NAME B=9`): whether a shorter, cheaper drafter forward keeps tau. `--pool-rows START:END`
replays rows of the token pool instead (the target's greedy responses, up to 256 tokens, in generation order): rows
newer than a drafter's training data are a larger held-out set than the bench's prompts, with nothing to generate.

Usage (the bench's 24 held-out prompts; ~1 min per drafter on 2 threads once the continuations exist):

```bash
hf-retrace replay --drafter shipped=model_cards/smollm2-135m-dflash --prompt-lookup-num-tokens 3 --datastore \
    --prompt-sets gsm_symbolic:8,humaneval:8,open_ended:8 --continuations runs/replay/continuations.json
```
"""

import argparse
import json
from pathlib import Path

import torch

from ..cli import UsageError, check_exists, exits_on_usage_error


@exits_on_usage_error("hf-retrace replay")
def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace replay --drafter NAME=FOLDER [...]`; see the module docstring."""
    parser = argparse.ArgumentParser(prog="hf-retrace replay", description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (repeatable)")
    parser.add_argument("--prompt-sets", default="gsm_symbolic:8,humaneval:8,open_ended:8")
    parser.add_argument("--prompt-seed", type=int, default=10000, help="as `hf-retrace bench` (evaluation seeds)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-logits-dtype", default="float32", help="as `hf-retrace bench` ('none' keeps each)")
    parser.add_argument("--continuations", default=None, help="JSON cache of the target's greedy continuations")
    parser.add_argument("--pool-rows", default=None, help="START:END rows of --pool-dir instead of --prompt-sets")
    parser.add_argument("--pool-dir", default="data/smollm2-pool")
    parser.add_argument("--check-bench", default=None, help="a bench results.json of the same prompts to compare with")
    parser.add_argument(
        "--num-assistant-tokens", default="",
        help="comma-separated k: also replay cycles that verify only the first k drafts of each block",
    )  # fmt: skip
    parser.add_argument(
        "--confidence-thresholds", default="",
        help="comma-separated t: also replay cycles under assistant_confidence_threshold = t",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-lookup-num-tokens", type=int, default=None,
        help="also replay every arm with prompt lookup of this many tokens in front of the drafter",
    )  # fmt: skip
    parser.add_argument("--prompt-lookup-ngram-sizes", default="3,2", help="MAX,MIN n-gram sizes of that lookup")
    parser.add_argument(
        "--datastore", action="store_true",
        help="also replay every arm with each drafter's datastore lookup (`hf-retrace datastore`) in front of it, "
        "behind prompt lookup when --prompt-lookup-num-tokens is given",
    )  # fmt: skip
    parser.add_argument(
        "--block-sizes", default="",
        help="comma-separated B: replay each drafter running a block of B slots (at most its trained block_size)",
    )  # fmt: skip
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args(argv)
    block_sizes = _block_sizes(args.block_sizes)
    caps = [int(k) for k in args.num_assistant_tokens.split(",") if k]
    thresholds = [float(t) for t in args.confidence_thresholds.split(",") if t]
    # each limit alone, then every pair (a cycle verifies at most k drafts, and only the confident ones)
    arms = [(None, None)] + [(k, None) for k in caps] + [(None, t) for t in thresholds]
    arms += [(k, t) for k in caps for t in thresholds]
    drafters = [spec.partition("=") for spec in args.drafter]
    if not all(name and folder for name, _, folder in drafters):
        raise UsageError(f"--drafter {args.drafter}: expected NAME=FOLDER")
    for _, _, folder in drafters:
        check_exists(folder, "--drafter", "drafter folder")
    check_exists(args.check_bench, "--check-bench", "file", repo_id_ok=False)
    if args.pool_rows:
        check_exists(args.pool_dir, "--pool-dir", "pool folder", repo_id_ok=False)
    lookup = None  # (num_tokens, max_size, min_size) of prompt lookup, or None
    if args.prompt_lookup_num_tokens:
        sizes = args.prompt_lookup_ngram_sizes.split(",")
        if len(sizes) != 2 or not all(n.isdigit() for n in sizes) or not 1 <= int(sizes[1]) <= int(sizes[0]):
            raise UsageError(f"--prompt-lookup-ngram-sizes {args.prompt_lookup_ngram_sizes!r}: expected MAX,MIN "
                             "with 1 <= MIN <= MAX, e.g. 3,2")  # fmt: skip
        lookup = (args.prompt_lookup_num_tokens, int(sizes[0]), int(sizes[1]))
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from ..bench.run import encode_prompt_set, load_target, parse_prompt_sets, prompt_set_label
    from ..models.modeling_retrace import ReTraceDrafterModel

    target, tokenizer = load_target("default", torch.float32, "cpu")
    if args.pool_rows:
        prompts, sequences = _pool_rows(args.pool_dir, args.pool_rows)
    else:
        prompts = [(prompt_set_label(name), ids) for name, count in parse_prompt_sets(args.prompt_sets)
                   for ids in encode_prompt_set(name, count, tokenizer, args.prompt_seed)]  # fmt: skip
        sequences = _continuations(target, prompts, args.max_new_tokens, args.continuations)
    bench = _bench_cycles(args.check_bench) if args.check_bench else {}
    lookups = _lookups(prompts, sequences, lookup, None) if lookup and not args.datastore else None
    print(f"{'drafter':<32}{'set':<14}{'prompts':>8}{'tau':>8}{'anchor_mean':>13}{'verified':>10}{'bench_match':>13}")
    for name, _, folder in drafters:
        drafter = ReTraceDrafterModel.from_pretrained(folder, dtype=torch.float32).eval()
        if args.draft_logits_dtype != "none":
            drafter.generation_config.draft_logits_dtype = args.draft_logits_dtype
        if args.datastore:  # each drafter's own datastore, behind prompt lookup as in generation
            lookups = _lookups(prompts, sequences, lookup, _datastore(drafter, folder))
        lookup_label = " +" + "+".join(["lookup"] * bool(lookup) + ["datastore"] * args.datastore)
        trained = drafter.config.block_size
        for block in block_sizes or [trained]:
            if block > trained:
                raise UsageError(f"--block-sizes {block}: {folder} was trained on blocks of {trained}; a drafter "
                                 f"runs at most its trained block")  # fmt: skip
            drafter.config.block_size = block  # anchor_scores runs the block the config names
            arm_name = name if block == trained else f"{name} B={block}"
            _report(arm_name, drafter, target, prompts, sequences, bench.get(name), arms, lookups, lookup_label)
        drafter.config.block_size = trained


def _block_sizes(text: str) -> list[int]:
    """`--block-sizes "16,9"` -> `[16, 9]`; each `B >= 2` (an anchor and at least one mask slot)."""
    sizes = [item.strip() for item in text.split(",") if item.strip()]
    if not all(item.isdigit() and int(item) >= 2 for item in sizes):
        raise UsageError(f"--block-sizes {text!r}: expected comma-separated integers >= 2 (anchor + masks), e.g. 16,9")
    return [int(item) for item in sizes]


def _lookups(prompts, sequences, lookup: tuple[int, int, int] | None, datastore) -> list:
    """Per prompt, [`lookup_acceptance`] at every anchor: prompt lookup `(num_tokens, max, min)`, then `datastore`."""
    from ..bench.replay import lookup_acceptance

    num_tokens, max_size, min_size = lookup if lookup else (None, 3, 2)
    return [lookup_acceptance(seq, ids.shape[1], num_tokens, max_size, min_size, datastore)
            for (_, ids), seq in zip(prompts, sequences)]  # fmt: skip


def _datastore(drafter, folder: str):
    """The drafter's [`NgramDatastore`] under its config's settings; a parser error when it has none."""
    config = drafter.generation_config
    if config.datastore_num_tokens is None:
        raise UsageError(f"--datastore: {folder} has no datastore lookup (datastore_num_tokens is unset); attach "
                         "one with `hf-retrace datastore`")  # fmt: skip
    return drafter.datastore(config.datastore_num_tokens, config.datastore_max_ngram_size,
                             config.datastore_min_ngram_size)  # fmt: skip


def _continuations(target, prompts, max_new_tokens: int, path: str | None) -> list[torch.LongTensor]:
    """Prompt + the target's greedy continuation per prompt, from `path` when it holds these prompts."""
    cached = json.loads(Path(path).read_text()) if path and Path(path).is_file() else {}
    key = json.dumps([ids[0].tolist() for _, ids in prompts] + [max_new_tokens])
    if cached.get("key") == key:
        return [torch.tensor([s]) for s in cached["sequences"]]
    sequences = []
    for i, (_, ids) in enumerate(prompts):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
        sequences.append(out)
        print(f"continuation {i + 1}/{len(prompts)}: {out.shape[1] - ids.shape[1]} tokens", flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"key": key, "sequences": [s[0].tolist() for s in sequences]}))
    return sequences


def _pool_rows(pool_dir: str, rows: str) -> tuple[list, list[torch.LongTensor]]:
    """(`[(source, prompt ids [1, P])]`, `[prompt + response [1, T]]`) of pool rows `START:END`."""
    from ..data.pool import read_token_shards

    pool = read_token_shards(pool_dir)
    start, _, end = rows.partition(":")
    if not (start.isdigit() and end.isdigit() and int(start) < int(end) <= len(pool)):
        raise UsageError(f"--pool-rows {rows!r}: expected START:END within the pool's {len(pool)} rows")
    selected = pool[int(start) : int(end)]
    prompts = [(row["source"], torch.tensor([row["prompt_ids"]])) for row in selected]
    return prompts, [torch.tensor([row["prompt_ids"] + row["response_ids"]]) for row in selected]


def _bench_cycles(path: str) -> dict[str, list[list[int]]]:
    """`{method: [acceptance_lengths per prompt, in the bench's prompt order]}` of a bench results.json."""
    generations = json.loads(Path(path).read_text())["generations"]
    by_method: dict[str, list[tuple]] = {}
    for g in generations:
        by_method.setdefault(g["method"], []).append((g["prompt_set"], g["prompt_index"], g["acceptance_lengths"]))
    order = {}
    for g in generations:
        order.setdefault(g["prompt_set"], len(order))
    return {m: [c for _, _, c in sorted(rows, key=lambda r: (order[r[0]], r[1]))] for m, rows in by_method.items()}


def _report(
    name, drafter, target, prompts, sequences, bench_cycles, arms, lookups=None, lookup_label=" +lookup"
) -> None:
    from ..bench.replay import ReplayResult, anchor_scores

    scores = [anchor_scores(target, drafter, seq, ids.shape[1]) for (_, ids), seq in zip(prompts, sequences)]
    with_lookup = [False] + [True] * (lookups is not None)
    # the scores do not depend on the arm: one target forward per prompt serves all
    for (cap, threshold), lookup in ((arm, lookup) for lookup in with_lookup for arm in arms):
        limits = dict(num_assistant_tokens=cap, assistant_confidence_threshold=threshold)
        per_set: dict[str, ReplayResult] = {}
        pooled, matches = ReplayResult(**limits), 0
        for i, ((label, _), prompt_scores) in enumerate(zip(prompts, scores)):
            prompt_lookups = lookups[i] if lookup else None
            per_set.setdefault(label, ReplayResult(**limits)).add(prompt_scores, prompt_lookups)
            pooled.add(prompt_scores, prompt_lookups)
            matches += bench_cycles is not None and pooled.cycles[-1] == bench_cycles[i]
        arm = name + (f" k={cap}" if cap is not None else "") + (f" t={threshold}" if threshold is not None else "")
        arm += lookup_label if lookup else ""
        for label, result in [*per_set.items(), ("pooled", pooled)]:
            match = f"{matches}/{len(prompts)}" if bench_cycles is not None and label == "pooled" else ""
            print(f"{arm:<32}{label:<14}{len(result.cycles):>8}{result.tau:>8.3f}{result.anchor_mean:>13.3f}"
                  f"{result.mean_verified:>10.2f}{match:>13}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(cli_main())

# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""How well drafters fit rows they trained on against rows they never saw, on a feature cache (no generation).

Each drafter is scored by the trainer's own evaluation (the training objective under `no_grad`, the same anchors for
every drafter and split): `acceptance` is the mean number of greedily accepted drafts per block against the labels,
`n>=k` the share of blocks with at least `k` accepted drafts, `loss` the decayed block loss. A split is
`NAME=START:END`, a row range of the cache in shard order, so rows added to a pool after a drafter was trained are
held out from it. A large seen/held-out gap means the drafter is limited by data, not by steps. `--vocab` scores
each drafter with other draft vocabularies (the ids only pick rows of the target's frozen head, so no retraining):
`saved`, `full`, or `K` re-ranked on the responses of `--rank-rows`.

Usage (the shipped drafter saw shards 0-11 of the SmolLM2 pool, 1,664 rows; shard 13 came later):

```bash
python benchmarks/heldout_acceptance.py --drafter shipped=model_cards/smollm2-135m-dflash \
    --split seen=0:128 --split heldout=1792:1920
python benchmarks/heldout_acceptance.py --drafter shipped=model_cards/smollm2-135m-dflash --split heldout=2944:3072 \
    --vocab saved --vocab 16384 --vocab full --rank-rows 0:2944
```
"""

import argparse

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (repeatable)")
    parser.add_argument("--split", action="append", required=True, help="NAME=START:END rows (repeatable)")
    parser.add_argument("--config", default="training/recipes/smollm2-135m-dflash-grown.yaml",
                        help="recipe giving the target, feature cache, anchors and loss")  # fmt: skip
    parser.add_argument("--vocab", action="append", default=None, help="saved | full | K (repeatable)")
    parser.add_argument("--rank-rows", default=None, help="START:END rows whose responses rank a `--vocab K`")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args(argv)
    if not all(name and folder for name, _, folder in (spec.partition("=") for spec in args.drafter)):
        parser.error(f"--drafter {args.drafter}: expected NAME=FOLDER")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from hf_retrace.scripts.train import feature_collator, load_training_dataset, make_parser
    from hf_retrace.trainer.setup import init_drafter, load_target
    from hf_retrace.trainer.trainer import ReTraceTrainer

    script_args, training_args, _ = make_parser().parse_args_and_config(
        ["--config", args.config, "--output_dir", "/tmp/heldout_acceptance", "--report_to", "none",
         "--eval_num_rows", "0", "--eval_strategy", "no", "--eval_on_start", "false"]
    )  # fmt: skip
    target, tokenizer = load_target(training_args.target_model_name_or_path, training_args.target_dtype)
    dataset = load_training_dataset(script_args, training_args, target, tokenizer)
    splits = {}
    for spec in args.split:
        name, _, rows = spec.partition("=")
        if not name:
            parser.error(f"--split {spec!r}: expected NAME=START:END")
        splits[name] = dataset.select(_row_range(rows, len(dataset), parser))
    vocab_size = target.config.vocab_size
    vocabs = {v: _vocabulary(v, dataset, args.rank_rows, vocab_size, parser) for v in args.vocab or ["saved"]}
    print(f"{'drafter':<14}{'vocab':<8}{'split':<10}{'rows':>6}{'acceptance':>12}{'n>=1':>7}{'n>=2':>7}{'n>=3':>7}"
          f"{'loss':>9}{'oov':>8}")  # fmt: skip
    for spec in args.drafter:
        name, _, folder = spec.partition("=")
        training_args.drafter_name_or_path = folder
        for vocab, ids in vocabs.items():
            drafter = init_drafter(training_args, target)
            if vocab != "saved":
                drafter.set_draft_vocab(ids)
            trainer = ReTraceTrainer(
                model=drafter, target=target, args=training_args, train_dataset=dataset,
                data_collator=feature_collator(dataset, drafter, training_args),
            )  # fmt: skip
            for split, rows in splits.items():
                m = trainer.evaluate(eval_dataset=rows)
                shares = "".join(f"{m[f'eval_accepted_ge_{k}']:>7.3f}" for k in (1, 2, 3))
                print(f"{name:<14}{vocab:<8}{split:<10}{len(rows):>6}{m['eval_acceptance']:>12.3f}{shares}"
                      f"{m['eval_loss']:>9.3f}{m.get('eval_out_of_vocab', 0.0):>8.3f}")  # fmt: skip


def _vocabulary(spec: str, dataset, rank_rows: str | None, vocab_size: int, parser) -> list[int] | None:
    """Token ids of a `--vocab` setting (`None` for `full` and `saved`)."""
    if spec in ("saved", "full"):
        return None
    if not spec.isdigit() or rank_rows is None:
        parser.error(f"--vocab {spec!r}: expected saved, full or a size K (with --rank-rows START:END)")
    from hf_retrace.scripts.train import rank_draft_vocab

    return rank_draft_vocab(dataset.select(_row_range(rank_rows, len(dataset), parser)), int(spec), vocab_size)[0]


def _row_range(text: str, num_rows: int, parser) -> range:
    """`START:END` -> `range(START, END)` within the cache's rows, or an argparse error."""
    start, _, end = text.partition(":")
    if not (start.isdigit() and end.isdigit() and int(start) < int(end) <= num_rows):
        parser.error(f"{text!r}: expected START:END rows within the cache's {num_rows} rows")
    return range(int(start), int(end))


if __name__ == "__main__":
    main()

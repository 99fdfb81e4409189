# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""How well drafters fit rows they trained on against rows they never saw, on a feature cache (no generation).

Each drafter is scored by the trainer's own evaluation (the training objective under `no_grad`, the same anchors for
every drafter and split): `acceptance` is the mean number of greedily accepted drafts per block against the labels,
`loss` the decayed block loss. A split is `NAME=START:END`, a row range of the cache in shard order, so rows added to
a pool after a drafter was trained are held out from it. A large seen/held-out gap means the drafter is limited by
data, not by steps.

Usage (the shipped drafter saw shards 0-11 of the SmolLM2 pool, 1,664 rows; shard 13 came later):

```bash
python benchmarks/heldout_acceptance.py --drafter shipped=model_cards/smollm2-135m-dflash \
    --split seen=0:128 --split heldout=1792:1920
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
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args(argv)
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
        start, _, end = rows.partition(":")
        if not (name and 0 <= int(start) < int(end) <= len(dataset)):
            parser.error(f"--split {spec!r}: expected NAME=START:END within the cache's {len(dataset)} rows")
        splits[name] = dataset.select(range(int(start), int(end)))
    print(f"{'drafter':<14}{'split':<10}{'rows':>6}{'acceptance':>12}{'loss':>9}")
    for spec in args.drafter:
        name, _, folder = spec.partition("=")
        training_args.drafter_name_or_path = folder
        drafter = init_drafter(training_args, target)
        trainer = ReTraceTrainer(
            model=drafter, target=target, args=training_args, train_dataset=dataset,
            data_collator=feature_collator(dataset, drafter, training_args),
        )  # fmt: skip
        for split, rows in splits.items():
            metrics = trainer.evaluate(eval_dataset=rows)
            print(f"{name:<14}{split:<10}{len(rows):>6}{metrics['eval_acceptance']:>12.3f}{metrics['eval_loss']:>9.3f}")


if __name__ == "__main__":
    main()

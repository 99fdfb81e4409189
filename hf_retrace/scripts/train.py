# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""`hf-retrace train` and `training/train.py`: train a DFlash or ReTrace drafter against a frozen target (`docs/training.md`).

[`make_parser`] reads the recipe (`--config`) and command-line overrides into TRL's three argument groups
(`ReTraceScriptArguments`, [`ReTraceConfig`], TRL's `ModelConfig`); [`main`] loads target and drafter, the dataset,
trains and saves. Usage and recipes: `training/train.py`.
"""

import argparse
import os
import sys
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser

from ..cli import UsageError, check_exists, exits_on_usage_error
from ..trainer.config import ReTraceConfig
from ..trainer.setup import init_drafter, load_target, synthetic_dataset
from ..trainer.trainer import ReTraceTrainer


SYNTHETIC = "synthetic"


@dataclass
class ReTraceScriptArguments(ScriptArguments):
    """Data arguments. `dataset_name`: `synthetic` (random prompts answered by the target, for smoke tests), a pool
    folder (`tokens/shard_*.npz`, from `hf-retrace build-pool`; `feature_source="online"`), a feature cache
    (`feature_source="cached"`), a `save_to_disk` folder (e.g. the output of
    `hf_retrace.data.responses.generate_responses`), a `.json`/`.jsonl` file, or a Hub dataset. Rows are either
    tokenized (`input_ids`, `loss_mask`) or chat `messages` (tokenized here)."""

    synthetic_num_examples: int = field(default=64, metadata={"help": "Rows of the `synthetic` dataset."})
    synthetic_prompt_length: int = field(default=8, metadata={"help": "Prompt tokens per `synthetic` row."})
    synthetic_response_length: int = field(default=24, metadata={"help": "Target tokens per `synthetic` row."})
    eval_num_rows: int = field(
        default=0,
        metadata={
            "help": "Hold out the last N rows (a pool's newest shards) as the eval split; evaluated every "
            "`eval_steps` with `--eval_strategy steps` (`eval_acceptance` is the held-out acceptance)."
        },
    )
    dataset_start_row: int = field(
        default=0,
        metadata={
            "help": "Train on rows from this one on: continuing a drafter on the rows its pool gained since it was "
            "trained (a pool's rows are in generation order)."
        },
    )
    dataset_end_row: int | None = field(
        default=None,
        metadata={
            "help": "Ignore rows from this one on (unset: all), so runs compared side by side see the same rows while "
            "the pool keeps growing; the eval split is the last `eval_num_rows` rows before it."
        },
    )


def load_training_dataset(script_args: ReTraceScriptArguments, training_args: ReTraceConfig, target, tokenizer):
    """The tokenized training split (`input_ids`, `loss_mask`)."""
    name = script_args.dataset_name
    if name is None:
        raise ValueError("Set `dataset_name` (e.g. `synthetic`, a saved dataset folder or a .jsonl file).")
    if training_args.feature_source == "cached":
        from ..data.pool import load_feature_dataset

        return load_feature_dataset(name, target_name=training_args.target_model_name_or_path).with_format("numpy")
    if name == SYNTHETIC:
        return synthetic_dataset(
            target, script_args.synthetic_num_examples, script_args.synthetic_prompt_length,
            script_args.synthetic_response_length, seed=training_args.seed,
        )  # fmt: skip
    from datasets import load_dataset, load_from_disk

    if os.path.isdir(os.path.join(name, "tokens")):  # a pool's token shards: the target computes features online
        from ..data.pool import load_pool_dataset

        return load_pool_dataset(name, training_args.max_length)
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_info.json")):
        dataset = load_from_disk(name)
    elif name.endswith((".json", ".jsonl")):
        dataset = load_dataset("json", data_files=name, split="train")
    else:
        dataset = load_dataset(name, script_args.dataset_config, split=script_args.dataset_train_split)
    if "input_ids" in dataset.column_names:
        return dataset
    if tokenizer is None:
        raise ValueError(
            f"Dataset {name!r} is not tokenized and target {training_args.target_model_name_or_path!r} has no "
            "tokenizer."
        )
    from ..data.responses import tokenize_conversations

    return tokenize_conversations(dataset, tokenizer, training_args.max_length)


def split_rows(dataset, start_row: int = 0, eval_num_rows: int = 0, end_row: int | None = None):
    """(train, eval): rows `[start_row, n - eval_num_rows)` and the last `eval_num_rows` (`None` for 0) of the first
    `n = end_row` rows (all by default). The last rows, not a random sample, so that a pool grown after a drafter was
    trained gives it rows it never saw."""
    if end_row is not None and not 0 < end_row <= len(dataset):
        raise ValueError(
            f"dataset_end_row={end_row} must be in [1, {len(dataset)}] for a dataset of {len(dataset)} rows."
        )
    n = len(dataset) if end_row is None else end_row
    if not 0 <= eval_num_rows < n:
        raise ValueError(f"eval_num_rows={eval_num_rows} must be in [0, {n}) for a dataset of {n} rows.")
    cut = n - eval_num_rows
    if not 0 <= start_row < cut:
        raise ValueError(f"dataset_start_row={start_row} leaves no training row: {n} rows, {eval_num_rows} held out.")
    train = dataset if (start_row, cut) == (0, n) else dataset.select(range(start_row, cut))
    return train, (dataset.select(range(cut, n)) if eval_num_rows else None)


def split_token_ids(dataset) -> tuple[list[list[int]], list[list[int]]]:
    """(responses, prompts) of every training row: tokens after `prompt_length` (or where `loss_mask` is 1), and
    the rest."""
    if "prompt_length" in dataset.column_names:
        rows = [(ids[int(p) :], ids[: int(p)]) for ids, p in zip(dataset["input_ids"], dataset["prompt_length"])]
    else:
        rows = [
            ([t for t, m in zip(ids, mask) if m], [t for t, m in zip(ids, mask) if not m])
            for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"])
        ]
    return [r for r, _ in rows], [p for _, p in rows]


def rank_draft_vocab(dataset, size: int, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """(ids, responses): the `size` most frequent tokens of the rows (see [`most_frequent_tokens`]) and the rows'
    responses they were ranked on."""
    from ..trainer.draft_vocab import most_frequent_tokens

    wanted = ("input_ids", "prompt_length", "loss_mask")
    columns = dataset.select_columns([c for c in wanted if c in dataset.column_names])
    responses, prompts = split_token_ids(columns)
    return most_frequent_tokens(responses, size, prompts=prompts, vocab_size=vocab_size), responses


def set_draft_vocab_from_dataset(drafter, dataset, size: int) -> None:
    """Gives the drafter a reduced draft vocabulary of `size` tokens ranked on the training rows
    ([`rank_draft_vocab`]); a drafter whose vocabulary already has that size keeps it (resuming)."""
    from ..trainer.draft_vocab import coverage

    if drafter.draft_vocab_ids is not None and drafter.config.draft_vocab_size == size:
        return
    ids, responses = rank_draft_vocab(dataset, size, drafter.config.vocab_size)
    before = ""
    if drafter.draft_vocab_ids is not None:
        old = coverage(responses, drafter.draft_vocab_ids.tolist())
        before = f" (the loaded drafter's {drafter.config.draft_vocab_size}: {old:.2%})"
    drafter.set_draft_vocab(ids)
    print(f"draft vocabulary: {size} tokens cover {coverage(responses, ids):.2%} of the responses{before}")


def feature_collator(dataset, drafter, training_args: ReTraceConfig):
    """[`DataCollatorWithFeatures`] for a feature cache, `None` (the trainer's default collator) otherwise."""
    if training_args.feature_source != "cached":
        return None
    import json

    from ..data.responses import DataCollatorWithFeatures

    meta = json.loads(dataset.info.description)
    return DataCollatorWithFeatures(
        cache_layer_ids=meta["layer_ids"], layer_ids=drafter.config.target_layer_ids, hidden_size=meta["hidden_size"],
        max_length=training_args.max_length,
    )  # fmt: skip


def lora_config(model_args: ModelConfig):
    """LoRA on the drafter backbone from TRL's `ModelConfig` (`--use_peft`), or `None`."""
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules, modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora, use_dora=model_args.use_dora,
    )  # fmt: skip


def build_trainer(
    script_args: ReTraceScriptArguments,
    training_args: ReTraceConfig,
    model_args: ModelConfig,
    target=None,
    dataset=None,
) -> ReTraceTrainer:
    """Loads target, drafter and dataset and builds the trainer that [`main`] runs.

    Args:
        target, dataset (*optional*): an already loaded target (with `tokenizer` on it or `None`) and the full dataset
            before the row split, so that two trainers of one run (e.g. a timing probe, then the run) load them once.
    """
    if model_args.use_peft and not (training_args.drafter_name_or_path or model_args.model_name_or_path):
        raise ValueError("--use_peft needs a trained drafter to adapt: set drafter_name_or_path.")
    tokenizer = None
    if target is None:
        target, tokenizer = load_target(
            training_args.target_model_name_or_path, training_args.target_dtype, training_args.target_model_init_kwargs
        )
    drafter = init_drafter(training_args, target, model_args.model_name_or_path)
    if dataset is None:
        dataset = load_training_dataset(script_args, training_args, target, tokenizer)
    dataset, eval_dataset = split_rows(
        dataset, script_args.dataset_start_row, script_args.eval_num_rows, script_args.dataset_end_row
    )
    if training_args.drafter_draft_vocab_size is not None:
        set_draft_vocab_from_dataset(drafter, dataset, training_args.drafter_draft_vocab_size)
    return ReTraceTrainer(
        model=drafter, target=target, args=training_args, train_dataset=dataset, eval_dataset=eval_dataset,
        peft_config=lora_config(model_args),
        data_collator=feature_collator(dataset, drafter, training_args),
    )  # fmt: skip


def main(script_args: ReTraceScriptArguments, training_args: ReTraceConfig, model_args: ModelConfig):
    """Loads target and drafter, trains, saves the drafter (merged with `--use_peft`) to `output_dir`."""
    trainer = build_trainer(script_args, training_args, model_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Saved the drafter to {training_args.output_dir}")
    return trainer


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    """`TrlParser` of (`ReTraceScriptArguments`, [`ReTraceConfig`], `ModelConfig`), or a `train` subparser of a
    `TrlParser`-class `subparsers` (TRL's CLI pattern)."""
    dataclass_types = (ReTraceScriptArguments, ReTraceConfig, ModelConfig)
    if subparsers is not None:
        return subparsers.add_parser("train", help="Train a DFlash/ReTrace drafter", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


def check_paths(script_args: ReTraceScriptArguments, training_args: ReTraceConfig, model_args: ModelConfig) -> None:
    """Raises [`UsageError`] for a local target, drafter or dataset path that does not exist, before anything loads
    (a bare `owner/name` may be a Hub repo and is left to the loaders)."""
    check_exists(training_args.target_model_name_or_path, "target_model_name_or_path", "model folder")
    check_exists(training_args.drafter_name_or_path, "drafter_name_or_path", "drafter folder")
    check_exists(model_args.model_name_or_path, "model_name_or_path", "drafter folder")
    if script_args.dataset_name != SYNTHETIC:
        check_exists(script_args.dataset_name, "dataset_name", "dataset file or folder")


@exits_on_usage_error("hf-retrace train")
def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace train --config RECIPE [--field value ...]` (also what `training/train.py` runs). A missing recipe,
    an unknown or invalid field, or a missing path is a [`UsageError`] (one line, exit status 2)."""
    args = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(args):  # the recipe: `--config PATH` or `--config=PATH`
        if arg == "--config" and i + 1 < len(args) or arg.startswith("--config="):
            check_exists(arg.partition("=")[2] or args[i + 1], "--config", "recipe file", repo_id_ok=False)
    try:
        script_args, training_args, model_args = make_parser(prog="hf-retrace train").parse_args_and_config(argv)
    except (FileNotFoundError, ValueError) as error:  # TrlParser's and the configs' own validation
        raise UsageError(str(error)) from error
    check_paths(script_args, training_args, model_args)
    main(script_args, training_args, model_args)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())

# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Regenerates the drafter's training data: the target's own responses to a mix of prompt sets.

Usage (`python training/generate_data.py` runs the same):

```bash
hf-retrace generate-data --target default \
    --mix gsm_symbolic:600,codeio:300,stdlib:300,open_ended:300 \
    --max-new-tokens 256 --batch-size 32 --output data_cache/smollm2
```

Every source is split into chunks of `--chunk-size` prompts and the chunks are generated round-robin across sources
(chunk 0 of every source, then chunk 1, ...). Each chunk is one resumable, fingerprint-cached
`hf_retrace.data.responses.generate_responses` call under `<output>/cache`, and after every chunk the combined dataset
of everything finished so far is written to `<output>/dataset` (a `datasets` folder with a `source` column). So the
output is usable, and balanced across sources, at any time, and rerunning the same command resumes where it stopped.

Prompts longer than `--max-prompt-tokens` (chat template included) are dropped and replaced by further items of the
same set (codeio questions embed whole programs and can run to 14k tokens). reasoning-gym sets use training seeds
`--seed .. --seed + n` (kept below `hf_retrace.data.prompts.EVAL_SEED_OFFSET`, which evaluation uses).
"""

import argparse
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from datasets import Dataset, concatenate_datasets

from ..cli import UsageError, check_exists, exits_on_usage_error
from ..data.prompts import EVAL_SEED_OFFSET, PROMPT_SETS, load_prompts
from ..data.responses import _prompt_ids, generate_responses


logger = logging.getLogger("generate_data")


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a model path"
    )
    parser.add_argument("--mix", default="gsm_symbolic:600,codeio:300,stdlib:300,open_ended:300",
                        help="comma-separated name:num_prompts (names as in hf_retrace.data.prompts.load_prompts)")
    parser.add_argument("--output", default="data_cache/smollm2", help="output folder")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=128, help="prompts per source per resumable chunk")
    parser.add_argument("--max-prompt-tokens", type=int, default=640, help="drop longer prompts (template included)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="target dtype; float32 is ~2x faster than bfloat16 on CPUs without native bf16 matmuls")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--seed", type=int, default=0, help="prompt seed (training: < EVAL_SEED_OFFSET) and sampling seed"
    )
    parser.add_argument(
        "--max-responses", type=int, default=None, help="stop after the chunk that reaches this many responses"
    )
    parser.add_argument("--save-every", type=int, default=1, help="batches per checkpoint shard")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    return parser


def parse_mix(mix: str) -> list[tuple[str, int]]:
    """`"gsm_symbolic:600,stdlib:300"` -> `[("gsm_symbolic", 600), ("stdlib", 300)]`."""
    sources = []
    for item in mix.split(","):
        name, _, count = item.strip().rpartition(":")
        if not name or not count.isdigit():
            raise ValueError(f"--mix items must look like name:num_prompts, got {item!r}")
        sources.append((name, int(count)))
    return sources


def check_args(mix: str, seed: int, target: str) -> list[tuple[str, int]]:
    """The parsed `--mix`, or a [`UsageError`] for a malformed item, an unknown prompt set or missing `.jsonl`, a
    reasoning-gym set whose training seeds would reach the evaluation range, or a missing `--target` folder."""
    try:
        sources = parse_mix(mix)
    except ValueError as error:
        raise UsageError(str(error)) from error
    for name, count in sources:
        if name.endswith(".jsonl"):
            check_exists(name, "--mix", "prompt file", repo_id_ok=False)
        elif name not in PROMPT_SETS:
            raise UsageError(f"--mix: unknown prompt set {name!r}; use one of {PROMPT_SETS} or a .jsonl file")
        elif name in ("gsm_symbolic", "codeio") and seed + count > EVAL_SEED_OFFSET:
            raise UsageError(
                f"--mix {name}:{count} with --seed {seed} reaches the evaluation seeds (>= {EVAL_SEED_OFFSET}); "
                f"ask for at most {EVAL_SEED_OFFSET - seed} prompts or lower --seed"
            )
    if target != "default":
        check_exists(target, "--target", "model folder")
    return sources


def load_target(target: str, dtype: torch.dtype):
    if target == "default":
        from ..data.assets import load_default_target

        return load_default_target(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval(), AutoTokenizer.from_pretrained(target)


def select_prompts(
    name: str, count: int, seed: int, tokenizer, max_prompt_tokens: int, split: str | None = None
) -> list[list[dict]]:
    """`count` prompts of `name` whose templated length is at most `max_prompt_tokens`, oversampling as needed."""
    is_procedural = name in ("gsm_symbolic", "codeio")
    if is_procedural and seed + count > EVAL_SEED_OFFSET:
        raise ValueError(f"{name}: training seeds {seed}..{seed + count} reach the evaluation range")
    # procedural sets are oversampled up to the last training seed; finite sets stop growing when exhausted
    limit = EVAL_SEED_OFFSET - seed if is_procedural else None
    requested = count
    while True:
        prompts = load_prompts(name, num_prompts=requested, seed=seed, split=split)
        kept = [p for p in prompts if len(_prompt_ids(tokenizer, p)) <= max_prompt_tokens]
        if len(kept) >= count or len(prompts) < requested or requested == limit:
            break
        requested = requested * 4 if limit is None else min(requested * 4, limit)
    if len(kept) < count:
        logger.warning(f"{name}: only {len(kept)} prompts of <= {max_prompt_tokens} tokens (asked for {count})")
    logger.info(f"{name}: kept {min(len(kept), count)} prompts out of {len(prompts)} loaded")
    return kept[:count]


def save_combined(parts: list[Dataset], output: Path) -> int:
    combined = concatenate_datasets(parts)
    tmp = output / ".dataset.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    combined.save_to_disk(str(tmp))
    shutil.rmtree(output / "dataset", ignore_errors=True)
    os.replace(tmp, output / "dataset")
    return sum(len(ids) for ids in combined["response_ids"])


def main(args: argparse.Namespace) -> None:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target(args.target, getattr(torch, args.dtype))
    output = Path(args.output)
    sources = {
        name: select_prompts(name, count, args.seed, tokenizer, args.max_prompt_tokens)
        for name, count in parse_mix(args.mix)
    }
    num_chunks = max((len(p) + args.chunk_size - 1) // args.chunk_size for p in sources.values())
    parts, start = [], time.perf_counter()
    for chunk in range(num_chunks):
        for name, prompts in sources.items():
            chunk_prompts = prompts[chunk * args.chunk_size : (chunk + 1) * args.chunk_size]
            if not chunk_prompts:
                continue
            responses = generate_responses(
                target, tokenizer, chunk_prompts, output / "cache",
                max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, do_sample=args.do_sample,
                temperature=args.temperature, top_p=args.top_p, seed=args.seed, save_every=args.save_every,
            )  # fmt: skip
            parts.append(responses.add_column("source", [name] * len(responses)))
            num_tokens = save_combined(parts, output)
            elapsed = time.perf_counter() - start
            logger.info(
                f"chunk {chunk + 1}/{num_chunks} {name}: {sum(len(p) for p in parts)} responses, {num_tokens} tokens "
                f"in {output / 'dataset'} ({elapsed / 60:.1f} min this run)"
            )
            if args.max_responses is not None and sum(len(p) for p in parts) >= args.max_responses:
                logger.info(f"done: {output / 'dataset'} (--max-responses {args.max_responses})")
                return
    logger.info(f"done: {output / 'dataset'}")


@exits_on_usage_error("hf-retrace generate-data")
def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace generate-data [--target ...] [--mix ...] [--output ...]` (also what `training/generate_data.py`
    runs)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    args = make_parser(prog="hf-retrace generate-data").parse_args(argv)
    check_args(args.mix, args.seed, args.target)
    main(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main())

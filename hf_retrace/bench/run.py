"""`hf-retrace bench`: acceptance length, speed and the lossless check of several decoding methods, one process.

Usage:

    hf-retrace bench --target default --num-threads 1 \
        --methods ar,prompt_lookup,dflash=drafters/smollm2-b16,retrace=drafters/smollm2-b16 \
        --prompt-sets gsm_symbolic:20,humaneval:20 --max-new-tokens 256 --output-dir runs/bench

Methods (comma separated; `ar` is added first when missing, it is the reference):

    ar                    target-only decoding
    prompt_lookup[=K]     transformers' prompt lookup decoding, `prompt_lookup_num_tokens=K` (default 10)
    NAME=prompt_lookup:K  the same under another name, so one run can compare several K
    dflash=FOLDER         the drafter in FOLDER run with `retrace_mode="off"` (plain DFlash)
    NAME=FOLDER[:MODE]    the drafter in FOLDER, as saved or with `retrace_mode` MODE (off|overwrite|gated|corrected)
    NAME=FOLDER[:MODE]:key=value:...   the same with decoding settings set, e.g. `speculation_policy=goodput`

Prompt sets: `NAME[:COUNT]` with NAME a set of `hf_retrace.data.prompts.load_prompts` (chat prompts, evaluation seeds
`>= 10000`), a `.jsonl` of `{"prompt"}`/`{"messages"}` records, or a `.jsonl` of `{"input_ids": [...]}` records
(token ids used as is; for targets without a tokenizer).

Measurement: every method runs on the same prompts in this process, interleaved (for each prompt, every
method in an order rotated by one per prompt) so that machine noise hits all alike, after one warmup generation per
method. tau is pooled over verification cycles: committed tokens (bonus included) summed over all cycles of all
prompts, divided by the number of cycles. For drafters a cycle is a verification of a drafted block (the drafter's
`last_generation_stats`); for `ar` and `prompt_lookup` every target forward is a cycle. Greedy outputs must equal
`ar`'s token for token; any difference fails the run (exit code 1) after the results are written, naming the method,
the prompt, the first differing index and the target's logit gap between the two tokens there. The default dtype is
fp32: in bf16, near-tie logits (a gap of one unit in the last place) can break differently in a block verification
and a one-token decode step, which is numerics, not a lossless bug (seen on SmolLM2-135M). As in
`examples/01_generate.py`, few-row fp32 CPU linears run as skinny GEMMs (`hf_retrace.skinny_gemm`) for every method by
default; `--no-skinny-gemm` runs stock linears, and a bf16 or GPU run skips them with a logged note.

Outputs in `--output-dir`: `results.json` (`results`: one row per method x prompt set plus `pooled`), `results.md`,
`tau.png`, `acceptance_histograms.png`. With `--baseline NAME`, also every method's tau relative to NAME's with a
paired bootstrap interval over prompts (`hf_retrace.bench.stats`; `paired_tau` in the JSON).

This module is the CLI, the parsing and the interleaved run; the methods are in `hf_retrace.bench.methods`, the
lossless check and the outputs in `hf_retrace.bench.report`, the timing instruments in `hf_retrace.bench.timing`.
"""

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..cli import UsageError, check_exists, exits_on_usage_error
from ..data.prompts import EVAL_SEED_OFFSET, PROMPT_SETS, SPLIT_SETS, load_prompts
from ..cpu_attention import enable_masked_gqa_sdpa
from ..skinny_gemm import DEFAULT_TUNE_ROWS, enable_skinny_gemm, enable_skinny_gemm_where_it_pays
from .methods import Generation, Method, parse_methods
from .report import add_logit_gaps, check_lossless, render_markdown, summarize, write_outputs
from .stats import paired_tau_table


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_prompt_sets(text: str) -> list[tuple[str, int | None]]:
    """`gsm_symbolic:20,humaneval,path.jsonl:10` -> `[("gsm_symbolic", 20), ("humaneval", None), ...]`."""
    sets = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.rpartition(":")
        sets.append((name, int(count)) if sep and count.isdigit() else (item, None))
    return sets


def prompt_set_label(name: str) -> str:
    return Path(name).stem if name.endswith(".jsonl") else name


def _is_token_id_file(name: str) -> bool:
    if not (name.endswith(".jsonl") and Path(name).is_file()):
        return False
    with open(name, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "{}")
    return "input_ids" in json.loads(first)


def encode_prompt_set(name: str, count: int | None, tokenizer, seed: int) -> list[torch.LongTensor]:
    """Prompts of one set as `[1, T]` token-id tensors (chat template with the generation prompt applied)."""
    if _is_token_id_file(name):
        with open(name, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [torch.tensor([record["input_ids"]], dtype=torch.long) for record in records[:count]]
    if tokenizer is None:
        raise ValueError(f"prompt set {name!r} is text but the target has no tokenizer; use a .jsonl of input_ids")
    # the finite sets have no seeds to separate training from evaluation: evaluation seeds read their `eval` split
    split = "eval" if seed >= EVAL_SEED_OFFSET and name in SPLIT_SETS else None
    conversations = load_prompts(name, num_prompts=count, seed=seed, split=split)
    return [
        tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        for conv in conversations
    ]


def load_target(target: str, dtype: torch.dtype, device: str):
    """`default` (SmolLM2-135M-Instruct, offline) or a `save_pretrained` folder; the tokenizer is optional there."""
    if target == "default":
        from ..data.assets import load_default_target

        model, tokenizer = load_default_target(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
        has_tokenizer = any((Path(target) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(target) if has_tokenizer else None
    return model.to(device), tokenizer


def run_interleaved(target, methods, prompt_sets, generate_kwargs, seed=None, progress=True) -> list[Generation]:
    """Runs every method on every prompt; prompt k runs the methods rotated by k. `seed` (sampling) reseeds torch
    with `seed + k` before each generation so all methods start prompt k from the same RNG state."""
    first = next(ids for _, prompts in prompt_sets for ids in prompts)
    warmup = {**generate_kwargs, "max_new_tokens": min(16, generate_kwargs["max_new_tokens"])}
    for method in methods:
        method.run(target, first.to(target.device), warmup, "warmup", 0)
    total = len(methods) * sum(len(prompts) for _, prompts in prompt_sets)
    generations, k = [], 0
    with tqdm(total=total, desc="bench", unit="gen", disable=not progress) as bar:
        for label, prompts in prompt_sets:
            for index, input_ids in enumerate(prompts):
                for method in methods[k % len(methods) :] + methods[: k % len(methods)]:
                    bar.set_postfix_str(f"{label}#{index} {method.name}")
                    if seed is not None:
                        torch.manual_seed(seed + k)
                    generations.append(method.run(target, input_ids.to(target.device), generate_kwargs, label, index))
                    bar.update()
                k += 1
    return generations


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--target", default="default", help="`default` (SmolLM2-135M-Instruct) or a model folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="fp32: exact lossless check")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--methods", default="ar",
        help="ar,prompt_lookup[=K],NAME=prompt_lookup:K,dflash=FOLDER,NAME=FOLDER[:MODE][:key=value...]",
    )
    parser.add_argument("--prompt-sets", default="gsm_symbolic:20", help="NAME[:COUNT],... (see module doc)")
    parser.add_argument("--prompt-seed", type=int, default=EVAL_SEED_OFFSET, help="evaluation seeds start at 10000")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--do-sample", action="store_true", help="sampling: no lossless check, tau and speed only")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42, help="sampling seed (prompt k reseeds with seed + k)")
    parser.add_argument(
        "--draft-logits-dtype", choices=["target", "bfloat16", "float16", "float32"], default=None,
        help="set every drafter's draft_logits_dtype (`target`: the target's own lm head); unset keeps each config's",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (1 avoids oversubscription)")
    parser.add_argument(
        "--skinny-gemm", action=argparse.BooleanOptionalAction, default=True,
        help="few-row fp32 CPU linears on the kernel tuned fastest per row count (hf_retrace.skinny_gemm: torch's,"
             " transposed or MKL-packed), in the target and every drafter, and masked GQA attention in the target"
             " (hf_retrace.cpu_attention), so every method, `ar` included, runs the same kernels."
             " On by default, as in examples/01_generate.py; skipped with a note for bf16 or a GPU, where it does not"
             " pay",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", default=None,
        help="method to compare every other against: tau ratio with a paired bootstrap interval over prompts",
    )  # fmt: skip
    parser.add_argument("--output-dir", default="bench_results")
    parser.add_argument("--no-progress", action="store_true")
    return parser


@contextlib.contextmanager
def torch_threads(num_threads: int | None):
    """Sets torch's CPU thread count for the block (None: leave it), then restores it. On shared machines 1 thread
    avoids oversubscription, which can slow decoding down several times."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def check_args(args: argparse.Namespace) -> None:
    """Raises [`UsageError`] for what would otherwise fail after the target loaded: an unparsable `--methods`, a
    missing drafter folder, target or prompt file, an unknown prompt set or `--baseline`."""
    try:
        specs = parse_methods(args.methods)
    except ValueError as error:
        raise UsageError(f"--methods: {error}") from error
    if args.target != "default":
        check_exists(args.target, "--target", "model folder")
    for spec in specs:
        if spec.kind == "drafter":
            check_exists(spec.folder, f"--methods {spec.name}=FOLDER:", "drafter folder")
    for name, _ in parse_prompt_sets(args.prompt_sets):
        if name.endswith(".jsonl"):
            check_exists(name, "--prompt-sets", "prompt file", repo_id_ok=False)
        elif name not in PROMPT_SETS:
            raise UsageError(f"--prompt-sets: unknown set {name!r}; use NAME[:COUNT] with NAME one of {PROMPT_SETS} "
                             "or a .jsonl file")  # fmt: skip
    names = [spec.name for spec in specs]
    if args.baseline is not None and args.baseline not in names:
        raise UsageError(f"--baseline {args.baseline!r} is not one of --methods: {names}")


@exits_on_usage_error("hf-retrace bench")
def main(argv: list[str] | None = None) -> int:
    """`hf-retrace bench ...` (module docstring). Bad arguments fail in [`check_args`], before the long run."""
    args = make_parser().parse_args(argv)
    check_args(args)
    with torch_threads(args.num_threads):
        return _run(args)


def _load_method(spec, dtype: torch.dtype, device, draft_logits_dtype: str | None) -> Method:
    try:
        return Method(spec, dtype, device, draft_logits_dtype)
    except OSError as error:  # a Hub repo id that does not exist (or is not cached offline), a folder without weights
        raise UsageError(f"--methods {spec.name}={spec.folder}: {error}") from error


def _run(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype]
    target, tokenizer = load_target(args.target, dtype, args.device)
    specs = parse_methods(args.methods)
    methods = [_load_method(spec, dtype, target.device, args.draft_logits_dtype) for spec in specs]
    # the same kernels for every method, `ar` included, or none, so speedups compare like with like; the drafters
    # have the target's dtype and device, so the target decides (a bf16 or GPU run logs why it is skipped)
    skinny_gemm = args.skinny_gemm and enable_skinny_gemm_where_it_pays(target, DEFAULT_TUNE_ROWS, "target") > 0
    if skinny_gemm:  # and the verification forwards' masked attention on the K/V heads (hf_retrace/cpu_attention.py)
        enable_masked_gqa_sdpa(target, "target")
    for method in methods if skinny_gemm else []:
        if method.drafter is not None:
            enable_skinny_gemm(method.drafter, tune_rows=DEFAULT_TUNE_ROWS)
    prompt_sets = [(prompt_set_label(name), encode_prompt_set(name, count, tokenizer, args.prompt_seed))
                   for name, count in parse_prompt_sets(args.prompt_sets)]  # fmt: skip
    generate_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    if args.do_sample:
        generate_kwargs["temperature"] = args.temperature
    seed = args.seed if args.do_sample else None
    generations = run_interleaved(target, methods, prompt_sets, generate_kwargs, seed, not args.no_progress)
    failures = [] if args.do_sample else check_lossless(generations)
    add_logit_gaps(target, prompt_sets, generations, failures)
    rows = summarize(generations, methods, failures, greedy=not args.do_sample)
    paired = paired_tau_table([asdict(g) for g in generations], args.baseline) if args.baseline else []
    run_info = {
        "target": args.target,
        "dtype": args.dtype,
        "device": str(target.device),
        "num_threads": torch.get_num_threads(),
        "decoding": f"sampling (temperature={args.temperature}, seed={args.seed})" if args.do_sample else "greedy",
        "max_new_tokens": args.max_new_tokens,
        "draft_logits_dtype": args.draft_logits_dtype,
        "skinny_gemm": skinny_gemm,
        "skinny_gemm_tune_rows": DEFAULT_TUNE_ROWS if skinny_gemm else 0,
        "methods": [asdict(m.spec) for m in methods],
        "prompt_sets": args.prompt_sets,
        "prompt_seed": args.prompt_seed,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    output_dir = Path(args.output_dir)
    write_outputs(output_dir, rows, generations, run_info, failures, paired)
    print(render_markdown(rows, run_info, failures, paired))
    print(f"wrote {output_dir / 'results.json'}, results.md, tau.png, acceptance_histograms.png")
    if failures:
        print("LOSSLESS CHECK FAILED:\n  " + "\n  ".join(map(str, failures)), file=sys.stderr)
        print("(a logit gap of about one bf16 unit in the last place is a near-tie that block and single-token "
              "forwards may break differently; rerun with --dtype fp32 to tell numerics from a bug)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

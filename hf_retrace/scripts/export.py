"""Exports a drafter folder for another inference engine; `--format vllm` writes what vLLM's speculative config
loads as `{"method": "dflash", "model": OUTPUT}` (see `hf_retrace.export.vllm`).

    hf-retrace export --format vllm --drafter model_cards/smollm2-135m-retrace --output runs/retrace-vllm

A drafter with a reduced draft vocabulary needs the target's lm head: `--target DIR` (a causal-LM folder; default
the project's default target, SmolLM2-135M-Instruct). `--dtype float32` keeps an fp32 target's head rows exact.
"""

import argparse

import torch

from ..cli import UsageError, check_exists, exits_on_usage_error


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(args: argparse.Namespace) -> None:
    from ..export.vllm import ExportError, export_for_vllm

    dtype = None if args.dtype == "auto" else _DTYPES[args.dtype]
    try:
        output = export_for_vllm(args.drafter, args.output, args.target, dtype=dtype, overwrite=args.overwrite)
    except (ExportError, FileNotFoundError) as error:
        raise UsageError(str(error)) from error
    print(f"{output}: vLLM drafter folder; speculative_config={{'method': 'dflash', 'model': '{output}'}} loads it")


@exits_on_usage_error("hf-retrace export")
def cli_main(argv: list[str] | None = None) -> int:
    """`hf-retrace export --format vllm --drafter DIR --output DIR [--target DIR] [--dtype D] [--overwrite]`."""
    parser = argparse.ArgumentParser(prog="hf-retrace export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", required=True, choices=["vllm"], help="the engine to export for")
    parser.add_argument("--drafter", required=True, help="a drafter folder")
    parser.add_argument("--output", required=True, help="the folder to write (new or empty, unless --overwrite)")
    parser.add_argument("--target", default=None, help="the target's folder (default: the project's default target)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES], help="float dtype (auto: drafter's)")
    parser.add_argument("--overwrite", action="store_true", help="write into an existing, non-empty --output")
    args = parser.parse_args(argv)
    check_exists(args.drafter, "--drafter", "drafter folder", repo_id_ok=False)
    check_exists(args.target, "--target", "target folder", repo_id_ok=False)
    main(args)
    return 0

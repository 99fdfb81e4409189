# Copyright 2026 the hf_retrace authors. Apache-2.0.

# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "hf-retrace[train,assets]",
#     "trl>=1.16",
#     "peft",
#     "accelerate",
# ]
# ///

"""
Train a DFlash or ReTrace drafter against a frozen target (`docs/training.md`).

# Tiny smoke run (seeded tiny random Qwen3 target, synthetic data; seconds on CPU)
```bash
python training/train.py --config training/recipes/tiny.yaml
accelerate launch --config_file training/accelerate_configs/cpu_2proc.yaml training/train.py \
    --config training/recipes/tiny.yaml
```

# SmolLM2-135M: DFlash from scratch, then ReTrace from that drafter (2 CPU cores)
```bash
python training/train.py --config training/recipes/smollm2-135m-dflash.yaml
python training/train.py --config training/recipes/smollm2-135m-retrace.yaml
```

# Paper setting (Qwen3-4B target, z-lab DFlash-b16 drafter init; GPUs)
```bash
accelerate launch --config_file training/accelerate_configs/zero2.yaml training/train.py \
    --config training/recipes/qwen3-4b-retrace.yaml
```

# LoRA on the drafter backbone (ReTrace modules train fully)
```bash
python training/train.py --config training/recipes/tiny.yaml --use_peft --lora_r 8 \
    --drafter_name_or_path <dflash drafter folder>
```

Any recipe field may be overridden on the command line (`--max_steps 10`). Unknown recipe fields are an error.
`hf-retrace train --config ...` runs the same code (`hf_retrace.scripts.train`).
"""

from hf_retrace.scripts.train import ReTraceScriptArguments, cli_main, main, make_parser


__all__ = ["ReTraceScriptArguments", "cli_main", "main", "make_parser"]  # what tests and wrappers use


if __name__ == "__main__":
    raise SystemExit(cli_main())

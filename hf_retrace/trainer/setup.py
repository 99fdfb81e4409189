# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Model set-up for training: the frozen target, the drafter to train, and a tiny synthetic data set for tests."""

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from .drafter_init import add_target_layers, grow_drafter_depth, init_drafter_from_target
from ..models.modeling_retrace import ReTraceDrafterModel
from .config import ReTraceConfig


TINY_TARGET_NAME = "tiny-random-qwen3"
TINY_TARGET_CONFIG = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, eos_token_id=None,
)  # fmt: skip


def build_tiny_target(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    """A seeded random tiny Qwen3 (vocab 128, hidden 32, 4 layers): the target of tests and the tiny recipe."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**TINY_TARGET_CONFIG, **overrides})).eval()


def load_target(name_or_path: str, dtype: str = "bfloat16", init_kwargs: dict | None = None):
    """Loads the frozen target and its tokenizer.

    Args:
        name_or_path (`str`): `"default"` ([`hf_retrace.data.assets.load_default_target`], offline
            SmolLM2-135M-Instruct), `"tiny-random-qwen3"` ([`build_tiny_target`], no tokenizer), or a path/Hub id.
        dtype (`str`): `"auto"`, `"float32"`, `"bfloat16"` or `"float16"`.
        init_kwargs (`dict`, *optional*): more `from_pretrained` arguments for a path/Hub id target
            (`ReTraceConfig.target_model_init_kwargs`).
    Returns:
        `(target, tokenizer)`; the target in eval mode with `requires_grad=False`; tokenizer `None` for the tiny
        target.
    """
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    if init_kwargs and name_or_path in ("default", TINY_TARGET_NAME):
        raise ValueError(f"target_model_init_kwargs apply to path/Hub targets, not to {name_or_path!r}")
    if name_or_path == "default":
        from ..data.assets import load_default_target  # needs the optional `assets` extra

        target, tokenizer = load_default_target(dtype=torch.bfloat16 if torch_dtype == "auto" else torch_dtype)
    elif name_or_path == TINY_TARGET_NAME:
        target, tokenizer = build_tiny_target(), None
        if torch_dtype != "auto":
            target = target.to(torch_dtype)
    else:
        target = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **(init_kwargs or {}))
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    return target.eval().requires_grad_(False), tokenizer


def init_drafter(args: ReTraceConfig, target, model_name_or_path: str | None = None) -> ReTraceDrafterModel:
    """The drafter to train, in float32 (optimizer master weights; use `bf16=True` for mixed precision).

    `args.drafter_name_or_path` (or `model_name_or_path`) loads a ReTrace folder or a z-lab DFlash checkpoint (ReTrace
    modules then start with `W_v = 0`); otherwise a fresh drafter is sized from `target` with `drafter_num_layers`,
    `drafter_target_layer_ids`, `drafter_mask_token_id` and `block_size` (16 if unset), then warm-started from the
    target if `args.drafter_init == "target"` ([`init_drafter_from_target`]). A loaded drafter takes `block_size`
    when set: B sizes no parameter (slots differ only by their RoPE position), so a B = 16 drafter can be fine-tuned
    at B = 8; it must be: run at B = 8 untrained, the SmolLM2 B = 16 drafter's tau fell from 1.41 to 1.13
    (results/verification.md).
    `args.drafter_grow_layers` then deepens a loaded drafter without changing its outputs ([`grow_drafter_depth`]),
    and `args.drafter_target_layer_ids`, a superset of its layers, makes it read more target layers
    ([`add_target_layers`]).
    """
    path = args.drafter_name_or_path or model_name_or_path
    if path is not None:
        overrides = {"block_size": args.block_size} if args.block_size is not None else {}
        drafter = ReTraceDrafterModel.from_pretrained(path, dtype=torch.float32, **overrides)
        if args.drafter_grow_layers:
            grow_drafter_depth(drafter, args.drafter_grow_layers)
        if args.drafter_target_layer_ids is not None and list(args.drafter_target_layer_ids) != list(
            drafter.config.target_layer_ids
        ):
            add_target_layers(drafter, list(args.drafter_target_layer_ids))
    else:
        overrides = dict(num_hidden_layers=args.drafter_num_layers, block_size=args.block_size or 16)
        if args.drafter_anchor_broadcast:
            overrides["anchor_broadcast"] = True
        if args.drafter_target_layer_ids is not None:
            overrides["target_layer_ids"] = list(args.drafter_target_layer_ids)
        if args.drafter_mask_token_id is not None:
            overrides["mask_token_id"] = args.drafter_mask_token_id
        torch.manual_seed(args.seed)
        drafter = ReTraceDrafterModel.from_target(target, **overrides)
        if args.drafter_init == "target":
            init_drafter_from_target(drafter, target)
    return drafter.to(torch.float32)


@torch.no_grad()
def synthetic_dataset(
    target, num_examples: int = 64, prompt_length: int = 8, response_length: int = 24, seed: int = 0
) -> Dataset:
    """Random prompts answered greedily by `target` itself (the DFlash recipe trains on the target's own outputs).

    Returns:
        `Dataset` with `input_ids` (prompt + response) and `loss_mask` (1 on response tokens), all the same length.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.get_text_config().vocab_size
    prompts = torch.randint(1, vocab, (num_examples, prompt_length), generator=generator)
    out = target.generate(
        prompts.to(target.device), attention_mask=torch.ones_like(prompts).to(target.device),
        max_new_tokens=response_length, min_new_tokens=response_length, do_sample=False, pad_token_id=0,
    ).cpu()  # fmt: skip
    loss_mask = torch.zeros_like(out)
    loss_mask[:, prompt_length:] = 1
    return Dataset.from_dict({"input_ids": out.tolist(), "loss_mask": loss_mask.tolist()})


__all__ = ["TINY_TARGET_NAME", "build_tiny_target", "init_drafter", "load_target", "synthetic_dataset"]

"""Masked attention on the key/value heads for CPU verification forwards.

A verification forward runs `R > 1` query rows against the cached context, so transformers' sdpa attention needs a
causal mask for it. With a mask, transformers does not hand grouped-query attention to torch
(`enable_gqa`, which reads each key/value head once for its group of query heads): it first copies every key/value
head to each of its query heads (`repeat_kv`), the whole cached context, in every layer. A one-row decoding step has
no mask and takes torch's GQA path. On the 2-core AVX-512 host, SmolLM2-135M (9 query heads, 3 key/value heads) with
1,000 cached tokens spends ~12 ms a forward in those copies: a 4-row forward takes 87 ms against 75 ms without them,
and an 8-row one 100 ms against 79 ms (`benchmarks/verification_rows.py`).

torch's CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`) takes a mask and `enable_gqa` together, and
transformers has a switch that lets it: the environment variable `TRANSFORMERS_SDPA_FORCE_GQA=1`, read at every
attention call. [`enable_masked_gqa_sdpa`] sets it where it applies. The products are the same; only their
summation order may differ, like any change of kernel, so greedy speculative output stays the target's (tested).
"""

import os

from transformers.utils import logging


logger = logging.get_logger(__name__)


FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


def masked_gqa_skip_reason(model) -> str | None:
    """Why masked GQA attention would not apply to `model` (`None`: it would): it needs a CPU model with sdpa
    attention and fewer key/value heads than query heads."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"its attention is {getattr(config, '_attn_implementation', None)!r}, not sdpa"
    if {p.device.type for p in model.parameters()} != {"cpu"}:
        return "it is not on the CPU only"
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads is None or kv_heads >= heads:
        return f"it has as many key/value heads as query heads ({kv_heads} and {heads})"
    return None


def enable_masked_gqa_sdpa(model, name: str = "model") -> bool:
    """Lets transformers run `model`'s masked sdpa attention with torch's `enable_gqa` (module docstring), by setting
    `TRANSFORMERS_SDPA_FORCE_GQA=1` for this process. A value the user already set is kept, and a model it does not
    apply to leaves the environment as it is.

    Args:
        model: a transformers causal LM (the target of a speculative `generate`).
        name: what the log calls the model.
    Returns:
        Whether the switch is on for this process now.
    """
    reason = masked_gqa_skip_reason(model)
    if reason is not None:
        logger.info(f"masked GQA attention not turned on for the {name}: {reason}")
        return os.environ.get(FORCE_GQA_ENV) == "1"
    os.environ.setdefault(FORCE_GQA_ENV, "1")
    return os.environ[FORCE_GQA_ENV] == "1"


__all__ = ["FORCE_GQA_ENV", "enable_masked_gqa_sdpa", "masked_gqa_skip_reason"]

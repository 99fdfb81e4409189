# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports transformers and `.policy_settings_retrace` only, so `trust_remote_code=True` loads it.
"""The drafter's decoding settings: its `GenerationConfig` (`generation_config.json` beside the weights), as
transformers keeps an assistant's `num_assistant_tokens` in `assistant_model.generation_config`.

Keys (all optional in the file; a missing key or `null` takes the value in `DECODING_DEFAULTS`, which
`policy_settings_retrace` builds from the drafter's own settings and the registered candidate sources):

| key | meaning | unset |
|---|---|---|
| `num_assistant_tokens` | `k`, drafts verified per block, in `[1, block_size - 1]` | all `block_size - 1` |
| `assistant_confidence_threshold` | verify only the leading drafts whose top-1 probability reaches it | no stop |
| `prompt_lookup_num_tokens` | prompt lookup in front of the drafter, at most this many candidates | off |
| `max_matching_ngram_size`, `prompt_lookup_min_ngram_size` | n-gram sizes prompt lookup tries, longest first | 3, 2 |
| `datastore_num_tokens` | datastore lookup behind prompt lookup (needs `datastore.safetensors`) | off |
| `datastore_max_ngram_size`, `datastore_min_ngram_size` | n-gram sizes the datastore indexes | 6, 3 |
| `draft_logits_dtype` | dtype of the lm-head copy that scores drafts (`"float32"`, `"bfloat16"`, ...) | target's |

"Unset" is `None`, never transformers' global defaults: `GenerationConfig()` leaves `num_assistant_tokens` and
`assistant_confidence_threshold` at `None` and only `generate` fills in 20 and 0.4 (`_get_default_generation_params`)
on the TARGET's call config. The drafter's config is read as stored, so a drafter without a confidence stop has none.

`generate(...)` overrides for one call: the four transformers names (`num_assistant_tokens`,
`assistant_confidence_threshold`, `prompt_lookup_num_tokens`, `max_matching_ngram_size`) as keyword arguments, any key
through `generate(generation_config=...)`. A call value counts when it is not `None` and differs from transformers'
global default, since `generate` has already filled those in and a value equal to it cannot be told from one nobody
passed (to use 0.4 as the confidence stop, set it on `drafter.generation_config`).
"""

from transformers import GenerationConfig

from .policy_settings_retrace import (
    DECODING_DEFAULTS,
    DRAFT_LOGITS_DTYPES,
    ReTraceDecodingSettings,
    resolve_settings,
)


def drafter_generation_config(**settings) -> GenerationConfig:
    """A drafter's `GenerationConfig`: `DECODING_DEFAULTS` with `settings` (keys of `DECODING_DEFAULTS`) on top."""
    unknown = sorted(settings.keys() - DECODING_DEFAULTS.keys())
    if unknown:
        raise ValueError(f"unknown drafter decoding settings {unknown}; known: {sorted(DECODING_DEFAULTS)}")
    return GenerationConfig(**{**DECODING_DEFAULTS, **settings})


def check_no_settings_on_config(config) -> None:
    """Raises `ValueError` when a decoding setting was set on the model config (it would do nothing there)."""
    misplaced = sorted(key for key in DECODING_DEFAULTS if key in vars(config))
    if misplaced:
        raise ValueError(
            f"{misplaced} set on drafter.config, which describes the network only: decoding settings live in "
            f"drafter.generation_config (set `drafter.generation_config.{misplaced[0]} = ...` instead; the datastore "
            "with `drafter.set_datastore(responses)`), or pass transformers' names to `generate(...)` for one call."
        )


def resolve_decoding_settings(
    drafter_generation_config: GenerationConfig,
    block_size: int,
    has_datastore: bool,
    call_generation_config: GenerationConfig | None = None,
) -> ReTraceDecodingSettings:
    """The validated settings of one call (module docstring: defaults, overrides, what "unset" means).

    Args:
        drafter_generation_config ([`GenerationConfig`]): the drafter's (`drafter.generation_config`).
        block_size (`int`): the drafter's `config.block_size`.
        has_datastore (`bool`): whether the drafter holds a datastore (needed by `datastore_num_tokens`).
        call_generation_config ([`GenerationConfig`], *optional*): the `generate` call's, defaults filled in.
    Raises:
        `ValueError` naming the setting and its valid range.
    """
    values = {key: getattr(drafter_generation_config, key, None) for key in DECODING_DEFAULTS}
    given = _call_overrides(call_generation_config) if call_generation_config is not None else {}
    values.update(given)
    if "max_matching_ngram_size" in given:  # a smaller longest n-gram given to `generate` lowers the shortest
        shortest = values["prompt_lookup_min_ngram_size"]
        shortest = DECODING_DEFAULTS["prompt_lookup_min_ngram_size"] if shortest is None else shortest
        values["prompt_lookup_min_ngram_size"] = min(shortest, given["max_matching_ngram_size"])
    available = frozenset({"datastore"} if has_datastore else ())
    return resolve_settings(values, block_size, available)


def _call_overrides(call_generation_config: GenerationConfig) -> dict:
    global_defaults = call_generation_config._get_default_generation_params()
    overrides = {}
    for key in DECODING_DEFAULTS:
        value = getattr(call_generation_config, key, None)
        if value is not None and (key not in global_defaults or value != global_defaults[key]):
            overrides[key] = value
    return overrides


__all__ = [
    "DECODING_DEFAULTS",
    "DRAFT_LOGITS_DTYPES",
    "ReTraceDecodingSettings",
    "check_no_settings_on_config",
    "drafter_generation_config",
    "resolve_decoding_settings",
]

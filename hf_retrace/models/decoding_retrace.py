# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports transformers only, so `trust_remote_code=True` loads it.
"""The drafter's decoding settings: its `GenerationConfig` (`generation_config.json` beside the weights), as
transformers keeps an assistant's `num_assistant_tokens` in `assistant_model.generation_config`.

Keys (all optional in the file; a missing key or `null` takes the value in `DECODING_DEFAULTS`):

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

import warnings
from dataclasses import dataclass

from transformers import GenerationConfig


DRAFT_LOGITS_DTYPES = (None, "float32", "bfloat16", "float16")
DECODING_DEFAULTS = {
    "num_assistant_tokens": None,
    "assistant_confidence_threshold": None,
    "prompt_lookup_num_tokens": None,
    "max_matching_ngram_size": 3,
    "prompt_lookup_min_ngram_size": 2,
    "datastore_num_tokens": None,
    "datastore_max_ngram_size": 6,
    "datastore_min_ngram_size": 3,
    "draft_logits_dtype": None,
}
# config.json keys of checkpoints from before generation_config.json, and where each one went
LEGACY_CONFIG_KEYS = {
    **{key: key for key in DECODING_DEFAULTS if key != "max_matching_ngram_size"},
    "prompt_lookup_max_ngram_size": "max_matching_ngram_size",
}


@dataclass(frozen=True)
class ReTraceDecodingSettings:
    """The settings one `generate` call runs with: the drafter's `generation_config`, the call's overrides, defaults.

    Attributes:
        num_assistant_tokens (`int`): `k`, drafts verified per block (`block_size - 1` when unset).
        assistant_confidence_threshold (`float`, *optional*): the confidence stop, or `None`.
        prompt_lookup_num_tokens (`int`, *optional*), max_matching_ngram_size (`int`),
            prompt_lookup_min_ngram_size (`int`): prompt lookup, off when the first is `None`.
        datastore_num_tokens (`int`, *optional*), datastore_max_ngram_size (`int`), datastore_min_ngram_size (`int`):
            datastore lookup, off when the first is `None`.
        draft_logits_dtype (`str`, *optional*): dtype of the draft lm head, `None` for the target's own.
    """

    num_assistant_tokens: int
    assistant_confidence_threshold: float | None
    prompt_lookup_num_tokens: int | None
    max_matching_ngram_size: int
    prompt_lookup_min_ngram_size: int
    datastore_num_tokens: int | None
    datastore_max_ngram_size: int
    datastore_min_ngram_size: int
    draft_logits_dtype: str | None


def drafter_generation_config(**settings) -> GenerationConfig:
    """A drafter's `GenerationConfig`: `DECODING_DEFAULTS` with `settings` (keys of `DECODING_DEFAULTS`) on top."""
    unknown = sorted(settings.keys() - DECODING_DEFAULTS.keys())
    if unknown:
        raise ValueError(f"unknown drafter decoding settings {unknown}; known: {sorted(DECODING_DEFAULTS)}")
    return GenerationConfig(**{**DECODING_DEFAULTS, **settings})


def pop_legacy_settings(config) -> tuple[dict, int | None]:
    """Removes what an old `config.json` carries beyond the network from `config` (it loads as plain attributes):
    the decoding settings and `datastore_size`, the length of the datastore then stored in model.safetensors.

    Returns:
        `(settings, datastore_size)`: the settings under their `generation_config` names (`{}` for a new config) and
        the old datastore length (`None` for a new config); one deprecation warning when either is there.
    """
    found = {key: vars(config).pop(key) for key in LEGACY_CONFIG_KEYS if key in vars(config)}
    datastore_size = vars(config).pop("datastore_size", None)
    if not found and datastore_size is None:
        return {}, None
    warnings.warn(
        "This drafter's config.json carries decoding settings "
        f"({', '.join(sorted(found)) or 'none'}{', datastore_size' if datastore_size is not None else ''}); they now "
        "live in the drafter's generation_config (generation_config.json) and the datastore in datastore.safetensors. "
        "They were moved over for this load; re-save the drafter with `save_pretrained` to write the new layout.",
        FutureWarning,
        stacklevel=3,
    )
    return {LEGACY_CONFIG_KEYS[key]: value for key, value in found.items()}, datastore_size


def check_no_settings_on_config(config) -> None:
    """Raises `ValueError` when a decoding setting was set on the model config after loading (it would do nothing)."""
    misplaced = sorted(key for key in (*LEGACY_CONFIG_KEYS, "datastore_size") if key in vars(config))
    if misplaced:
        names = [LEGACY_CONFIG_KEYS.get(key, key) for key in misplaced]
        raise ValueError(
            f"{misplaced} set on drafter.config, which describes the network only: decoding settings live in "
            f"drafter.generation_config (set `drafter.generation_config.{names[0]} = ...` instead; the datastore with "
            "`drafter.set_datastore(responses)`), or pass transformers' names to `generate(...)` for one call."
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
    values = {key: DECODING_DEFAULTS[key] if value is None else value for key, value in values.items()}
    if "max_matching_ngram_size" in given:  # a smaller longest n-gram given to `generate` lowers the shortest
        shortest = values["prompt_lookup_min_ngram_size"]
        values["prompt_lookup_min_ngram_size"] = min(shortest, given["max_matching_ngram_size"])
    _check(values, block_size, has_datastore)
    if values["num_assistant_tokens"] is None:
        values["num_assistant_tokens"] = block_size - 1
    return ReTraceDecodingSettings(**values)


def _call_overrides(call_generation_config: GenerationConfig) -> dict:
    global_defaults = call_generation_config._get_default_generation_params()
    overrides = {}
    for key in DECODING_DEFAULTS:
        value = getattr(call_generation_config, key, None)
        if value is not None and (key not in global_defaults or value != global_defaults[key]):
            overrides[key] = value
    return overrides


def _check(values: dict, block_size: int, has_datastore: bool) -> None:
    k, t = values["num_assistant_tokens"], values["assistant_confidence_threshold"]
    if k is not None and not 1 <= k <= block_size - 1:
        raise ValueError(
            f"num_assistant_tokens must be in [1, block_size - 1 = {block_size - 1}] (drafts verified per block) or "
            f"None (all of them), got {k}"
        )
    if t is not None and not 0.0 < t <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be in (0, 1] or None (no confidence stop), got {t}")
    if values["draft_logits_dtype"] not in DRAFT_LOGITS_DTYPES:
        dtype = values["draft_logits_dtype"]
        raise ValueError(f"draft_logits_dtype must be one of {DRAFT_LOGITS_DTYPES}, got {dtype!r}")
    _check_ngram_lookup("prompt_lookup_num_tokens", values["prompt_lookup_num_tokens"], "max_matching_ngram_size",
                        values["max_matching_ngram_size"], "prompt_lookup_min_ngram_size",
                        values["prompt_lookup_min_ngram_size"])  # fmt: skip
    _check_ngram_lookup("datastore_num_tokens", values["datastore_num_tokens"], "datastore_max_ngram_size",
                        values["datastore_max_ngram_size"], "datastore_min_ngram_size",
                        values["datastore_min_ngram_size"])  # fmt: skip
    if values["datastore_num_tokens"] is not None and not has_datastore:
        raise ValueError(
            "datastore_num_tokens is set but the drafter has no datastore (no datastore.safetensors): attach one with "
            "`drafter.set_datastore(responses)` or `hf-retrace datastore`, or set "
            "drafter.generation_config.datastore_num_tokens = None"
        )


def _check_ngram_lookup(num_name: str, num_tokens, max_name: str, max_size: int, min_name: str, min_size: int) -> None:
    """The checks prompt lookup and datastore lookup share."""
    if num_tokens is not None and num_tokens < 1:
        raise ValueError(f"{num_name} must be >= 1 or None (turned off), got {num_tokens}")
    if not 1 <= min_size <= max_size:
        raise ValueError(f"{num_name.split('_num')[0].replace('_', ' ')} needs 1 <= {min_name} <= {max_name}, got "
                         f"min {min_size} and max {max_size}")  # fmt: skip


__all__ = [
    "DECODING_DEFAULTS",
    "DRAFT_LOGITS_DTYPES",
    "LEGACY_CONFIG_KEYS",
    "ReTraceDecodingSettings",
    "check_no_settings_on_config",
    "drafter_generation_config",
    "pop_legacy_settings",
    "resolve_decoding_settings",
]

# Copied from hf_retrace/models/policy_settings_retrace.py by utils/check_copies.py --fix; edit the original.
# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Shared policy file: imports numpy, the standard library and `.sources_retrace` only. It is a Hub file and the vLLM
# plugin's copy (`integrations/vllm/hf_retrace_vllm/shared/`, kept identical by `utils/check_copies.py`).
"""The drafting policy's settings, one definition for both engines: the names and defaults (the drafter's own, then
one setting and its options per registered [`CandidateSource`]), their checks, the names of the vLLM export's
`hf_retrace` block, the ReTrace modes, the speculation policies and the confidence stop.

The transformers side reads the settings from the drafter's `generation_config` (`decoding_retrace`); the vLLM
plugin from the `hf_retrace` block of an exported folder's `config.json` (`docs/formats.md`).
"""

from collections.abc import Mapping

import numpy as np

from .sources_retrace import CandidateSource


RETRACE_MODES = ("off", "overwrite", "gated", "corrected")
DRAFT_LOGITS_DTYPES = (None, "float32", "bfloat16", "float16")
# "goodput": the cost-aware choice of source and verified tokens per step; "fixed": the first source that proposes,
# else `num_assistant_tokens` drafts and the confidence stop (`speculation_retrace`, docs/cost-aware-speculation.md)
SPECULATION_POLICIES = ("goodput", "fixed")
# The drafter's own settings (`None` = unset); the sources' come from the registry. `draft_logits_dtype` is not
# exported: in vLLM the draft head runs in the engine's dtype.
DRAFTER_DEFAULTS = {"num_assistant_tokens": None, "assistant_confidence_threshold": None, "draft_logits_dtype": None,
                    "speculation_policy": "fixed"}  # fmt: skip
NOT_EXPORTED = ("draft_logits_dtype",)


class _RegistryDefaults(Mapping):
    """`{setting: default}` of the drafter's settings and every registered source's, read from the registry on each
    access, so a source registered later is in it."""

    def _items(self) -> dict:
        items = dict(DRAFTER_DEFAULTS)
        for source in CandidateSource.registry:
            items.update({source.setting: None, **source.options})
        return items

    def __getitem__(self, key):
        return self._items()[key]

    def __iter__(self):
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


DECODING_DEFAULTS: Mapping = _RegistryDefaults()


class ReTraceDecodingSettings:
    """The validated settings one engine runs with (every key of `DECODING_DEFAULTS`), read by attribute; frozen.

    Attributes:
        num_assistant_tokens (`int`): `k`, drafts verified per block (`block_size - 1` when unset).
        assistant_confidence_threshold (`float`, *optional*): the confidence stop, or `None`.
        draft_logits_dtype (`str`, *optional*): dtype of the draft lm head, `None` for the target's own.
        speculation_policy (`str`): `"goodput"` (cost-aware; the token counts above and below are caps) or `"fixed"`.
        and per registered source its `setting` (`None` = off) and `options`: prompt lookup
            (`prompt_lookup_num_tokens`, `max_matching_ngram_size`, `prompt_lookup_min_ngram_size`), datastore lookup
            (`datastore_num_tokens`, `datastore_max_ngram_size`, `datastore_min_ngram_size`), the online datastore
            (`online_datastore_num_tokens`, `online_datastore_max_bytes`).
    """

    def __init__(self, values: dict):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"no decoding setting {name!r}") from None

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("decoding settings are frozen: change the drafter's generation_config instead")

    def __eq__(self, other) -> bool:
        return isinstance(other, ReTraceDecodingSettings) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return f"ReTraceDecodingSettings({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def as_dict(self) -> dict:
        return dict(self._values)


def resolve_settings(values: dict, block_size: int, available: frozenset = frozenset()) -> ReTraceDecodingSettings:
    """The checked settings from `values` (a missing key or `None` takes its default; unknown keys are refused).

    Args:
        values (`dict`): decoding settings by name.
        block_size (`int`): the drafter's block, `B`; `num_assistant_tokens` unset becomes `B - 1`.
        available (`frozenset[str]`): what the engine holds for its sources (`{"datastore"}` with a datastore).
    Raises:
        `ValueError` naming the setting and its valid range.
    """
    unknown = sorted(values.keys() - DECODING_DEFAULTS.keys())
    if unknown:
        raise ValueError(f"unknown drafter decoding settings {unknown}; known: {sorted(DECODING_DEFAULTS)}")
    values = {key: values.get(key) for key in DECODING_DEFAULTS}
    values = {key: DECODING_DEFAULTS[key] if value is None else value for key, value in values.items()}
    check_settings(values, block_size, available)
    if values["num_assistant_tokens"] is None:
        values["num_assistant_tokens"] = block_size - 1
    return ReTraceDecodingSettings(values)


def check_settings(values: dict, block_size: int, available: frozenset = frozenset()) -> None:
    """Raises `ValueError` for a bad value among `values` (every key of `DECODING_DEFAULTS`, defaults filled in)."""
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
    if values["speculation_policy"] not in SPECULATION_POLICIES:
        policy = values["speculation_policy"]
        raise ValueError(f"speculation_policy must be one of {SPECULATION_POLICIES}, got {policy!r}")
    for source in CandidateSource.registry:
        source.check(values)
        if values[source.setting] is not None and source.needs is not None and source.needs not in available:
            raise ValueError(
                f"{source.setting} is set but the drafter has no {source.needs} (no {source.needs}.safetensors): "
                f"attach one with `drafter.set_{source.needs}(responses)` or `hf-retrace {source.needs}` (then "
                f"export again for vLLM), or set {source.setting} = None"
            )


def export_names() -> dict[str, str]:
    """`{setting: name in the export's hf_retrace block}` of every exported setting, in `DECODING_DEFAULTS` order."""
    renamed = {key: name for source in CandidateSource.registry for key, name in source.export_names.items()}
    return {key: renamed.get(key, key) for key in DECODING_DEFAULTS if key not in NOT_EXPORTED}


def export_policy(settings: ReTraceDecodingSettings) -> dict:
    """The policy part of the export's `hf_retrace` block: every exported setting under its block name."""
    return {name: getattr(settings, key) for key, name in export_names().items()}


def settings_from_export(block: dict, block_size: int, available: frozenset = frozenset()) -> ReTraceDecodingSettings:
    """The checked settings of an export's `hf_retrace` block, which must hold every key [`export_policy`] writes.

    Raises:
        `ValueError` naming the missing keys or the bad value.
    """
    names = export_names()
    missing = [name for name in names.values() if name not in block]
    if missing:
        raise ValueError(
            f"the hf_retrace block lacks {missing}: it was exported by another hf-retrace version; export the "
            "folder again with `hf-retrace export --format vllm`"
        )
    return resolve_settings({key: block[name] for key, name in names.items()}, block_size, available)


def num_confident(confidence: np.ndarray, threshold: float) -> np.ndarray:
    """The confidence stop (transformers' `assistant_confidence_threshold`): how many leading draft slots have a
    top-1 draft probability of at least `threshold`, so a cycle verifies no more tokens than its drafter believes in.

    The confidence of slot `j` is the drafter's top-1 probability there: for greedy drafts, the drafted token's
    probability. Under sampling it does not depend on the sampled token (DFlash computes every slot's distribution in
    one forward), which keeps speculative sampling exact; a stop that looked at the sampled token's own probability
    would bias it.

    Args:
        confidence (`np.ndarray` of shape `(..., k)`): per slot, the top-1 draft probability.
        threshold (`float`): in `(0, 1]`.
    Returns:
        `np.ndarray` of shape `(...)`, int: the leading confident slots, in `[0, k]`.
    """
    return np.cumprod(np.asarray(confidence) >= threshold, axis=-1).sum(axis=-1)


__all__ = [
    "DECODING_DEFAULTS", "DRAFT_LOGITS_DTYPES", "RETRACE_MODES", "SPECULATION_POLICIES", "ReTraceDecodingSettings",
    "check_settings",
    "export_names", "export_policy", "num_confident", "resolve_settings", "settings_from_export",
]  # fmt: skip

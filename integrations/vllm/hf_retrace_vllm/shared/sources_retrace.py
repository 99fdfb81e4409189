# Copied from hf_retrace/models/sources_retrace.py by utils/check_copies.py --fix; edit the original.
# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Shared policy file: imports numpy, the standard library and `.lookup_retrace` only. It is a Hub file and the vLLM
# plugin's copy (`integrations/vllm/hf_retrace_vllm/shared/`, kept identical by `utils/check_copies.py`).
"""Candidate sources: cheap proposals tried before the drafter, in priority order, one class each.

Each cycle an engine asks its sources in turn (prompt lookup, then the datastore); the first that proposes anything
is verified, and the drafter skips that cycle. Where none does, the drafter drafts. A source needs no model forward
and sees only the committed tokens, as a numpy array, so both engines (transformers and the vLLM plugin) run these
very classes.

A new source is one subclass of [`CandidateSource`]: its `name`, its `priority`, the `setting` that turns it on and
its other `options` with their defaults. Subclasses register themselves, and the registry drives everything else: the
decoding settings and their checks (`policy_settings_retrace`), the vLLM export's policy block, the offline replay
and the plugin's proposer.
"""

import numpy as np

from .lookup_retrace import NgramDatastore, prompt_lookup


class CandidateSource:
    """Proposes candidate tokens from the committed ones, or nothing.

    Class attributes of a subclass:
        name (`str`): the key of its cycles in the engines' statistics.
        priority (`int`): sources are asked in increasing priority; the drafter comes after all of them.
        setting (`str`): the decoding setting that turns the source on and caps its proposal (`None` = off).
        options (`dict[str, int]`): its other decoding settings, with their defaults.
        export_names (`dict[str, str]`): settings named otherwise in the vLLM export's `hf_retrace` block.
        needs (`str`, *optional*): what the engine must hold for the source to run (`"datastore"`).
    """

    name: str
    priority: int
    setting: str
    options: dict = {}
    export_names: dict = {}
    needs: str | None = None
    registry: list[type["CandidateSource"]] = []  # every subclass, in priority order

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        CandidateSource.registry.append(cls)
        CandidateSource.registry.sort(key=lambda source: source.priority)

    def __init__(self, settings, resources):
        """Args:
        settings: the validated decoding settings (`ReTraceDecodingSettings`), read by attribute.
        resources: what the engine holds for its sources (the drafter; the plugin's datastore folder).
        """
        self.num_tokens = getattr(settings, self.setting)

    @classmethod
    def check(cls, values: dict) -> None:
        """Raises `ValueError` naming a bad value among `values` (every decoding setting, defaults filled in)."""
        num_tokens = values[cls.setting]
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"{cls.setting} must be >= 1 or None (turned off), got {num_tokens}")

    def propose(self, tokens: np.ndarray, max_tokens: int) -> list[int] | None:
        """Args:
            tokens (`np.ndarray` of shape `(T,)`): the committed tokens, prompt and output.
            max_tokens (`int`): room left before the length limit, at least 1.
        Returns:
            `list[int]` of `1 <= m <= min(max_tokens, its setting)` tokens, or `None`.
        """
        raise NotImplementedError


def _check_ngram_sizes(cls, values: dict, max_name: str, min_name: str) -> None:
    """The n-gram size check prompt lookup and datastore lookup share."""
    if not 1 <= values[min_name] <= values[max_name]:
        raise ValueError(f"{cls.name.replace('_', ' ')} needs 1 <= {min_name} <= {max_name}, got "
                         f"min {values[min_name]} and max {values[max_name]}")  # fmt: skip


class PromptLookupSource(CandidateSource):
    """Prompt lookup (`prompt_lookup_num_tokens`, n-grams of `max_matching_ngram_size` down to
    `prompt_lookup_min_ngram_size`): see [`prompt_lookup`]."""

    name, priority, setting = "prompt_lookup", 10, "prompt_lookup_num_tokens"
    options = {"max_matching_ngram_size": 3, "prompt_lookup_min_ngram_size": 2}
    export_names = {"max_matching_ngram_size": "prompt_lookup_max_ngram_size"}

    def __init__(self, settings, resources):
        super().__init__(settings, resources)
        self.ngram_sizes = (settings.max_matching_ngram_size, settings.prompt_lookup_min_ngram_size)

    @classmethod
    def check(cls, values: dict) -> None:
        super().check(values)
        _check_ngram_sizes(cls, values, "max_matching_ngram_size", "prompt_lookup_min_ngram_size")

    def propose(self, tokens: np.ndarray, max_tokens: int) -> list[int] | None:
        return prompt_lookup(tokens, min(self.num_tokens, max_tokens), *self.ngram_sizes)


class DatastoreSource(CandidateSource):
    """Datastore lookup (REST; `datastore_num_tokens`): the walk of an [`NgramDatastore`] over the drafter's
    `datastore.safetensors`, which `resources.datastore(num_tokens, max_ngram_size, min_ngram_size)` builds."""

    name, priority, setting = "datastore", 20, "datastore_num_tokens"
    options = {"datastore_max_ngram_size": 6, "datastore_min_ngram_size": 3}
    needs = "datastore"

    def __init__(self, settings, resources):
        super().__init__(settings, resources)
        sizes = (settings.datastore_max_ngram_size, settings.datastore_min_ngram_size)
        self.index: NgramDatastore = resources.datastore(self.num_tokens, *sizes)

    @classmethod
    def check(cls, values: dict) -> None:
        super().check(values)
        _check_ngram_sizes(cls, values, "datastore_max_ngram_size", "datastore_min_ngram_size")

    def propose(self, tokens: np.ndarray, max_tokens: int) -> list[int] | None:
        return self.index.candidates(tokens, max_tokens)


def source_order() -> list[str]:
    """The names of the registered sources, in the order a cycle asks them."""
    return [cls.name for cls in CandidateSource.registry]


def candidate_sources(settings, resources) -> list[CandidateSource]:
    """The sources `settings` turns on, in the order a cycle asks them, built with `resources` (see
    [`CandidateSource`])."""
    return [cls(settings, resources) for cls in CandidateSource.registry if getattr(settings, cls.setting) is not None]


def propose_from_sources(
    sources: list[CandidateSource], tokens: np.ndarray, max_tokens: int
) -> tuple[CandidateSource | None, list[int] | None]:
    """`(source, tokens)` of the first source in `sources` that proposes, or `(None, None)` when none does (the
    drafter's cycle). `max_tokens` is the room left, at least 1."""
    for source in sources:
        proposal = source.propose(tokens, max_tokens)
        if proposal:
            return source, proposal
    return None, None


__all__ = [
    "CandidateSource", "DatastoreSource", "PromptLookupSource", "candidate_sources", "propose_from_sources",
    "source_order",
]  # fmt: skip

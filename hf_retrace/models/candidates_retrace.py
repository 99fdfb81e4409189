# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch, `.datastore_retrace` and `.decoding_retrace` only, so `trust_remote_code=True` loads it.
"""Candidate sources: cheap proposals tried before the drafter, in priority order, one class each.

Each cycle the ReTrace generator asks its sources in turn (prompt lookup, then the datastore); the first that proposes
anything is verified, and the drafter skips that cycle. Where none does, the drafter drafts. A source needs no model
forward and sees only the committed tokens.

A new source is one subclass of [`CandidateSource`] (its `name`, its `priority` and the `setting` that turns it on,
a key of the drafter's `generation_config`) plus that setting in `decoding_retrace`; subclasses register themselves.
"""

import torch

from .datastore_retrace import NgramDatastore
from .decoding_retrace import ReTraceDecodingSettings


class CandidateSource:
    """Proposes candidate tokens from the committed ones, or nothing.

    Class attributes of a subclass:
        name (`str`): the key of its cycles in `ReTraceGenerationStats.source_cycles`.
        priority (`int`): sources are asked in increasing priority; the drafter comes after all of them.
        setting (`str`): the `ReTraceDecodingSettings` field that turns the source on (`None` = off).
    """

    name: str
    priority: int
    setting: str
    registry: list[type["CandidateSource"]] = []  # every subclass, in priority order

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        CandidateSource.registry.append(cls)
        CandidateSource.registry.sort(key=lambda source: source.priority)

    def __init__(self, drafter, settings: ReTraceDecodingSettings):
        self.num_tokens = getattr(settings, self.setting)

    def propose(self, input_ids: torch.LongTensor, max_tokens: int) -> torch.LongTensor | None:
        """Args:
            input_ids (`torch.LongTensor` of shape `(T,)`): the committed tokens, prompt and output.
            max_tokens (`int`): room left before `max_length`, at least 1.
        Returns:
            `torch.LongTensor` of shape `(m,)`, `1 <= m <= min(max_tokens, its setting)`, or `None`.
        """
        raise NotImplementedError


def candidate_sources(drafter, settings: ReTraceDecodingSettings) -> list[CandidateSource]:
    """The sources `settings` turns on, in the order a cycle asks them."""
    return [cls(drafter, settings) for cls in CandidateSource.registry if getattr(settings, cls.setting) is not None]


class PromptLookupSource(CandidateSource):
    """Prompt lookup (`prompt_lookup_num_tokens`, n-grams of `max_matching_ngram_size` down to
    `prompt_lookup_min_ngram_size`): see [`prompt_lookup_candidates`]."""

    name, priority, setting = "prompt_lookup", 10, "prompt_lookup_num_tokens"

    def __init__(self, drafter, settings: ReTraceDecodingSettings):
        super().__init__(drafter, settings)
        self.ngram_sizes = (settings.max_matching_ngram_size, settings.prompt_lookup_min_ngram_size)

    def propose(self, input_ids: torch.LongTensor, max_tokens: int) -> torch.LongTensor | None:
        return prompt_lookup_candidates(input_ids, min(self.num_tokens, max_tokens), *self.ngram_sizes)


class DatastoreSource(CandidateSource):
    """Datastore lookup (REST; `datastore_num_tokens`): the walk of the drafter's [`NgramDatastore`], the index of
    its `datastore.safetensors`, built on first use."""

    name, priority, setting = "datastore", 20, "datastore_num_tokens"

    def __init__(self, drafter, settings: ReTraceDecodingSettings):
        super().__init__(drafter, settings)
        sizes = (settings.datastore_max_ngram_size, settings.datastore_min_ngram_size)
        self.index: NgramDatastore = drafter.datastore(self.num_tokens, *sizes)

    def propose(self, input_ids: torch.LongTensor, max_tokens: int) -> torch.LongTensor | None:
        return self.index.candidates(input_ids, max_tokens)


def prompt_lookup_candidates(
    input_ids: torch.LongTensor, num_tokens: int, max_ngram_size: int, min_ngram_size: int = 1
) -> torch.LongTensor | None:
    """Prompt lookup (Saxena, 2023): the tokens that followed the earliest earlier occurrence of the context's last
    n-gram, trying `n = max_ngram_size` down to `min_ngram_size`.

    The match rule is transformers' `PromptLookupCandidateGenerator`'s (longest n-gram first, earliest occurrence;
    `tests/test_prompt_lookup.py` compares the two), but that class is not reused, for three reasons. It always goes
    down to `n = 1`, and behind a drafter a one-token match proposes worse drafts than the drafter (a minimum is vLLM's
    `prompt_lookup_min`). It crops candidates at EOS and runs the logits processors once per candidate on made-up
    logits; here the target's verification does both (`_assisted_decoding` crops what it commits at EOS, and the
    target rejects a token its processors forbid). And it is a whole candidate generator (`max_length`, the
    `(ids, None)` protocol), where a source needs one function of the committed tokens.

    Args:
        input_ids (`torch.LongTensor` of shape `(T,)`): the committed tokens, prompt and output.
        num_tokens (`int`): most candidates returned.
        max_ngram_size (`int`), min_ngram_size (`int`): n-gram sizes tried, longest first.
    Returns:
        `torch.LongTensor` of shape `(m,)`, `1 <= m <= num_tokens`, or `None` when no n-gram recurs.
    """
    length = input_ids.shape[0]
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = input_ids.unfold(0, n, 1)[:-1]  # [T - n, n]: window i is ids[i : i+n], all but the last n-gram
        matches = (windows == input_ids[-n:]).all(dim=1).nonzero()  # [M, 1]
        if len(matches):  # window i ends at i+n-1 <= T-2, so at least one token follows it
            start = int(matches[0, 0]) + n
            return input_ids[start : start + num_tokens]
    return None


__all__ = ["CandidateSource", "DatastoreSource", "PromptLookupSource", "candidate_sources", "prompt_lookup_candidates"]

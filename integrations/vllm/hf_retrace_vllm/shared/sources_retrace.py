# Copied from hf_retrace/models/sources_retrace.py by utils/check_copies.py --fix; edit the original.
# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Shared policy file: imports numpy, the standard library and `.lookup_retrace`, `.acceptance_retrace`,
# `.goodput_retrace`, `.online_datastore_retrace` only. It is a Hub file and the vLLM plugin's copy
# (`integrations/vllm/hf_retrace_vllm/shared/`, kept identical by `utils/check_copies.py`).
"""Candidate sources: cheap proposals tried before the drafter, in priority order, one class each.

Each cycle an engine asks its sources in turn (prompt lookup, then the datastore); the first that proposes anything
is verified, and the drafter skips that cycle. Where none does, the drafter drafts. A source needs no model forward
and sees only the committed tokens, as a numpy array, so both engines (transformers and the vLLM plugin) run these
very classes.

A new source is one subclass of [`CandidateSource`]: its `name`, its `priority`, the `setting` that turns it on and
its other `options` with their defaults. Subclasses register themselves, and the registry drives everything else: the
decoding settings and their checks (`policy_settings_retrace`), the vLLM export's policy block, the offline replay
and the plugin's proposer.

Under the cost-aware policy (`speculation_retrace`, docs/cost-aware-speculation.md) every source is asked, and each
returns its proposal with the features the acceptance estimator scores ([`CandidateSource.propose_with_features`]).
A source that learns from what is served (the online datastore) follows each request through the lifecycle hooks
`start`, `commit` and `finish`; the others ignore them.
"""

import numpy as np

from .acceptance_retrace import SOURCE_KINDS, ProposalFeatures
from .goodput_retrace import Proposal
from .lookup_retrace import NgramDatastore, prompt_lookup, prompt_lookup_match
from .online_datastore_retrace import OnlineDatastore


class CandidateSource:
    """Proposes candidate tokens from the committed ones, or nothing.

    Class attributes of a subclass:
        name (`str`): the key of its cycles in the engines' statistics.
        priority (`int`): sources are asked in increasing priority; the drafter comes after all of them.
        setting (`str`): the decoding setting that turns the source on and caps its proposal (`None` = off).
        options (`dict[str, int]`): its other decoding settings, with their defaults.
        export_names (`dict[str, str]`): settings named otherwise in the vLLM export's `hf_retrace` block.
        needs (`str`, *optional*): what the engine must hold for the source to run (`"datastore"`).
        uses_request (`bool`): whether `propose` takes the `request_id` keyword (sources with per-request state).
    """

    name: str
    priority: int
    setting: str
    options: dict = {}
    export_names: dict = {}
    needs: str | None = None
    uses_request: bool = False
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

    def propose_with_features(self, tokens: np.ndarray, max_tokens: int, request_id=None) -> Proposal | None:
        """[`propose`], with what the acceptance estimator reads of it (`acceptance_retrace.ProposalFeatures`).

        The default knows no match length: a source without its own kind in `acceptance_retrace.SOURCE_KINDS` is
        estimated in prompt lookup's table at match length 0, a row prompt lookup itself never uses.
        """
        proposal = self._ask(tokens, max_tokens, request_id)
        if not proposal:
            return None
        return Proposal(self.estimator_key, list(proposal), ProposalFeatures.lookup(0, len(proposal)))

    @property
    def estimator_key(self) -> str:
        """The source's table in the acceptance estimator (its `name` when the estimator knows it)."""
        return self.name if self.name in SOURCE_KINDS else "prompt_lookup"

    def _ask(self, tokens: np.ndarray, max_tokens: int, request_id=None) -> list[int] | None:
        if self.uses_request:
            return self.propose(tokens, max_tokens, request_id=request_id)
        return self.propose(tokens, max_tokens)

    # Lifecycle hooks, no-ops unless a source keeps per-request state. Engines call them for every source.
    def start(self, request_id, prompt_tokens) -> None:
        """A new request with its prompt (`prompt_tokens`, token ids)."""

    def commit(self, request_id, new_tokens) -> None:
        """Tokens the target just committed for `request_id`, in order."""

    def finish(self, request_id) -> None:
        """The request ended (finished or aborted); free its state."""


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

    def propose_with_features(self, tokens: np.ndarray, max_tokens: int, request_id=None) -> Proposal | None:
        proposal, n = prompt_lookup_match(tokens, min(self.num_tokens, max_tokens), *self.ngram_sizes)
        if not proposal:
            return None
        return Proposal(self.name, proposal, ProposalFeatures.lookup(n, len(proposal)))


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

    def propose_with_features(self, tokens: np.ndarray, max_tokens: int, request_id=None) -> Proposal | None:
        proposal, match = self.index.candidates_with_match(tokens, max_tokens)
        if not proposal:
            return None
        # the index keeps each n-gram's most frequent continuation, not its count: the estimator learns this
        # source's acceptance per match length (one probability bin, the middle one)
        features = ProposalFeatures.continuation(match, np.full(len(proposal), 0.5))
        return Proposal(self.name, proposal, features)


class OnlineDatastoreSource(CandidateSource):
    """The online datastore (`online_datastore_num_tokens`): n-gram continuations learned from the requests served,
    each request's prompt and output and the recent responses of finished ones ([`OnlineDatastore`],
    docs/cost-aware-speculation.md). The index lives as long as `resources.online_datastore(max_bytes)` keeps it (the
    transformers drafter keeps it across `generate` calls); without that method the source holds its own.
    """

    name, priority, setting = "online_datastore", 30, "online_datastore_num_tokens"
    options = {"online_datastore_max_bytes": 32 * 2**20}
    uses_request = True
    min_probability = 0.1  # a walk stops where its path probability falls below this

    def __init__(self, settings, resources):
        super().__init__(settings, resources)
        max_bytes = settings.online_datastore_max_bytes
        make = getattr(resources, "online_datastore", None)
        self.store: OnlineDatastore = make(max_bytes) if callable(make) else OnlineDatastore(max_bytes=max_bytes)

    @classmethod
    def check(cls, values: dict) -> None:
        super().check(values)
        max_bytes = values["online_datastore_max_bytes"]
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"online_datastore_max_bytes must be an int >= 0, got {max_bytes!r}")

    def _walk(self, tokens: np.ndarray, max_tokens: int, request_id):
        return self.store.propose(request_id, tokens, min(self.num_tokens, max_tokens), self.min_probability)

    def propose(self, tokens: np.ndarray, max_tokens: int, request_id=None) -> list[int] | None:
        return self._walk(tokens, max_tokens, request_id).tokens or None

    def propose_with_features(self, tokens: np.ndarray, max_tokens: int, request_id=None) -> Proposal | None:
        found = self._walk(tokens, max_tokens, request_id)
        if not found.tokens:
            return None
        features = ProposalFeatures.continuation(found.match_length, found.probabilities)
        return Proposal(self.name, found.tokens, features)

    def start(self, request_id, prompt_tokens) -> None:
        self.store.start(request_id, prompt_tokens)

    def commit(self, request_id, new_tokens) -> None:
        self.store.add_tokens(request_id, new_tokens)

    def finish(self, request_id) -> None:
        self.store.finish(request_id)


def source_order() -> list[str]:
    """The names of the registered sources, in the order a cycle asks them."""
    return [cls.name for cls in CandidateSource.registry]


def candidate_sources(settings, resources) -> list[CandidateSource]:
    """The sources `settings` turns on, in the order a cycle asks them, built with `resources` (see
    [`CandidateSource`])."""
    return [cls(settings, resources) for cls in CandidateSource.registry if getattr(settings, cls.setting) is not None]


def propose_from_sources(
    sources: list[CandidateSource], tokens: np.ndarray, max_tokens: int, request_id=None
) -> tuple[CandidateSource | None, list[int] | None]:
    """`(source, tokens)` of the first source in `sources` that proposes, or `(None, None)` when none does (the
    drafter's cycle). `max_tokens` is the room left, at least 1; `request_id` goes to the sources that use it."""
    for source in sources:
        proposal = source._ask(tokens, max_tokens, request_id)
        if proposal:
            return source, proposal
    return None, None


__all__ = [
    "CandidateSource", "DatastoreSource", "OnlineDatastoreSource", "PromptLookupSource", "candidate_sources",
    "propose_from_sources", "source_order",
]  # fmt: skip

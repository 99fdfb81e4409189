# Copied from hf_retrace/models/acceptance_retrace.py by utils/check_copies.py --fix; edit the original.
# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports numpy and the standard library only (no torch), so both engines share it unchanged; the vLLM
# plugin vendors it byte-identical.
"""Calibrated acceptance estimates for cost-aware speculation (docs/cost-aware-speculation.md).

For every proposed token, the probability that verification accepts it given that every token before it was
accepted (its conditional acceptance; the product up to a position is that position's survival probability). The
estimates are Beta-Bernoulli counts per feature cell, learned online from the verification outcomes the engine
already sees, with a prior so they work from the first step:

| kind | sources | cell of position `j` | prior mean |
|---|---|---|---|
| `confidence` | the drafter | (`j`, bin of the drafter's top-1 probability at `j`) | the bin's centre |
| `match` | prompt lookup | (match n-gram length, `j`) | `lookup_prior` |
| `continuation` | the datastores | (match n-gram length, bin of the continuation's count / total) | the bin's centre |

Per request, a ratio (observed / predicted acceptances over its recent verifications, shrunk toward 1) scales the
global estimate: a request that repeats itself gets longer proposals than the average one.
"""

from dataclasses import dataclass, field

import numpy as np


SOURCE_KINDS = {"drafter": "confidence", "prompt_lookup": "match", "datastore": "continuation",
                "online_datastore": "continuation"}  # fmt: skip
_EPS = 1e-3  # estimates stay in [_EPS, 1 - _EPS]: no position is certain, none hopeless


@dataclass
class ProposalFeatures:
    """What is known about one proposal before verification.

    Args:
        num_tokens (`int`): proposed tokens `K`.
        match_length (`int`, *optional*, defaults to 0): the n-gram length the lookup matched (lookup sources).
        probabilities (`np.ndarray` of shape `(K,)`, *optional*): the drafter's top-1 probability per slot, or the
            datastore's continuation probability (count / total) per token.
    """

    num_tokens: int
    match_length: int = 0
    probabilities: np.ndarray | None = None

    def __post_init__(self):
        if self.probabilities is not None:
            self.probabilities = np.asarray(self.probabilities, dtype=np.float64).reshape(-1)
            if self.probabilities.size < self.num_tokens:
                raise ValueError(f"{self.probabilities.size} probabilities for {self.num_tokens} proposed tokens")

    @classmethod
    def drafter(cls, probabilities) -> "ProposalFeatures":
        probabilities = np.asarray(probabilities, dtype=np.float64).reshape(-1)
        return cls(int(probabilities.size), 0, probabilities)

    @classmethod
    def lookup(cls, match_length: int, num_tokens: int) -> "ProposalFeatures":
        return cls(int(num_tokens), int(match_length))

    @classmethod
    def continuation(cls, match_length: int, probabilities) -> "ProposalFeatures":
        probabilities = np.asarray(probabilities, dtype=np.float64).reshape(-1)
        return cls(int(probabilities.size), int(match_length), probabilities)


class _Table:
    """Beta counts per cell, `(successes + prior_a) / (successes + failures + prior_a + prior_b)`, in flat Python
    lists: a proposal touches at most a few dozen cells, where scalar list access is ~20x cheaper than numpy's."""

    def __init__(self, prior_mean: np.ndarray, strength: float):
        self.shape = prior_mean.shape
        mean = np.clip(prior_mean, 0.02, 0.98).ravel()
        self.prior_a = (mean * strength).tolist()
        self.prior_b = ((1.0 - mean) * strength).tolist()
        self.successes = [0.0] * mean.size
        self.failures = [0.0] * mean.size

    def mean(self, cells: list[int]) -> list[float]:
        out = []
        for c in cells:
            a = self.successes[c] + self.prior_a[c]
            out.append(a / (a + self.failures[c] + self.prior_b[c]))
        return out

    def add(self, cells: list[int], num_accepted: int, max_count: float) -> None:
        """Cells before `num_accepted` were accepted, the one at `num_accepted` (if any) rejected."""
        for j, c in enumerate(cells):
            if j < num_accepted:
                self.successes[c] += 1.0
            else:
                self.failures[c] += 1.0
            total = self.successes[c] + self.failures[c]
            if total > max_count:  # a cell forgets its oldest evidence, so the estimates follow drift
                self.successes[c] *= max_count / total
                self.failures[c] *= max_count / total

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """`(successes, failures)`, each of shape `self.shape` (for inspection)."""
        return np.reshape(self.successes, self.shape), np.reshape(self.failures, self.shape)


def _clipped(means: list[float], ratio: float) -> np.ndarray:
    """`clip(means * ratio, _EPS, 1 - _EPS)` as float64, in Python floats: for a dozen cells numpy's calls cost more
    than the arithmetic, which is the same IEEE multiply either way."""
    return np.array([min(max(m * ratio, _EPS), 1.0 - _EPS) for m in means], dtype=np.float64)


@dataclass
class AcceptanceEstimator:
    """Conditional acceptance per proposed position, per source, learned online.

    Args:
        num_bins (`int`, *optional*, defaults to 10): probability bins of the drafter's and the datastores' features.
        max_positions (`int`, *optional*, defaults to 16): positions past it share the last position's cells.
        max_match_length (`int`, *optional*, defaults to 8): longer matches share the longest's cells.
        prior_strength (`float`, *optional*, defaults to 4.0): pseudo-observations in every cell's prior.
        lookup_prior (`float`, *optional*, defaults to 0.4): prior acceptance of a prompt-lookup token.
        drafter_prior (`float`, *optional*, defaults to 0.7): prior per-slot acceptance of a draft before its
            confidence is seen ([`expected_drafter_acceptance`]).
        request_strength (`float`, *optional*, defaults to 4.0): pseudo-acceptances shrinking a request's ratio
            toward 1 (the global estimate).
        request_decay (`float`, *optional*, defaults to 0.8): weight of a request's earlier verifications per new one.
        max_count (`float`, *optional*, defaults to 2000): observations a cell remembers.
    """

    num_bins: int = 10
    max_positions: int = 16
    max_match_length: int = 8
    prior_strength: float = 4.0
    lookup_prior: float = 0.4
    drafter_prior: float = 0.7
    request_strength: float = 4.0
    request_decay: float = 0.8
    max_count: float = 2000.0
    _tables: dict = field(default_factory=dict, repr=False)
    _requests: dict = field(default_factory=dict, repr=False)  # (request_id, source) -> [observed, predicted]

    def __post_init__(self):
        centres = (np.arange(self.num_bins) + 0.5) / self.num_bins
        shapes = {"confidence": (self.max_positions, self.num_bins),
                  "match": (self.max_match_length + 1, self.max_positions),
                  "continuation": (self.max_match_length + 1, self.num_bins)}  # fmt: skip
        means = {"confidence": np.broadcast_to(centres, shapes["confidence"]),
                 "match": np.full(shapes["match"], self.lookup_prior),
                 "continuation": np.broadcast_to(centres, shapes["continuation"])}  # fmt: skip
        for source, kind in SOURCE_KINDS.items():
            self._tables[source] = _Table(np.array(means[kind], dtype=np.float64), self.prior_strength)
        # before the drafter runs, only the slot is known: its acceptance over all confidences
        self._tables["drafter_slots"] = _Table(np.full(self.max_positions, self.drafter_prior), self.prior_strength)

    def _cells(self, source: str, features: ProposalFeatures) -> list[int]:
        """The flat index of each proposed position's cell in the source's table, `K` of them."""
        if source not in SOURCE_KINDS:
            raise ValueError(f"unknown proposal source {source!r}; known: {sorted(SOURCE_KINDS)}")
        kind, k, last = SOURCE_KINDS[source], features.num_tokens, self.max_positions - 1
        match = min(max(features.match_length, 0), self.max_match_length)
        if kind == "match":
            return [match * self.max_positions + min(j, last) for j in range(k)]
        if features.probabilities is None:
            raise ValueError(f"{source} features need per-token probabilities")
        bins = [min(max(int(p * self.num_bins), 0), self.num_bins - 1) for p in features.probabilities[:k].tolist()]
        if kind == "confidence":
            return [min(j, last) * self.num_bins + b for j, b in enumerate(bins)]
        return [match * self.num_bins + b for b in bins]

    def _ratio(self, request_id, source: str) -> float:
        """Observed / predicted acceptances of this request's recent proposals from `source`, shrunk toward 1."""
        if request_id is None or (request_id, source) not in self._requests:
            return 1.0
        observed, predicted = self._requests[request_id, source]
        return (observed + self.request_strength) / (predicted + self.request_strength)

    def estimate(self, source: str, features: ProposalFeatures, request_id=None) -> np.ndarray:
        """Conditional acceptance per proposed position, shape `(K,)`, for request `request_id` if given (else
        the global estimate)."""
        cells = self._cells(source, features)  # raises on an unknown source
        return _clipped(self._tables[source].mean(cells), self._ratio(request_id, source))

    def expected_drafter_acceptance(self, request_id=None, num_positions: int | None = None) -> np.ndarray:
        """Expected conditional acceptance per draft position before the drafter runs (its confidences unknown):
        the global per-slot acceptance, scaled by this request's recent drafter history. Shape `(num_positions,)`."""
        num_positions = self.max_positions if num_positions is None else int(num_positions)
        slots = [min(j, self.max_positions - 1) for j in range(num_positions)]
        return _clipped(self._tables["drafter_slots"].mean(slots), self._ratio(request_id, "drafter_slots"))

    def update(self, source: str, features: ProposalFeatures, num_accepted: int, request_id=None) -> None:
        """Learns from one verification: positions before `num_accepted` were accepted, position `num_accepted` (if
        it was proposed) rejected, the rest never judged. `features` describe the VERIFIED tokens only (a drafter
        block of 15 drafts of which 3 were verified has 3)."""
        k = features.num_tokens
        if not 0 <= num_accepted <= k:
            raise ValueError(f"num_accepted must be in [0, {k}] (the verified tokens), got {num_accepted}")
        cells = self._cells(source, features)[: num_accepted + 1]
        if not cells:
            return
        self._learn(source, cells, num_accepted, request_id)
        if source == "drafter":
            self._learn("drafter_slots", [min(j, self.max_positions - 1) for j in range(len(cells))], num_accepted,
                        request_id)  # fmt: skip

    def futile_block(self, request_id=None) -> None:
        """Learns from a drafter block of which no draft was worth verifying: nothing was judged, so the confidence
        table learns nothing, but the per-slot estimate that decides whether the drafter runs (before its
        confidences exist) counts it as a first draft lost, so futile blocks stop being planned."""
        self._learn("drafter_slots", [0], 0, request_id)

    def _learn(self, table: str, cells: list[int], num_accepted: int, request_id) -> None:
        """Adds the outcomes to the global cells and to the request's observed / predicted history (predicted by
        the global estimate before this update, so the ratio measures how this request differs from the average)."""
        predicted = sum(self._tables[table].mean(cells))
        self._tables[table].add(cells, num_accepted, self.max_count)
        if request_id is not None:
            history = self._requests.setdefault((request_id, table), [0.0, 0.0])
            history[0] = self.request_decay * history[0] + float(num_accepted)
            history[1] = self.request_decay * history[1] + predicted

    def forget(self, request_id) -> None:
        """Frees a finished or aborted request's history."""
        for key in [key for key in self._requests if key[0] == request_id]:
            del self._requests[key]

    @property
    def num_requests(self) -> int:
        return len({key[0] for key in self._requests})

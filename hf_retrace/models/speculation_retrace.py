# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Shared policy file: imports numpy, the standard library and `.acceptance_retrace`, `.cost_model_retrace`,
# `.goodput_retrace`, `.sources_retrace`, `.policy_settings_retrace` only. It is a Hub file and the vLLM plugin's copy
# (`integrations/vllm/hf_retrace_vllm/shared/`, kept identical by `utils/check_copies.py`).
"""The speculation step both engines call every step: which source proposes for each request and how many tokens
are verified, under either policy (docs/cost-aware-speculation.md).

- `"fixed"`: the first candidate source that proposes, else the drafter with `num_assistant_tokens` drafts cut by
  the confidence stop. This is the policy of the engines before the cost-aware one, proposal for proposal.
- `"goodput"`: every source proposes, and [`plan_step`] / [`choose_num_verified`] pick, per request, the source and
  the number of verified tokens (0 allowed) that maximise the batch's expected committed tokens per second, from the
  step-cost model and the calibrated acceptance estimates. The `*_num_tokens` settings and `num_assistant_tokens`
  are caps; the engine's own (`max_tokens` per request) applies on top.

One step, in an engine:

```python
plan = policy.plan([(request_id, tokens, max_tokens), ...])
for request_id in plan.drafting:          # run the drafter for these only (none: skip its forward)
    ...                                   # -> top-1 draft probabilities per slot, shape (k_max,)
verified = policy.num_drafts(plan, confidences)  # {request_id: k}, 0 allowed (then one plain target row)
...                                       # verify; time the target and the drafter
policy.outcome(request_id, num_accepted)  # for every request that verified something
policy.step_time(rows, drafter_slots, target_seconds, drafter_seconds, context_tokens, decode_rows)
policy.commit(request_id, new_tokens)     # and policy.finish(request_id) when it ends
```

Lossless by construction: the policy chooses what is proposed and how much is verified, never how it is verified.
The number of drafts verified depends on the drafter's top-1 probabilities (not on the sampled tokens) and on what
earlier steps observed, so speculative sampling stays exact.
"""

from dataclasses import dataclass, field, replace

import numpy as np

from .acceptance_retrace import AcceptanceEstimator, ProposalFeatures
from .cost_model_retrace import StepCostModel
from .goodput_retrace import DRAFTER, RequestPlan, StepPlan, StepRequest, choose_num_verified, plan_step
from .policy_settings_retrace import num_confident
from .sources_retrace import CandidateSource, propose_from_sources


@dataclass
class SpeculationPlan:
    """What each request does this step.

    Args:
        actions (`dict[Hashable, tuple]`): per request, `("lookup", tokens, source_name)`, `("draft", max_drafts)` or
            `("none",)` (one plain target row).
        step ([`StepPlan`], *optional*): the goodput stage-1 plan with its prediction (`None` under `"fixed"`).
    """

    actions: dict = field(default_factory=dict)
    step: StepPlan | None = None

    def action(self, request_id) -> tuple:
        return self.actions[request_id]

    @property
    def drafting(self) -> list:
        """Ids of the requests the drafter must run for, in plan order (empty: skip the drafter forward)."""
        return [rid for rid, action in self.actions.items() if action[0] == "draft"]


@dataclass
class PlanCalibration:
    """Observed over predicted accepted tokens of the proposals the goodput policy verified, per source.

    The policy takes, per request, the option whose estimate is highest, so the estimates of what it chose are biased
    upward even when every estimator cell is calibrated over what it saw (the winner's curse); in the serving bench
    the chosen plans expected 13-25% more accepted tokens than verification accepted. This ratio, decayed and shrunk
    toward 1, scales the chosen source's estimates before the next choice (`scale`). `predicted` is always the
    unscaled estimate, so the ratio is a fixed point of the correction, not of its own output.

    Args:
        decay (`float`, *optional*, defaults to 0.99): weight of the earlier verifications per new one.
        strength (`float`, *optional*, defaults to 8.0): pseudo-tokens shrinking the ratio toward 1.
        low (`float`), high (`float`), *optional*, default to 0.25 and 2.0: the ratio's range.
    """

    decay: float = 0.99
    strength: float = 8.0
    low: float = 0.25
    high: float = 2.0
    _sums: dict = field(default_factory=dict, repr=False)  # source -> [observed, predicted], decayed

    def __post_init__(self):
        if not (0.0 < self.decay <= 1.0 and self.strength > 0 and 0.0 < self.low <= 1.0 <= self.high):
            raise ValueError(f"PlanCalibration needs 0 < decay <= 1, strength > 0 and 0 < low <= 1 <= high; got "
                             f"decay={self.decay}, strength={self.strength}, low={self.low}, high={self.high}")

    def scale(self, source: str) -> float:
        observed, predicted = self._sums.get(source, (0.0, 0.0))
        return min(max((observed + self.strength) / (predicted + self.strength), self.low), self.high)

    def update(self, source: str, predicted: float, observed: int) -> None:
        """One verified proposal of `source`: `predicted` accepted tokens (unscaled survival sum), `observed`."""
        sums = self._sums.setdefault(source, [0.0, 0.0])
        sums[0] = self.decay * sums[0] + float(observed)
        sums[1] = self.decay * sums[1] + float(predicted)


class _CalibratedEstimator:
    """An [`AcceptanceEstimator`] as the goodput solver reads it: the first position's conditional acceptance scaled
    by [`PlanCalibration.scale`], which scales every survival probability of the proposal by the same factor."""

    def __init__(self, estimator: AcceptanceEstimator, calibration: PlanCalibration):
        self.estimator, self.calibration = estimator, calibration

    def _scaled(self, acceptance: np.ndarray, source: str) -> np.ndarray:
        if acceptance.size:
            acceptance = acceptance.copy()
            acceptance[0] = min(acceptance[0] * self.calibration.scale(source), 1.0 - 1e-3)
        return acceptance

    def estimate(self, source: str, features: ProposalFeatures, request_id=None) -> np.ndarray:
        return self._scaled(self.estimator.estimate(source, features, request_id), source)

    def expected_drafter_acceptance(self, request_id=None, num_positions: int | None = None) -> np.ndarray:
        return self._scaled(self.estimator.expected_drafter_acceptance(request_id, num_positions), "drafter")


class SpeculationPolicy:
    """The per-step choice of one engine, with its learning state.

    Args:
        settings: the validated decoding settings (`ReTraceDecodingSettings`): `speculation_policy`,
            `num_assistant_tokens`, `assistant_confidence_threshold`.
        sources (`list[CandidateSource]`): the sources turned on, in priority order (`candidate_sources`).
        block_size (`int`): the drafter's block `B`; it drafts at most `B - 1` tokens.
        cost_model ([`StepCostModel`], *optional*): `t(R)` and `d(S)`; required under `"goodput"`.
        estimator ([`AcceptanceEstimator`], *optional*): a fresh one by default; pass one to keep what it learned.
        max_rows (`int`, *optional*): the engine's cap on target rows in a step.
        explore_every (`int`, *optional*, defaults to 32): under `"goodput"`, a request the plan left without drafts
            for this many steps drafts (and verifies at least one draft) when the drafter runs anyway, and the
            drafter runs after this many steps without it. Without it, a pessimistic estimate or a step-cost profile
            taken under load would never be corrected: a drafter that never runs is never observed. It costs at
            most one drafter forward per `explore_every` steps. A request whose drafts were never verified explores
            at its first step left without drafts, if the drafter runs anyway or its block costs at most
            `cheap_exploration` (0.3) of a plain step: how well the drafter does for this request (its ratio to the
            global estimate) is known only once it drafted, and a request of a prompt family the estimates never
            saw would otherwise wait `explore_every` steps to show it.
        whole_batch_drafter (`bool`, *optional*, defaults to `False`): the engine's drafter forward runs for the
            whole batch when any request drafts (vLLM's padded drafter batch): goodput charges it `d(n * B)`.
        calibration ([`PlanCalibration`], *optional*): goodput's correction of its chosen plans' estimates; a fresh
            one by default.
    """

    def __init__(self, settings, sources: list[CandidateSource], block_size: int,
                 cost_model: StepCostModel | None = None, estimator: AcceptanceEstimator | None = None,
                 max_rows: int | None = None, explore_every: int = 32,
                 whole_batch_drafter: bool = False, calibration: PlanCalibration | None = None):  # fmt: skip
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1 (steps between exploring drafter runs), got {explore_every}")
        self.kind = settings.speculation_policy
        if self.kind == "goodput" and cost_model is None:
            raise ValueError('speculation_policy="goodput" needs a step-cost model (cost_model_retrace.StepCostModel)')
        self.sources, self.block_size, self.max_rows = list(sources), int(block_size), max_rows
        self.whole_batch_drafter = bool(whole_batch_drafter)
        self.num_assistant_tokens = min(int(settings.num_assistant_tokens), self.block_size - 1)
        self.threshold = settings.assistant_confidence_threshold
        self.cost_model = cost_model
        self.estimator = estimator if estimator is not None else AcceptanceEstimator()
        self.calibration = calibration if calibration is not None else PlanCalibration()
        self._solver_estimator = _CalibratedEstimator(self.estimator, self.calibration)  # what goodput's solver reads
        # the most tokens any request may verify: the drafter's cap or a source's
        self.max_verified = max([self.num_assistant_tokens] + [s.num_tokens for s in self.sources])
        # request_id -> (estimator source, ProposalFeatures of the verified tokens, unscaled predicted accepted
        # tokens of a chosen goodput proposal or None)
        self._pending: dict = {}
        # exploration (goodput): steps since the drafter last ran, for the engine and per request
        self.explore_every = int(explore_every)
        self._steps_without_drafter, self._since_draft, self._exploring = 0, {}, set()
        self._drafted = set()  # requests that drafted at least once (their own drafter acceptance is observed)
        # goodput: per request, the lookup proposals it did not verify ([`_shadow`]) and its committed length
        self._shadows: dict = {}
        self._lengths: dict = {}
        self.last_step: StepPlan | None = None  # the last final plan (goodput), its prediction beside the measure
        self._prefill_rows = 0  # the last `plan`'s prefill rows, for its stage 2

    # -- one step ---------------------------------------------------------------------------------------------------
    def plan(self, requests, prefill_rows: int = 0) -> SpeculationPlan:
        """Stage 1. `requests`: `(request_id, tokens np.ndarray (T,), max_tokens int)` per running request, where
        `max_tokens` is the most tokens it may verify (the engine's cap: room before the length limit, vLLM's
        `num_speculative_tokens`). `prefill_rows`: prompt rows of other requests that the verifying step will also
        run (goodput counts them as work done, see [`plan_step`])."""
        if self.kind == "fixed":
            return SpeculationPlan({rid: self._fixed_action(rid, tokens, int(m)) for rid, tokens, m in requests})
        step_requests = [self._step_request(rid, tokens, int(m)) for rid, tokens, m in requests]
        self._prefill_rows = max(int(prefill_rows), 0)
        step = plan_step(step_requests, self.cost_model, self._solver_estimator, self.block_size, self.max_verified,
                         self.max_rows, self.whole_batch_drafter, self._prefill_rows)  # fmt: skip
        plan = SpeculationPlan(step=step)
        for request, planned, (_, tokens, max_tokens) in zip(step_requests, step.requests, requests):
            rid = planned.request_id
            self._lengths[rid] = len(tokens)
            self._shadow(request, planned, len(tokens))
            if planned.source == DRAFTER:
                plan.actions[rid] = ("draft", min(self.num_assistant_tokens, int(max_tokens)))
            elif planned.source is not None and planned.num_verified > 0:
                name = getattr(planned.proposal, "source_name", planned.proposal.source)
                plan.actions[rid] = ("lookup", list(planned.tokens), name)
                source, features = planned.proposal.source, _head(planned.proposal.features, planned.num_verified)
                self._pending[rid] = (source, features, self._predicted(source, features, rid))
            else:
                plan.actions[rid] = ("none",)
        self._explore(plan, step_requests)
        self.last_step = step
        return plan

    def _shadow(self, request: StepRequest, planned: RequestPlan, start: int) -> None:
        """Keeps the lookup proposals the plan does not verify, to be scored against what the target commits next
        ([`_score_shadows`]): a source the plan rarely picks is still learned, from every step it proposes. For a
        fixed proposal, whether the target commits its token at a position is distributed as whether verification
        would have accepted it there (greedy: the same event; sampling: both have the target's probability of it)."""
        for proposal in request.proposals:
            if proposal is not planned.proposal:
                shadow = _Shadow(proposal.source, proposal.features, list(proposal.tokens), start)
                self._shadows.setdefault(request.request_id, []).append(shadow)

    def _score_shadows(self, request_id, new_tokens: list[int]) -> None:
        """Advances `request_id`'s shadow proposals over `new_tokens` (committed from position `_lengths`); one that
        met a different token or matched to its end teaches the estimator, like a verified proposal would."""
        position, alive = self._lengths[request_id], []  # `plan` set it before keeping any shadow
        for shadow in self._shadows.pop(request_id, []):
            j = shadow.start + shadow.matched - position  # index in `new_tokens` of the next token to compare
            if j < 0:  # its tokens were never seen in order: drop it, learn nothing
                continue
            while j < len(new_tokens) and shadow.matched < len(shadow.tokens) and (
                    new_tokens[j] == shadow.tokens[shadow.matched]):  # fmt: skip
                shadow.matched, j = shadow.matched + 1, j + 1
            if shadow.matched == len(shadow.tokens) or j < len(new_tokens):  # fully matched, or rejected at `matched`
                self.estimator.update(shadow.source, shadow.features, shadow.matched, request_id)
            else:
                alive.append(shadow)
        if alive:
            self._shadows[request_id] = alive

    cheap_exploration = 0.3  # a new request may start the drafter when that costs at most this share of t(n)

    def _explore(self, plan: SpeculationPlan, step_requests: list[StepRequest]) -> None:
        """Adds exploring drafts to a goodput plan (see `explore_every`). Depends on step counts and on which requests
        drafted before, never on sampled tokens, so sampling stays exact."""
        drafter_runs = bool(plan.drafting)
        self._steps_without_drafter = 0 if drafter_runs else self._steps_without_drafter + 1
        force = self._steps_without_drafter >= self.explore_every
        cheap = None  # whether a new request may start the drafter forward itself, computed once if needed
        for request in step_requests:
            rid, since = request.request_id, self._since_draft.get(request.request_id, 0)
            new = rid not in self._drafted
            if plan.actions[rid][0] == "none" and request.can_draft:
                if new and not (force or drafter_runs) and cheap is None:
                    cheap = self._cheap_to_explore(len(step_requests))
                due = force or (drafter_runs and (new or since + 1 >= self.explore_every)) or (new and cheap)
                if due:
                    plan.actions[rid] = ("draft", min(self.num_assistant_tokens, request.max_tokens))
                    self._exploring.add(rid)
                    drafter_runs = True  # the others of the batch may explore on this forward
            if plan.actions[rid][0] == "draft":
                self._since_draft[rid] = 0
                self._drafted.add(rid)
            else:
                self._since_draft[rid] = since + 1
        if force or drafter_runs:
            self._steps_without_drafter = 0

    def _cheap_to_explore(self, num_requests: int) -> bool:
        """Whether one exploring block (a drafter forward for this batch, and the row of the draft it verifies) costs
        at most `cheap_exploration` of a plain target step of the batch."""
        slots = self.block_size * (num_requests if self.whole_batch_drafter else 1)
        cost = float(self.cost_model.drafter_seconds(slots)) + self.cost_model.marginal_row_cost(num_requests)
        return cost <= self.cheap_exploration * float(self.cost_model.target_seconds(num_requests))

    def _fixed_action(self, rid, tokens: np.ndarray, max_tokens: int) -> tuple:
        if max_tokens <= 0:
            return ("none",)
        source, proposal = propose_from_sources(self.sources, tokens, max_tokens, rid)
        if source is not None:  # "fixed" learns from drafts only: its lookups carry no features
            return ("lookup", proposal, source.name)
        return ("draft", min(self.num_assistant_tokens, max_tokens))

    def _step_request(self, rid, tokens: np.ndarray, max_tokens: int) -> StepRequest:
        proposals = []
        if max_tokens > 0:
            for source in self.sources:
                proposal = source.propose_with_features(tokens, max_tokens, request_id=rid)
                if proposal is not None:
                    proposal.source_name = source.name  # the stats' name; `proposal.source` is the estimator's
                    proposals.append(proposal)
        can_draft = self.block_size >= 2 and max_tokens > 0
        return StepRequest(rid, proposals, can_draft, max(max_tokens, 0), context_tokens=len(tokens))

    def num_drafts(self, plan: SpeculationPlan, confidences) -> dict:
        """Stage 2, after the drafter ran for `plan.drafting`.

        Args:
            plan ([`SpeculationPlan`]): this step's plan.
            confidences (`Mapping[Hashable, np.ndarray]`): per drafting request, the drafter's top-1 probability per
                draft slot, shape `(k_max,)` with `k_max >= ` its `max_drafts` (extra slots are ignored).
        Returns:
            `dict[Hashable, int]`: drafts to verify per drafting request, in `[0, max_drafts]`.
        """
        capped = {}
        for rid in plan.drafting:
            probabilities = np.asarray(confidences[rid], dtype=np.float64).reshape(-1)
            capped[rid] = probabilities[: plan.action(rid)[1]]
        if self.kind == "fixed" or plan.step is None:
            counts = {rid: self._confidence_stop(p) for rid, p in capped.items()}
        else:
            ran = replace(plan.step, drafter_slots=self._drafter_slots_run(plan))  # exploring requests included
            final = choose_num_verified(ran, capped, self.cost_model, self._solver_estimator, self.max_verified,
                                        self.max_rows, self._prefill_rows)  # fmt: skip
            self.last_step = final
            by_id = {r.request_id: r.num_verified for r in final.requests if r.source == DRAFTER}
            counts = {rid: int(by_id.get(rid, 0)) for rid in capped}
            for rid in self._exploring & counts.keys():  # an exploring block verifies a draft: one real outcome
                counts[rid] = max(counts[rid], min(1, capped[rid].size))
        for rid, k in counts.items():
            features = ProposalFeatures.drafter(capped[rid][:k])
            # goodput calibrates every verified block, exploring ones too: they keep a calibration that once
            # stopped the drafter from never seeing it again
            predicted = self._predicted("drafter", features, rid) if self.kind == "goodput" else None
            self._pending[rid] = ("drafter", features, predicted)
            if k == 0 and capped[rid].size and self.kind == "goodput":
                self.estimator.futile_block(rid)
        self._exploring = set()
        return counts

    def _drafter_slots_run(self, plan: SpeculationPlan) -> int:
        """`S` of the drafter forward this step ran: `block_size` per drafting request (exploring ones too, which
        stage 1 did not price), or per request of the batch for a whole-batch drafter."""
        if not plan.drafting:
            return 0
        return self.block_size * (len(plan.step.requests) if self.whole_batch_drafter else len(plan.drafting))

    def _predicted(self, source: str, features: ProposalFeatures, rid) -> float | None:
        """The unscaled estimate of a verified proposal's accepted tokens: the sum of its survival probabilities."""
        if features.num_tokens == 0:
            return None
        return float(np.cumprod(self.estimator.estimate(source, features, rid)).sum())

    def _confidence_stop(self, probabilities: np.ndarray) -> int:
        if self.threshold is None:
            return int(probabilities.size)
        return int(num_confident(probabilities, self.threshold))

    def outcome(self, request_id, num_accepted: int) -> None:
        """After verification: `num_accepted` of the tokens proposed to `request_id` this step were accepted."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        source, features, predicted = pending
        if features.num_tokens > 0:
            accepted = min(max(int(num_accepted), 0), features.num_tokens)
            if predicted is not None:
                self.calibration.update(source, predicted, accepted)
            self.estimator.update(source, features, accepted, request_id)

    def step_time(self, rows: int, drafter_slots: int, target_seconds: float, drafter_seconds: float | None = None,
                  context_tokens: tuple = (0, 0), decode_rows: tuple | None = None,
                  requests: int | None = None) -> None:  # fmt: skip
        """Refreshes the cost model from one measured step: `rows` target rows in `target_seconds`, which read
        `context_tokens = (K, X)` context tokens (the requests' first rows, their other rows), and the drafter's
        `drafter_slots` slots in `drafter_seconds` (`None`: not timed apart, the step is split by prediction).
        `decode_rows = (requests, verified rows)` for a step with no prefill rows: it then counts toward the fit of
        the terms. `requests`: the requests that decoded in the step (defaults to `decode_rows`' requests)."""
        if self.cost_model is not None:
            seconds = float(target_seconds) + float(drafter_seconds or 0.0)
            first, other = (int(k) for k in context_tokens)
            self.cost_model.observe(int(rows), int(drafter_slots), seconds, drafter_seconds, first, other, decode_rows,
                                    requests)  # fmt: skip

    # -- request lifecycle ------------------------------------------------------------------------------------------
    def start(self, request_id, prompt_tokens) -> None:
        for source in self.sources:
            source.start(request_id, prompt_tokens)

    def commit(self, request_id, new_tokens) -> None:
        """Tokens the target committed for `request_id` (the learning sources index them)."""
        new_tokens = [int(t) for t in np.asarray(new_tokens).reshape(-1)]
        if request_id in self._shadows:
            self._score_shadows(request_id, new_tokens)
        if request_id in self._lengths:
            self._lengths[request_id] += len(new_tokens)
        if new_tokens:
            for source in self.sources:
                source.commit(request_id, new_tokens)

    def finish(self, request_id) -> None:
        """The request ended (finished or aborted): its state is freed, its response joins the online index."""
        for source in self.sources:
            source.finish(request_id)
        self.estimator.forget(request_id)
        self._pending.pop(request_id, None)
        self._since_draft.pop(request_id, None)
        self._drafted.discard(request_id)
        self._shadows.pop(request_id, None)
        self._lengths.pop(request_id, None)


@dataclass
class _Shadow:
    """A lookup proposal the plan did not verify: its estimator source and features, its tokens, the position of its
    first token, and how many of them the target has committed so far."""

    source: str
    features: ProposalFeatures
    tokens: list
    start: int
    matched: int = 0


def _head(features: ProposalFeatures, k: int) -> ProposalFeatures:
    """The features of the first `k` proposed tokens (the verified ones)."""
    probabilities = None if features.probabilities is None else features.probabilities[:k]
    return ProposalFeatures(int(k), features.match_length, probabilities)


__all__ = ["PlanCalibration", "SpeculationPlan", "SpeculationPolicy"]

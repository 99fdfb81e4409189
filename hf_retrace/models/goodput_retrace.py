# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports numpy, the standard library and `.acceptance_retrace` / `.cost_model_retrace` only (no torch), so
# both engines share it unchanged; the vLLM plugin vendors it byte-identical.
"""The goodput-optimal choice of cost-aware speculation (SmartSpec, Liu et al., 2024; TurboSpec; vLLM's adaptive
verification): per request, which source proposes and how many tokens are verified (0 allowed), so that the batch's
expected committed tokens per second is highest. See docs/cost-aware-speculation.md.

A step of `n` requests verifying `V` proposed tokens in all runs `R = n + V` target rows and, when `m` requests draft,
`S = m * block_size` drafter slots; it commits in expectation `E = sum over requests of (1 + sum of the survival
probabilities of its verified tokens)` in `T = t(R) + e * n + a * K + c * X + d(S)` seconds, where each row reads its
request's `L` context tokens (`K`: the sum over the requests' first rows, `X`: over their verified rows) and `e` is
what a request's own row costs beyond a verified row.
(request, position) slots are admitted in order of survival probability per marginal second (`t`'s marginal row cost
plus `c * L`; with `c = 0`, survival order) while the marginal tokens per marginal second beat the current rate
`E / T`: the prefix of that order with the highest `E / T` (with linear costs, exactly where the greedy rule stops).

A step that also carries `P` prefill rows (other requests' prompt chunks) takes `t(R + P)`, and a prefill row is a
unit of work done, like a committed token: the rate is `(E + P) / T`. Under a row budget (`max_rows`, vLLM's
`max_num_batched_tokens`) verification is scheduled first and the prefill gets the rows left, `P = min(P_waiting,
max_rows - R)`: a verified token displaces a prefill row, and pays only if it is sure to be accepted. With many
prefill rows and no budget the rate nears one row per marginal row cost, so the same holds: speculation waits for
the steps that only decode.

Two stages, because the drafter's confidences exist only after it runs:
1. [`plan_step`]: lookup proposals with their estimates against the drafter's expected acceptance; decides who
   drafts (the drafter's `d(S)` counted as one group: plans with and without the drafter are both solved).
2. [`choose_num_verified`]: after the drafter ran, how many of each request's drafts (and lookups) to verify.

[`speedup_ceiling`] bounds what any proposer of a given acceptance can gain at a given load on a step-cost curve.

Lossless by construction: the policy only chooses what is proposed and how much of it is verified; verification
(greedy match or rejection sampling) is unchanged.
"""

from dataclasses import dataclass, field
from itertools import accumulate, chain
from operator import mul

import numpy as np

from .acceptance_retrace import AcceptanceEstimator, ProposalFeatures
from .cost_model_retrace import StepCostModel


DRAFTER = "drafter"


@dataclass
class Proposal:
    """Tokens a lookup source (prompt lookup, a datastore) proposes for one request.

    Args:
        source (`str`): a key of `acceptance_retrace.SOURCE_KINDS`, e.g. `"prompt_lookup"`.
        tokens (`list[int]`): the proposed tokens, `K` of them.
        features (`ProposalFeatures`): what the estimator reads (match length, continuation probabilities).
    """

    source: str
    tokens: list[int]
    features: ProposalFeatures


@dataclass
class StepRequest:
    """One running request at a step.

    Args:
        request_id (`Hashable`): the engine's id.
        proposals (`list[Proposal]`, *optional*): its lookup proposals (any number, including none).
        can_draft (`bool`, *optional*, defaults to `True`): whether the drafter may draft for it this step.
        max_tokens (`int`, *optional*): at most this many tokens may be verified (its remaining length budget).
        context_tokens (`int`, *optional*, defaults to 0): `L`, its tokens so far (prompt and generated): each of
            its rows reads that many, which the cost model's `c` prices.
    """

    request_id: object
    proposals: list[Proposal] = field(default_factory=list)
    can_draft: bool = True
    max_tokens: int | None = None
    context_tokens: int = 0


@dataclass
class RequestPlan:
    """What one request verifies this step.

    Args:
        request_id (`Hashable`): the engine's id.
        source (`str` or `None`): `"drafter"`, a lookup source, or `None` (nothing proposed: one plain row).
        num_verified (`int`): tokens to verify; for the drafter in a [`plan_step`] plan, the expected count.
        tokens (`list[int]`): a lookup's tokens to verify (`num_verified` of them); `[]` for the drafter, whose
            drafts the engine holds.
        acceptance (`np.ndarray` of shape `(num_verified,)`): conditional acceptance estimates of those tokens.
        proposal (`Proposal`, *optional*): the chosen lookup proposal.
        max_tokens (`int`, *optional*): the most tokens this request may verify (`max_verified`, its length budget).
        context_tokens (`int`, *optional*, defaults to 0): its tokens so far, as in [`StepRequest`].
    """

    request_id: object
    source: str | None
    num_verified: int
    tokens: list[int]
    acceptance: np.ndarray
    proposal: Proposal | None = None
    max_tokens: int | None = None
    context_tokens: int = 0

    @property
    def expected_tokens(self) -> float:
        """1 (the target's own token) + the survival probabilities of the verified tokens."""
        return 1.0 + float(np.cumprod(self.acceptance[: self.num_verified]).sum())


@dataclass
class StepPlan:
    """The whole batch's choice, with the model's prediction of the step.

    Args:
        requests (`list[RequestPlan]`): one per request, in the input order.
        rows (`int`): target rows of the step, `R + P`: one per request, its verified tokens, and the prefill rows.
        drafter_slots (`int`): drafter slots `S` (`block_size` per drafting request).
        expected_tokens (`float`): `E`, tokens committed by the planned requests.
        expected_seconds (`float`): `T = t(R + P) + e * n + a * K + c * X + d(S)` (the prefill rows' contexts are
            not known here).
        prefill_rows (`int`, *optional*, defaults to 0): `P`, prefill rows the step runs beside the requests.
        plain_goodput (`float`, *optional*, defaults to 0.0): the goodput the model predicts for the same step with
            nothing verified and no drafter forward (`0.0`: not computed, e.g. a stage-2 plan).
    """

    requests: list[RequestPlan]
    rows: int
    drafter_slots: int
    expected_tokens: float
    expected_seconds: float
    prefill_rows: int = 0
    plain_goodput: float = 0.0

    @property
    def drafting(self) -> list:
        """Ids of the requests the drafter runs for."""
        return [r.request_id for r in self.requests if r.source == DRAFTER]

    @property
    def goodput(self) -> float:
        """`(E + P) / T`: committed tokens and prefill rows per second, what the plan maximises."""
        work = self.expected_tokens + self.prefill_rows
        return work / self.expected_seconds if self.expected_seconds > 0 else 0.0

    @property
    def predicted_gain(self) -> float | None:
        """`goodput / plain_goodput - 1`: what the model expects the plan to gain over a plain step (`None` when
        the plain step was not priced)."""
        return self.goodput / self.plain_goodput - 1.0 if self.plain_goodput > 0 else None


@dataclass(eq=False)  # compared by identity: the same option picked again
class _Option:
    source: str | None
    acceptance: np.ndarray  # conditional, already capped
    proposal: Proposal | None = None

    def __post_init__(self):
        # survival probabilities, [K], in Python: for a dozen floats a numpy call costs more than the arithmetic
        self.survival = list(accumulate(self.acceptance.tolist(), mul))


_NOTHING = _Option(None, np.zeros(0))


def _solve(options: list[_Option], cost_model: StepCostModel, block_size: int, drafter_slots: int | None = None,
           max_rows: int | None = None, whole_batch: bool = False, prefill_rows: int = 0,
           contexts: list[int] | None = None) -> tuple:  # fmt: skip
    """The best admission prefix for one source per request.

    Returns:
        `(num_verified per request, drafter slots, E, T, P)`. With `drafter_slots=None` a drafting request adds
        `block_size` slots when its first draft is admitted (`whole_batch`: the first admitted draft of any request
        adds `n * block_size`, the engine's drafter runs for every request); otherwise the slots are fixed (the
        drafter already ran). `P`: the prefill rows run, `prefill_rows` less what verification took of `max_rows`.
        `contexts`: each request's `L`, the context tokens each of its rows reads.
    """
    n = len(options)
    lengths = np.array([len(o.survival) for o in options], dtype=np.int64)
    surv = np.fromiter(chain.from_iterable(o.survival for o in options), np.float64, int(lengths.sum()))
    req = np.repeat(np.arange(n), lengths)
    pos = np.arange(surv.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # position within its request
    drafts = np.repeat(np.array([o.source == DRAFTER for o in options], dtype=bool), lengths)
    context = np.zeros(n) if contexts is None else np.asarray(contexts, dtype=np.float64)
    key, per_row = surv, cost_model.context_per_row
    if per_row > 0:  # survival per marginal second: a verified row of a long request costs more
        key = surv / (cost_model.marginal_row_cost(n + max(int(prefill_rows), 0)) + per_row * context[req])
    # by key, ties by position: survival falls along a request's positions and its row cost is the same, so a
    # request's slots come in position order
    order = np.lexsort((pos, -key))
    surv, req, pos, drafts = surv[order], req[order], pos[order], drafts[order]
    expected = n + np.concatenate([[0.0], np.cumsum(surv)])
    other = np.concatenate([[0.0], np.cumsum(context[req])])  # X of each prefix: the verified rows' contexts
    rows = n + np.arange(surv.size + 1)
    if drafter_slots is None:
        slots = block_size * np.concatenate([[0], np.cumsum(drafts & (pos == 0))])
        if whole_batch:
            slots = np.where(slots > 0, n * block_size, 0)
    else:
        slots = np.full(rows.size, int(drafter_slots))
    prefill = np.full(rows.size, max(int(prefill_rows), 0))
    if max_rows is not None:  # the scheduler gives the budget to verification first, the prefill gets the rest
        prefill = np.minimum(np.maximum(max_rows - rows, 0), prefill)  # np.clip's, at a fraction of its overhead
    seconds = cost_model.step_seconds(rows + prefill, slots, context.sum(), other, n)
    rate = (expected + prefill) / np.maximum(np.asarray(seconds, dtype=np.float64), 1e-12)
    if max_rows is not None:
        rate = np.where(rows <= max(max_rows, n), rate, -np.inf)
    best = int(np.argmax(rate))  # the first maximum: the fewest rows among equals
    counts = np.bincount(req[:best], minlength=n)
    return counts, int(slots[best]), float(expected[best]), float(seconds[best]), int(prefill[best])


def _plain_goodput(cost_model: StepCostModel, contexts: list[int], max_rows: int | None, prefill_rows: int) -> float:
    """`(n + P) / T` of the step that verifies nothing for the `n = len(contexts)` requests: each commits one token,
    `P` of `prefill_rows` fit within `max_rows` beside their `n` rows, and no drafter forward runs."""
    n = len(contexts)
    prefill = max(int(prefill_rows), 0)
    if max_rows is not None:
        prefill = min(max(max_rows - n, 0), prefill)
    seconds = float(cost_model.step_seconds(n + prefill, 0, float(sum(contexts)), 0.0, n))
    return (n + prefill) / seconds if seconds > 0 else 0.0


def _lookup_options(request: StepRequest, estimator: AcceptanceEstimator, cap: int) -> list[_Option]:
    options = [_NOTHING]
    for proposal in request.proposals:
        k = min(cap, len(proposal.tokens), proposal.features.num_tokens)
        if k > 0:
            acceptance = estimator.estimate(proposal.source, proposal.features, request.request_id)[:k]
            options.append(_Option(proposal.source, acceptance, proposal))
    return options


def _value(option: _Option, threshold: float, fixed_cost: float) -> float:
    """Expected tokens over what their time would commit at the current rate (the marginal rule, in tokens)."""
    if not option.survival:
        return 0.0
    gain = sum(s - threshold for s in option.survival if s > threshold)
    return gain - fixed_cost if option.source == DRAFTER else gain


def _pick(choices: list[list[_Option]], cost_model: StepCostModel, block_size: int, rate: float,
          whole_batch: bool = False, prefill_rows: int = 0,
          contexts: list[int] | None = None) -> list[_Option]:  # fmt: skip
    """One option per request, the highest value at `rate`; the drafter's `d(S)` is shared among the requests that
    may draft (its per-request part is charged to each; `whole_batch`: the forward of all `n` requests is). A row
    costs `t`'s marginal row cost plus `c` times its request's context (`contexts`)."""
    n = len(choices)
    row_cost = cost_model.marginal_row_cost(n + prefill_rows)
    contexts = [0] * n if contexts is None else contexts
    num_drafters = sum(any(o.source == DRAFTER for o in c) for c in choices)
    slots = block_size * (n if whole_batch else num_drafters)
    share = rate * cost_model.drafter_seconds(slots) / num_drafters if num_drafters else 0.0
    return [max(c, key=lambda o, t=rate * (row_cost + cost_model.context_per_row * L): _value(o, t, share))
            for c, L in zip(choices, contexts)]  # fmt: skip


def _plan(options: list[_Option], requests: list[StepRequest], caps: list[int], solved) -> StepPlan:
    counts, slots, expected, seconds, prefill = solved
    plans = []
    for request, option, count, cap in zip(requests, options, counts.tolist(), caps):
        if count == 0:
            option = _NOTHING
        tokens = list(option.proposal.tokens[:count]) if option.proposal is not None else []
        plans.append(RequestPlan(request.request_id, option.source, count, tokens, option.acceptance[:count],
                                 option.proposal, cap, request.context_tokens))  # fmt: skip
    return StepPlan(plans, len(requests) + int(counts.sum()) + prefill, slots, expected, seconds, prefill)


def plan_step(requests: list[StepRequest], cost_model: StepCostModel, estimator: AcceptanceEstimator,
              block_size: int, max_verified: int, max_rows: int | None = None,
              whole_batch_drafter: bool = False, prefill_rows: int = 0) -> StepPlan:  # fmt: skip
    """Stage 1: which source proposes for each request (a lookup, the drafter, or nothing) and who drafts.

    Args:
        requests (`list[StepRequest]`): the running requests with their lookup proposals.
        cost_model (`StepCostModel`): `t(R)` and `d(S)`.
        estimator (`AcceptanceEstimator`): lookup estimates and the drafter's expected acceptance.
        block_size (`int`): drafter slots per drafting request; it drafts `block_size - 1` tokens.
        max_verified (`int`): at most this many tokens verified per request.
        max_rows (`int`, *optional*): the engine's cap on rows in a step (e.g. vLLM's `max_num_batched_tokens`).
        whole_batch_drafter (`bool`, *optional*, defaults to `False`): the engine's drafter forward runs for every
            request of the step as soon as one drafts (vLLM's padded drafter batch), so drafting costs
            `d(n * block_size)` however few requests draft.
        prefill_rows (`int`, *optional*, defaults to 0): prompt rows of other requests waiting to run in the step
            (vLLM's chunked prefill); within `max_rows` they take the rows verification leaves.

    Returns:
        [`StepPlan`]: run the drafter for `plan.drafting`, then call [`choose_num_verified`].
    """
    if not requests:
        return StepPlan([], 0, 0, 0.0, 0.0)
    caps = [max(0, min(max_verified, max_verified if r.max_tokens is None else r.max_tokens)) for r in requests]
    lookups = [_lookup_options(r, estimator, cap) for r, cap in zip(requests, caps)]
    contexts = [r.context_tokens for r in requests]

    def solve(options: list[_Option]) -> StepPlan:
        solved = _solve(options, cost_model, block_size, None, max_rows, whole_batch_drafter, prefill_rows, contexts)
        return _plan(options, requests, caps, solved)

    best = solve(_pick(lookups, cost_model, block_size, 0.0))  # rate 0: the most-surviving lookup per request
    best.plain_goodput = _plain_goodput(cost_model, contexts, max_rows, prefill_rows)
    if not any(r.can_draft for r in requests) or block_size < 2:
        return best
    choices = [c + _drafter_options(r, estimator, min(cap, block_size - 1))
               for r, c, cap in zip(requests, lookups, caps)]  # fmt: skip
    picked = None
    for _ in range(2):  # the choice depends on the rate and the rate on the choice: refine once
        previous, picked = picked, _pick(choices, cost_model, block_size, best.goodput, whole_batch_drafter,
                                         prefill_rows, contexts)  # fmt: skip
        if picked == previous:
            break
        candidate = solve(picked)
        if candidate.goodput > best.goodput:
            candidate.plain_goodput, best = best.plain_goodput, candidate
    return best


def _drafter_options(request: StepRequest, estimator: AcceptanceEstimator, cap: int) -> list[_Option]:
    if not request.can_draft or cap <= 0:
        return []
    return [_Option(DRAFTER, estimator.expected_drafter_acceptance(request.request_id, cap))]


def choose_num_verified(plan: StepPlan, drafter_probabilities, cost_model: StepCostModel,
                        estimator: AcceptanceEstimator, max_verified: int, max_rows: int | None = None,
                        prefill_rows: int = 0) -> StepPlan:  # fmt: skip
    """Stage 2, after the drafter ran for `plan.drafting`: how many tokens each request verifies (0 allowed), from
    the drafter's calibrated confidences; the drafter's `d(S)` is spent and stays in `T`.

    Args:
        plan (`StepPlan`): [`plan_step`]'s plan.
        drafter_probabilities (`Mapping[Hashable, np.ndarray]`): per drafting request, the drafter's top-1
            probability per draft, shape `(block_size - 1,)` (or fewer: only the drafts it may verify).
        cost_model, estimator, max_verified, max_rows, prefill_rows: as in [`plan_step`].

    Returns:
        [`StepPlan`]: the final plan; a drafting request's `num_verified` leading drafts are verified.
    """
    options = [_verified_option(p, drafter_probabilities, estimator, max_verified) for p in plan.requests]
    requests = [StepRequest(p.request_id, context_tokens=p.context_tokens) for p in plan.requests]
    caps = [p.max_tokens for p in plan.requests]
    contexts = [p.context_tokens for p in plan.requests]
    solved = _solve(options, cost_model, 0, plan.drafter_slots, max_rows, prefill_rows=prefill_rows, contexts=contexts)
    final = _plan(options, requests, caps, solved)
    for mine, planned in zip(final.requests, plan.requests):  # a drafting request verifying 0 drafts still drafted
        if planned.source == DRAFTER:
            mine.source = DRAFTER
    return final


def speedup_ceiling(cost_model: StepCostModel, num_requests: int, acceptance: float,
                    max_verified: int = 16) -> tuple[float, int]:  # fmt: skip
    """The most any proposer whose every token is accepted with probability `acceptance` (given the ones before it)
    can gain over plain decoding at `num_requests` running, on this step-cost model: verifying `k` tokens per request
    commits `n * (1 - p**(k+1)) / (1 - p)` tokens in `t(n * (1 + k)) + e * n`, against `n` in `t(n) + e * n`;
    proposing is free here (no drafter, no policy time), so a real method stays below it.

    Returns:
        `(speedup, k)`: the best ratio of tokens per second over plain decoding, and the `k` that reaches it (0: no
        speculation pays; the ratio is then 1).
    """
    n, p = int(num_requests), float(acceptance)
    if n < 1 or not 0.0 <= p <= 1.0 or max_verified < 0:
        raise ValueError(f"speedup_ceiling needs num_requests >= 1, acceptance in [0, 1] and max_verified >= 0; got "
                         f"{num_requests}, {acceptance}, {max_verified}")
    ks = np.arange(int(max_verified) + 1)
    tokens = np.cumsum(p**ks)  # 1 + p + ... + p**k, per request
    per_request = cost_model.per_request * n
    seconds = np.asarray(cost_model.target_seconds(n * (1 + ks)), dtype=np.float64) + per_request
    ratio = tokens / seconds * (float(cost_model.target_seconds(n)) + per_request)
    best = int(np.argmax(ratio))
    return float(ratio[best]), best


def _verified_option(planned: RequestPlan, drafter_probabilities, estimator, max_verified: int) -> _Option:
    if planned.source == DRAFTER:
        cap = max_verified if planned.max_tokens is None else min(max_verified, planned.max_tokens)
        probabilities = np.asarray(drafter_probabilities[planned.request_id], dtype=np.float64).reshape(-1)
        features = ProposalFeatures.drafter(probabilities[: max(cap, 0)])
        if features.num_tokens == 0:
            return _Option(DRAFTER, np.zeros(0))  # nothing it may verify
        return _Option(DRAFTER, estimator.estimate(DRAFTER, features, planned.request_id))
    if planned.proposal is not None:  # a lookup may verify less than planned, never more
        return _Option(planned.source, planned.acceptance, planned.proposal)
    return _NOTHING

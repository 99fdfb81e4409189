"""The goodput-optimal choice on synthetic cost curves and acceptance rates: 0 tokens when nothing pays, more when
rows are cheap, the drafter only when its expected gain covers d(S), and the batch-1 vs batch-8 thresholds of
docs/cost-aware-speculation.md (t(1) = 19.2 ms, t(8) = 38.8 ms: a row pays from p ~0.15 alone, ~0.6 with 8)."""

import itertools

import numpy as np
import pytest

from hf_retrace.models.acceptance_retrace import AcceptanceEstimator, ProposalFeatures
from hf_retrace.models.cost_model_retrace import CostCurve, StepCostModel
from hf_retrace.models.goodput_retrace import Proposal, StepRequest, choose_num_verified, plan_step, speedup_ceiling


class FixedEstimator:
    """Acceptance rates set by the test: `lookup[request_id]` per lookup token, `drafter` per draft slot."""

    def __init__(self, lookup=0.0, drafter=0.0):
        self.lookup, self.drafter = lookup, drafter

    def estimate(self, source, features, request_id=None):
        if source == "drafter":  # calibrated = the confidence itself
            return np.asarray(features.probabilities[: features.num_tokens], dtype=np.float64)
        rate = self.lookup[request_id] if isinstance(self.lookup, dict) else self.lookup
        return np.full(features.num_tokens, rate)

    def expected_drafter_acceptance(self, request_id=None, num_positions=16):
        return np.full(num_positions, self.drafter)


def _costs(row_ms=2.8, drafter_ms_per_slot=0.25):
    """t(1) = 19.2 ms and `row_ms` a row after (2.8: the vLLM compiled numbers); d(S) linear in S."""
    target = CostCurve([1, 8, 256], [0.0192, 0.0192 + 7e-3 * row_ms, 0.0192 + 255e-3 * row_ms])
    return StepCostModel(target, CostCurve([16], [16e-3 * drafter_ms_per_slot]))


def _lookups(n, k=4, can_draft=False, **kwargs):
    return [StepRequest(i, [Proposal("prompt_lookup", list(range(10, 10 + k)), ProposalFeatures.lookup(3, k))],
                        can_draft=can_draft, **kwargs) for i in range(n)]  # fmt: skip


def _plan(requests, estimator, costs=None, block_size=16, max_verified=8, **kwargs):
    return plan_step(requests, costs or _costs(), estimator, block_size, max_verified, **kwargs)


def test_zero_tokens_when_nothing_pays():
    plan = _plan(_lookups(4, can_draft=True), FixedEstimator(lookup=0.05, drafter=0.05))
    assert [r.num_verified for r in plan.requests] == [0, 0, 0, 0]
    assert plan.drafting == [] and plan.rows == 4 and plan.drafter_slots == 0
    assert all(r.source is None and r.tokens == [] for r in plan.requests)
    assert plan.expected_seconds == pytest.approx(_costs().target_seconds(4))


def test_more_tokens_when_rows_are_cheap():
    estimator = FixedEstimator(lookup=0.8)
    dear = _plan(_lookups(4, k=8), estimator, _costs(row_ms=2.8))
    cheap = _plan(_lookups(4, k=8), estimator, _costs(row_ms=0.1))
    assert sum(r.num_verified for r in cheap.requests) > sum(r.num_verified for r in dear.requests) > 0
    assert all(r.num_verified == 8 for r in cheap.requests)  # 0.8^8 = 0.17 in 0.1 ms beats 17.3 in 22.7 ms
    assert cheap.requests[0].tokens == list(range(10, 18))


@pytest.mark.parametrize("batch, p, verified", [(1, 0.10, 0), (1, 0.20, 1), (8, 0.50, 0), (8, 0.70, 1)])
def test_batch_1_pays_from_015_batch_8_only_from_06(batch, p, verified):
    """t(1) = 19.2 ms, t(8) = 38.8 ms: a marginal row costs 2.8 ms. Alone, one more token at p pays when
    p / 2.8 ms > 1 / 19.2 ms, p > 0.146; with 8 running, when p / 2.8 ms > 8 / 38.8 ms, p > 0.577."""
    plan = _plan(_lookups(batch, k=1), FixedEstimator(lookup=p))
    assert _costs().target_seconds(8) == pytest.approx(0.0388)
    assert [r.num_verified for r in plan.requests] == [verified] * batch


def test_the_drafter_runs_only_when_its_gain_covers_its_cost():
    requests = [StepRequest(0)]  # no lookup: the drafter or nothing
    cheap = _plan(requests, FixedEstimator(drafter=0.6), _costs(drafter_ms_per_slot=0.1))
    assert cheap.drafting == [0] and cheap.drafter_slots == 16 and cheap.requests[0].num_verified > 0
    dear = _plan(requests, FixedEstimator(drafter=0.6), _costs(drafter_ms_per_slot=3.0))  # d(16) = 48 ms
    assert dear.drafting == [] and dear.drafter_slots == 0 and dear.requests[0].num_verified == 0


def test_the_drafter_runs_only_for_requests_whose_lookup_is_worse():
    """Request 0 has a confident lookup, request 1 a hopeless one; the drafter drafts for 1 alone, with one group of
    `block_size` slots, and request 2 (not allowed to draft) keeps nothing."""
    requests = _lookups(2, k=4, can_draft=True) + [StepRequest(2, can_draft=False)]
    estimator = FixedEstimator(lookup={0: 0.95, 1: 0.01, 2: 0.0}, drafter=0.7)
    plan = _plan(requests, estimator, _costs(drafter_ms_per_slot=0.05))
    assert [r.source for r in plan.requests] == ["prompt_lookup", "drafter", None]
    assert plan.drafting == [1] and plan.drafter_slots == 16


def test_a_whole_batch_drafter_is_charged_for_the_whole_batch():
    """vLLM's drafter forward runs for all 8 requests when one drafts: d(128), not d(16). One request may draft
    (0.6 a draft), seven have nothing: the drafter pays for 16 slots, not for 128 at 0.25 ms a slot."""
    requests = [StepRequest(0)] + [StepRequest(i, can_draft=False) for i in range(1, 8)]
    estimator = FixedEstimator(drafter=0.6)
    costs = _costs(row_ms=0.5, drafter_ms_per_slot=0.05)
    per_request = _plan(requests, estimator, costs)
    whole = _plan(requests, estimator, costs, whole_batch_drafter=True)
    assert per_request.drafting == [0] and per_request.drafter_slots == 16
    assert whole.drafting == [] and whole.drafter_slots == 0
    assert _plan(requests[:1], estimator, costs, whole_batch_drafter=True).drafting == [0]  # alone: the same cost


def test_the_plan_predicts_its_own_step():
    costs = _costs()
    plan = _plan(_lookups(3, k=5, can_draft=True), FixedEstimator(lookup=0.6, drafter=0.8), costs)
    assert plan.rows == 3 + sum(r.num_verified for r in plan.requests)
    assert plan.expected_tokens == pytest.approx(sum(r.expected_tokens for r in plan.requests))
    assert plan.expected_seconds == pytest.approx(costs.step_seconds(plan.rows, plan.drafter_slots))


def test_the_plan_prices_the_plain_step_beside_itself():
    """`plain_goodput`: the same step verifying nothing, `n / t(n)`; the gain is the plan's goodput over it. Alone
    at p = 0.8 the plan verifies all 4 lookup tokens, 1 + 0.8 + 0.64 + 0.512 + 0.4096 tokens in t(5) = 30.4 ms
    against 1 in 19.2 ms: a gain of ~1.12.
    With nothing worth verifying the plan is the plain step and gains nothing."""
    costs = _costs()
    alone = _plan(_lookups(1), FixedEstimator(lookup=0.8), costs)
    assert alone.plain_goodput == pytest.approx(1 / costs.target_seconds(1))
    assert alone.predicted_gain == pytest.approx(alone.goodput * costs.target_seconds(1) - 1)
    assert alone.requests[0].num_verified == 4
    assert alone.predicted_gain == pytest.approx(3.3616 / 0.0304 * 0.0192 - 1)
    nothing = _plan(_lookups(4, can_draft=True), FixedEstimator(lookup=0.05, drafter=0.05), costs)
    assert nothing.predicted_gain == pytest.approx(0.0)
    drafting = _plan([StepRequest(0)], FixedEstimator(drafter=0.6), _costs(drafter_ms_per_slot=0.1))
    assert drafting.drafting == [0] and drafting.plain_goodput == pytest.approx(1 / costs.target_seconds(1))
    budget = _plan(_lookups(2), FixedEstimator(lookup=0.9), _costs(row_ms=0.01), prefill_rows=50, max_rows=40)
    assert budget.plain_goodput == pytest.approx(40 / _costs(row_ms=0.01).target_seconds(40))  # 38 prompt rows fit


@pytest.mark.parametrize("seed", range(5))
def test_greedy_prefix_matches_brute_force(seed):
    """With one lookup per request and linear costs, the admitted prefix is the best of every count combination."""
    rng = np.random.default_rng(seed)
    rates = {i: float(p) for i, p in enumerate(rng.uniform(0.1, 0.95, 3))}
    costs = _costs(row_ms=float(rng.uniform(0.5, 6.0)))
    plan = _plan(_lookups(3, k=3), FixedEstimator(lookup=rates), costs)

    def rate(counts):
        expected = 3 + sum(sum(rates[i] ** (j + 1) for j in range(c)) for i, c in enumerate(counts))
        return expected / costs.target_seconds(3 + sum(counts))

    best = max(rate(c) for c in itertools.product(range(4), repeat=3))
    assert plan.goodput == pytest.approx(best)


def test_caps_max_tokens_max_verified_and_max_rows():
    requests = _lookups(2, k=8)
    requests[0].max_tokens = 2  # two tokens left before its end
    plan = _plan(requests, FixedEstimator(lookup=0.99), max_verified=5)
    assert [r.num_verified for r in plan.requests] == [2, 5] and plan.requests[0].tokens == [10, 11]
    capped = _plan(_lookups(2, k=8), FixedEstimator(lookup=0.99), max_rows=5)
    assert capped.rows == 5
    none_left = _plan(_lookups(1, k=8, max_tokens=0), FixedEstimator(lookup=0.99))
    assert none_left.requests[0].num_verified == 0


def test_prefill_rows_in_the_step_leave_only_sure_tokens_worth_verifying():
    """Prompt rows that the step also runs count as work done: with 300 of them, a verified row (2.8 ms) must beat
    one row's worth of the step's rate, so p = 0.8 no longer pays; alone its first two tokens do (survival 0.8, 0.64
    against 4 / t(4) x 2.8 ms = 0.41)."""
    estimator = FixedEstimator(lookup=0.8)
    alone = _plan(_lookups(4), estimator)
    assert [r.num_verified for r in alone.requests] == [2, 2, 2, 2] and alone.prefill_rows == 0
    beside = _plan(_lookups(4), estimator, prefill_rows=300)
    assert [r.num_verified for r in beside.requests] == [0, 0, 0, 0]
    assert beside.rows == 304 and beside.prefill_rows == 300
    assert beside.expected_tokens == pytest.approx(4.0)  # E counts the requests' tokens only
    assert beside.expected_seconds == pytest.approx(_costs().target_seconds(304))
    assert beside.goodput == pytest.approx(304 / _costs().target_seconds(304))
    sure = _plan(_lookups(4), FixedEstimator(lookup=0.999), prefill_rows=300)
    assert all(r.num_verified == 4 for r in sure.requests)


def test_under_a_row_budget_a_verified_token_displaces_prefill():
    """Within `max_rows` the prefill gets the rows verification leaves: a token that may be rejected loses work even
    when rows are nearly free; a sure one (p = 1) costs nothing, since its row commits as a prefill row would."""
    cheap = _costs(row_ms=0.01)
    free = _plan(_lookups(2), FixedEstimator(lookup=0.9), cheap, prefill_rows=50)
    assert all(r.num_verified == 4 for r in free.requests)  # no budget: a 0.01 ms row pays at p = 0.9
    budget = _plan(_lookups(2), FixedEstimator(lookup=0.9), cheap, prefill_rows=50, max_rows=40)
    assert [r.num_verified for r in budget.requests] == [0, 0] and budget.rows == 40 and budget.prefill_rows == 38
    room = _plan(_lookups(2), FixedEstimator(lookup=0.9), cheap, prefill_rows=30, max_rows=40)
    assert all(r.num_verified == 4 for r in room.requests) and room.rows == 40  # 8 rows fit beside the 30


def test_choose_num_verified_reads_the_confidences():
    costs = _costs(drafter_ms_per_slot=0.05)
    requests = [StepRequest("sure"), StepRequest("unsure")] + _lookups(1, k=4)
    estimator = FixedEstimator(lookup=0.9, drafter=0.7)
    plan = _plan(requests, estimator, costs)
    assert plan.drafting == ["sure", "unsure"]
    confidences = {"sure": np.array([0.99, 0.98, 0.97, 0.9, 0.2] + [0.01] * 10), "unsure": np.full(15, 0.02)}
    final = choose_num_verified(plan, confidences, costs, estimator, max_verified=8)
    by_id = {r.request_id: r for r in final.requests}
    assert by_id["sure"].num_verified == 4 and by_id["unsure"].num_verified == 0
    assert final.drafting == ["sure", "unsure"]  # both drafted; "unsure" verifies none of its drafts
    assert by_id[0].num_verified <= plan.requests[2].num_verified  # a lookup verifies at most what was planned
    assert by_id[0].tokens == [10, 11, 12, 13][: by_id[0].num_verified]
    assert final.drafter_slots == plan.drafter_slots == 32
    assert final.expected_seconds == pytest.approx(costs.step_seconds(final.rows, 32))


def test_runs_with_the_real_estimator_from_its_priors():
    estimator = AcceptanceEstimator()
    found = Proposal("online_datastore", [1, 2, 3], ProposalFeatures.continuation(4, [0.9, 0.9, 0.9]))
    requests = [StepRequest(0, [found]), StepRequest(1)]
    plan = _plan(requests, estimator, _costs(drafter_ms_per_slot=0.05))
    assert plan.requests[0].source == "online_datastore" and plan.requests[0].num_verified == 3
    assert plan.drafting == [1]
    final = choose_num_verified(plan, {1: np.linspace(0.95, 0.05, 15)}, _costs(), estimator, max_verified=8)
    assert 0 < final.requests[1].num_verified < 8
    assert plan_step([], _costs(), estimator, 16, 8).rows == 0


SHARED = ("cost_model_retrace", "acceptance_retrace", "goodput_retrace", "online_datastore_retrace")


@pytest.mark.parametrize("name", SHARED)
def test_the_shared_core_imports_only_numpy_the_stdlib_and_itself(name):
    """Both engines (transformers' venv, the vLLM plugin's vendored copy) load these files unchanged: no torch,
    transformers or vLLM, and relative imports of each other only."""
    import ast
    import sys
    from pathlib import Path

    import hf_retrace.models

    tree = ast.parse((Path(hf_retrace.models.__file__).parent / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and node.module in SHARED, ast.unparse(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert {n.split(".")[0] for n in names} <= {"numpy", *sys.stdlib_module_names}, ast.unparse(node)


def test_speedup_ceiling_is_the_best_k_on_the_curve():
    costs = _costs()  # t(1) = 19.2 ms, 2.8 ms a row
    one, k = speedup_ceiling(costs, 1, 0.8, max_verified=8)
    t = [float(costs.target_seconds(1 + j)) for j in range(9)]
    brute = [(1 - 0.8 ** (j + 1)) / 0.2 * t[0] / t[j] for j in range(9)]
    assert one == pytest.approx(max(brute)) and k == int(np.argmax(brute)) >= 4  # rows are cheap alone
    assert speedup_ceiling(costs, 8, 0.5) == (1.0, 0)  # with 8 running a 50% token never pays
    eight, k = speedup_ceiling(costs, 8, 0.95)
    assert eight > 1.0 and 0 < k and eight < one  # a sure proposer still gains less under load


@pytest.mark.parametrize("n, p", [(0, 0.5), (1, 1.5), (1, -0.1)])
def test_speedup_ceiling_rejects_bad_values(n, p):
    with pytest.raises(ValueError, match="speedup_ceiling needs"):
        speedup_ceiling(_costs(), n, p)


def test_a_long_request_verifies_fewer_tokens_when_its_rows_read_its_context():
    """With `c > 0` a verified row of a request of `L` tokens costs `c * L` more: of two requests with the same
    proposal, the long one verifies fewer tokens; with `c = 0` (or only a first-row term) they verify the same."""
    estimator = FixedEstimator(lookup=0.7)

    def counts(context):
        costs = _costs(row_ms=1.0)
        costs.context = context
        requests = _lookups(2, k=8)
        requests[0].context_tokens, requests[1].context_tokens = 100, 8000
        plan = _plan(requests, estimator, costs)
        first, other = 8100, sum(r.num_verified * r.context_tokens for r in plan.requests)
        assert plan.expected_seconds == pytest.approx(costs.step_seconds(plan.rows, 0, first, other))
        return [r.num_verified for r in plan.requests]

    short, long = counts((0.0, 2e-7))  # a row of 8,000 tokens: 1.6 ms more
    assert short > long > 0
    assert counts((0.0, 0.0)) == counts((2e-7, 0.0)) == [short, short]


def test_a_dear_request_row_makes_a_verified_row_pay_sooner():
    """`e` prices each request's own row beyond a verified one: the plan's step time includes `e * n`, and with a
    step's time spent mostly on requests' own rows, a 50% token that never pays at 8 running (t(8) alone) does."""
    estimator = FixedEstimator(lookup=0.5)
    plain = _plan(_lookups(8), estimator, _costs())
    assert sum(r.num_verified for r in plain.requests) == 0
    dear = _costs()
    dear.per_request = 5e-3
    plan = _plan(_lookups(8), estimator, dear)
    assert sum(r.num_verified for r in plan.requests) > 0
    assert plan.expected_seconds == pytest.approx(float(dear.target_seconds(plan.rows)) + 8 * 5e-3)
    assert speedup_ceiling(dear, 8, 0.5)[0] > speedup_ceiling(_costs(), 8, 0.5)[0] == 1.0

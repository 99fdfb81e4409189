"""The shared speculation step (`speculation_retrace.SpeculationPolicy`) on synthetic costs, numpy only: "fixed" is
the first proposing source or the drafter with the confidence stop; "goodput" verifies nothing when rows are dear and
many tokens when they are cheap; outcomes teach the estimator; the online datastore follows each request."""

import numpy as np
import pytest

from hf_retrace.models.acceptance_retrace import AcceptanceEstimator
from hf_retrace.models.cost_model_retrace import StepCostModel
from hf_retrace.models.policy_settings_retrace import resolve_settings
from hf_retrace.models.sources_retrace import OnlineDatastoreSource, candidate_sources, propose_from_sources
from hf_retrace.models.speculation_retrace import PlanCalibration, SpeculationPolicy

BLOCK = 8
REPEATING = np.array([4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 4, 5, 6])


def _costs(row_ms: float, drafter_ms: float = 2.0, base_ms: float = 20.0) -> StepCostModel:
    """`t(R) = base + row * (R - 1)`, `d(B) = drafter`; no online refresh."""
    rows = [(r, (base_ms + row_ms * (r - 1)) / 1e3) for r in (1, 2, 4, 8, 16)]
    return StepCostModel.fit(rows, [(BLOCK, drafter_ms / 1e3)], alpha=0.0)


def _policy(kind: str, cost_model=None, explore_every: int = 32, **values) -> SpeculationPolicy:
    settings = resolve_settings({"speculation_policy": kind, **values}, BLOCK)
    return SpeculationPolicy(settings, candidate_sources(settings, None), BLOCK, cost_model,
                             explore_every=explore_every)  # fmt: skip


def test_fixed_is_the_first_proposing_source_then_the_drafter_with_the_confidence_stop():
    policy = _policy("fixed", prompt_lookup_num_tokens=4, num_assistant_tokens=5, assistant_confidence_threshold=0.5)
    plan = policy.plan([("a", REPEATING, 10), ("b", np.array([1, 2, 3]), 10), ("c", np.array([1, 2, 3]), 2)])
    source, tokens = propose_from_sources(policy.sources, REPEATING, 10)
    assert plan.action("a") == ("lookup", tokens, source.name) == ("lookup", [7, 8, 9, 4], "prompt_lookup")
    assert plan.action("b") == ("draft", 5) and plan.action("c") == ("draft", 2)  # the room caps the drafts
    assert plan.drafting == ["b", "c"]
    counts = policy.num_drafts(plan, {"b": [0.9, 0.8, 0.4, 0.9, 0.9, 0.9, 0.9], "c": [0.9, 0.9, 0.9]})
    assert counts == {"b": 2, "c": 2}
    assert _policy("fixed").plan([("a", REPEATING, 0)]).action("a") == ("none",)


def test_goodput_verifies_nothing_when_rows_are_dear_and_many_tokens_when_cheap():
    dear = _policy("goodput", _costs(row_ms=200.0, drafter_ms=50.0), prompt_lookup_num_tokens=4)
    plan = dear.plan([("a", REPEATING, 10), ("b", np.array([1, 2, 3]), 10)])
    assert plan.action("a") == ("none",) and plan.action("b") == ("none",) and plan.drafting == []

    cheap = _policy("goodput", _costs(row_ms=0.1, drafter_ms=1.0))
    plan = cheap.plan([("b", np.array([1, 2, 3]), 10)])
    assert plan.action("b") == ("draft", BLOCK - 1)
    assert cheap.num_drafts(plan, {"b": np.full(BLOCK - 1, 0.95)}) == {"b": BLOCK - 1}
    # after the drafter ran, a draft it does not believe in is not worth even a cheap row
    mid = _policy("goodput", _costs(row_ms=3.0, drafter_ms=1.0))
    plan = mid.plan([("b", np.array([1, 2, 3]), 10)])
    assert plan.drafting == ["b"]
    assert mid.num_drafts(plan, {"b": np.full(BLOCK - 1, 0.02)}) == {"b": 0}
    assert 0 < mid.num_drafts(plan, {"b": [0.99, 0.97, 0.95, 0.1, 0.1, 0.1, 0.1]})["b"] <= 3


def test_goodput_caps_drafts_by_num_assistant_tokens_and_the_room():
    policy = _policy("goodput", _costs(row_ms=0.1, drafter_ms=0.5), num_assistant_tokens=3)
    plan = policy.plan([("a", np.array([1, 2, 3]), 10), ("b", np.array([1, 2, 3]), 2)])
    assert plan.action("a") == ("draft", 3) and plan.action("b") == ("draft", 2)
    assert policy.num_drafts(plan, {"a": np.full(BLOCK - 1, 0.99), "b": np.full(BLOCK - 1, 0.99)}) == {"a": 3, "b": 2}


def test_goodput_needs_a_cost_model():
    with pytest.raises(ValueError, match="step-cost model"):
        _policy("goodput")


def test_outcomes_teach_the_estimator_and_step_times_refresh_the_costs():
    costs = _costs(row_ms=1.0, drafter_ms=1.0)
    costs.alpha = 0.5
    policy = _policy("goodput", costs)
    before = policy.estimator.estimate("drafter", _drafts(4))
    for _ in range(30):
        plan = policy.plan([("a", np.array([1, 2, 3]), 10)])
        policy.num_drafts(plan, {"a": np.full(BLOCK - 1, 0.75)})
        policy.outcome("a", 0)  # every first draft rejected
    assert policy.estimator.estimate("drafter", _drafts(4))[0] < before[0] - 0.2
    t4 = float(costs.target_seconds(4))
    policy.step_time(4, BLOCK, target_seconds=2 * t4, drafter_seconds=0.001)
    assert float(costs.target_seconds(4)) > t4


def test_goodput_explores_a_drafter_it_stopped_running_and_recovers_from_a_bad_profile():
    """A profile taken under a load spike says the drafter costs 40 ms; it really costs 1 ms. Without exploration
    the drafter would never run again, so neither its cost nor its acceptance would ever be observed."""
    costs = _costs(row_ms=1.0, drafter_ms=40.0)
    costs.alpha = 0.05
    policy = _policy("goodput", costs, explore_every=8)
    ran = []
    for step in range(64):
        plan = policy.plan([("a", np.array([1, 2, 3]), 10), ("b", np.array([4, 5, 6]), 10)])
        ran.append(bool(plan.drafting))
        counts = {}
        if plan.drafting:
            counts = policy.num_drafts(plan, {rid: np.full(BLOCK - 1, 0.95) for rid in plan.drafting})
            assert all(k >= 1 for k in counts.values())  # an exploring block verifies a draft
            for rid, k in counts.items():
                policy.outcome(rid, k)  # every draft accepted
        rows = 2 + sum(counts.values())
        policy.step_time(rows, BLOCK * len(plan.drafting), 0.02 + 0.001 * rows, 0.001 if plan.drafting else None)
    assert ran[:7] == [False] * 7 and ran[7], ran  # the first exploring run, after 8 steps without the drafter
    assert all(ran[-16:]), ran  # the costs and the acceptance it saw made drafting pay: it drafts every step
    assert float(costs.drafter_seconds(2 * BLOCK)) < 0.02  # the profile said 80 ms for two blocks


def test_a_new_request_explores_the_drafter_at_once_when_its_forward_is_cheap():
    """Its own drafter acceptance is unknown until it drafts; the global estimate says drafting does not pay. Where a
    drafter forward is cheap beside a step, the request drafts at its first step left without drafts (once); where it
    is dear, it waits for the periodic exploration."""
    pessimist = AcceptanceEstimator(drafter_prior=0.02)
    settings = resolve_settings({"speculation_policy": "goodput"}, BLOCK)
    cheap = SpeculationPolicy(settings, [], BLOCK, _costs(row_ms=1.0, drafter_ms=4.0), pessimist)
    ran = [cheap.plan([("a", np.array([1, 2, 3]), 10)]).drafting for _ in range(6)]
    assert ran == [["a"], [], [], [], [], []], ran
    cheap.finish("a")
    assert cheap.plan([("a", np.array([1, 2, 3]), 10)]).drafting == ["a"]  # a new request with the same id
    dear = SpeculationPolicy(settings, [], BLOCK, _costs(row_ms=1.0, drafter_ms=6.0),
                             AcceptanceEstimator(drafter_prior=0.02))  # fmt: skip
    assert not any(dear.plan([("a", np.array([1, 2, 3]), 10)]).drafting for _ in range(6))


def test_goodput_learns_the_lookups_it_did_not_verify_from_the_tokens_committed_after_them():
    """Rows are dear, so nothing is verified; prompt lookup's proposals are still scored against the target's next
    tokens, across commits, and teach its estimate (up and down)."""
    from hf_retrace.models.acceptance_retrace import ProposalFeatures

    def estimate(policy):
        return policy.estimator.estimate("prompt_lookup", ProposalFeatures.lookup(3, 4)).copy()

    policy = _policy("goodput", _costs(row_ms=200.0, drafter_ms=500.0), prompt_lookup_num_tokens=4)
    before = estimate(policy)
    tokens = REPEATING  # ... 4 5 6: prompt lookup proposes 7 8 9 4
    for _ in range(20):
        plan = policy.plan([("a", tokens, 10)])
        assert plan.action("a") == ("none",)
        policy.commit("a", [7, 8])  # the first two proposed tokens, in two commits
        policy.commit("a", [9, 4])
        policy.finish("a")
    learned_up = estimate(policy)
    assert (learned_up > before + 0.2).all(), (before, learned_up)
    for _ in range(20):
        policy.plan([("a", tokens, 10)])
        policy.commit("a", [7, 1])  # the second proposed token is not the target's
    learned_down = estimate(policy)
    assert learned_down[0] > before[0] and learned_down[1] < learned_up[1] - 0.2, (learned_up, learned_down)
    policy.finish("a")
    assert policy._shadows == {} and policy._lengths == {}


def test_an_exploring_step_prices_the_drafter_forward_it_ran():
    """Stage 1 planned no drafter (it is dear); the exploring forward still ran, so the final plan's `d(S)` is in
    its predicted step time, as the engine's measured time will have it."""
    costs = _costs(row_ms=200.0, drafter_ms=50.0)
    policy = _policy("goodput", costs, explore_every=1)
    plan = policy.plan([("a", np.array([1, 2, 3]), 10)])
    assert plan.drafting == ["a"] and plan.step.drafter_slots == 0  # exploring: stage 1 left the drafter out
    policy.num_drafts(plan, {"a": np.full(BLOCK - 1, 0.5)})
    final = policy.last_step
    assert final.drafter_slots == BLOCK
    assert final.expected_seconds == pytest.approx(costs.step_seconds(final.rows, BLOCK))


def test_exploration_is_bounded_and_rejects_bad_values():
    policy = _policy("goodput", _costs(row_ms=200.0, drafter_ms=50.0), explore_every=4)
    runs = sum(bool(policy.plan([("a", np.array([1, 2, 3]), 10)]).drafting) for _ in range(40))
    assert runs == 10  # one exploring drafter run per 4 steps, however dear
    with pytest.raises(ValueError, match="explore_every"):
        _policy("goodput", _costs(row_ms=1.0), explore_every=0)


def _drafts(k: int):
    from hf_retrace.models.acceptance_retrace import ProposalFeatures

    return ProposalFeatures.drafter(np.full(k, 0.75))


def test_the_online_datastore_learns_requests_and_frees_them():
    policy = _policy("goodput", _costs(row_ms=0.5, drafter_ms=50.0), online_datastore_num_tokens=6)
    (source,) = policy.sources
    assert isinstance(source, OnlineDatastoreSource) and source.store.max_bytes == 32 * 2**20
    policy.start("a", [1, 2, 3])
    policy.commit("a", [10, 11, 12, 13, 14, 15, 16])
    policy.finish("a")
    assert source.store.num_requests == 0 and source.store.num_responses == 1
    policy.start("b", [7, 10, 11])
    plan = policy.plan([("b", np.array([7, 10, 11]), 3)])
    assert plan.action("b") == ("lookup", [12, 13, 14], "online_datastore")  # never past its room
    policy.outcome("b", 3)
    policy.finish("b")
    assert policy.estimator.num_requests == 0 and source.store.num_requests == 0


def test_online_datastore_settings_are_checked():
    with pytest.raises(ValueError, match="online_datastore_max_bytes"):
        resolve_settings({"online_datastore_num_tokens": 4, "online_datastore_max_bytes": -1}, BLOCK)
    with pytest.raises(ValueError, match="speculation_policy"):
        resolve_settings({"speculation_policy": "greedy"}, BLOCK)


def test_plan_calibration_is_observed_over_predicted_shrunk_and_clipped():
    calibration = PlanCalibration(decay=1.0, strength=8.0)
    assert calibration.scale("drafter") == 1.0  # nothing seen: the estimates as they are
    for _ in range(92):
        calibration.update("drafter", predicted=2.0, observed=1)
    assert calibration.scale("drafter") == pytest.approx((92 + 8) / (184 + 8))
    assert calibration.scale("datastore") == 1.0  # per source
    for _ in range(1000):
        calibration.update("datastore", predicted=1.0, observed=0)
    assert calibration.scale("datastore") == calibration.low


class _OptimisticEstimator(AcceptanceEstimator):
    """Believes every draft survives with 0.9 and never learns otherwise: only the plan calibration can correct it."""

    def estimate(self, source, features, request_id=None):
        return np.full(features.num_tokens, 0.9)

    def update(self, source, features, num_accepted, request_id=None):
        pass


def test_goodput_calibrates_the_plans_it_chose_against_what_verification_accepted():
    settings = resolve_settings({"speculation_policy": "goodput"}, BLOCK)
    policy = SpeculationPolicy(settings, [], BLOCK, _costs(row_ms=3.0, drafter_ms=1.0), _OptimisticEstimator())
    confidences = {"a": np.full(BLOCK - 1, 0.9)}

    def verified(accept_all: bool) -> int:
        plan = policy.plan([("a", np.array([1, 2, 3]), 10)])
        if not plan.drafting:  # the drafter does not pay at all (or not yet: it explores every 32 steps)
            return 0
        k = policy.num_drafts(plan, confidences)["a"]
        policy.outcome("a", k if accept_all else 0)
        return k

    trusting = verified(accept_all=False)
    for _ in range(200):  # the chosen plans promised ~4 accepted drafts each, verification accepted none
        verified(accept_all=False)
    assert policy.calibration.scale("drafter") < 0.3
    assert verified(accept_all=False) < trusting
    for _ in range(400):  # now every verified draft is accepted: exploring blocks show it, the correction follows
        verified(accept_all=True)
    assert policy.calibration.scale("drafter") > 1.0
    assert verified(accept_all=True) >= trusting


@pytest.mark.parametrize("values", [{"decay": 0.0}, {"strength": 0.0}, {"low": 1.5}, {"high": 0.5}])
def test_plan_calibration_rejects_bad_values(values):
    with pytest.raises(ValueError, match="PlanCalibration needs"):
        PlanCalibration(**values)

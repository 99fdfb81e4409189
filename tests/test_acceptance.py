"""Acceptance estimates: usable from the first step (priors), calibrated by verification outcomes (synthetic
Bernoulli data with a known truth), per request shrunk toward the global estimate, freed with the request."""

import numpy as np
import pytest

from hf_retrace.models.acceptance_retrace import AcceptanceEstimator, ProposalFeatures


def _simulate(estimator, rng, truth, steps, source="drafter", request_id=None, make=None):
    """Verifies `steps` proposals whose tokens are accepted with the conditional probabilities `truth(features)`."""
    for _ in range(steps):
        features = make(rng)
        p = truth(features)
        accepted = int(np.argmin(np.append(rng.random(p.size) < p, False)))  # the first rejection, or K
        estimator.update(source, features, accepted, request_id=request_id)


def _drafter_features(rng, k=6):
    return ProposalFeatures.drafter(rng.random(k))


def test_priors_work_from_the_first_step():
    estimator = AcceptanceEstimator()
    confident = estimator.estimate("drafter", ProposalFeatures.drafter([0.95, 0.55, 0.05]))
    np.testing.assert_allclose(confident, [0.95, 0.55, 0.05])  # an untrained drafter is taken at its word
    lookup = estimator.estimate("prompt_lookup", ProposalFeatures.lookup(3, 4))
    np.testing.assert_allclose(lookup, [0.4] * 4)
    np.testing.assert_allclose(estimator.expected_drafter_acceptance("r", 3), [0.7] * 3)


def test_drafter_calibration_converges_on_bernoulli_data():
    """The drafter is overconfident: a draft of confidence c is accepted with probability c^2. After enough
    verifications every bin's estimate is within 0.05 of the truth, at every slot."""
    rng = np.random.default_rng(0)
    estimator = AcceptanceEstimator()
    _simulate(estimator, rng, lambda f: f.probabilities**2, 20000, make=_drafter_features)
    for slot in (0, 2):
        for confidence in (0.15, 0.55, 0.95):
            probabilities = np.full(slot + 1, 0.99)
            probabilities[slot] = confidence
            got = estimator.estimate("drafter", ProposalFeatures.drafter(probabilities))[slot]
            assert got == pytest.approx(confidence**2, abs=0.05), (slot, confidence)


def test_lookup_calibration_by_match_length():
    """Longer matches are accepted more often (truth 0.2 for 1-grams, 0.8 for 3-grams); the estimates learn both."""
    rng = np.random.default_rng(1)
    estimator = AcceptanceEstimator()
    make = lambda rng: ProposalFeatures.lookup(int(rng.integers(1, 4)), 3)  # noqa: E731
    truth = lambda f: np.full(3, {1: 0.2, 2: 0.5, 3: 0.8}[f.match_length])  # noqa: E731
    _simulate(estimator, rng, truth, 6000, source="prompt_lookup", make=make)
    for length, p in ((1, 0.2), (3, 0.8)):
        got = estimator.estimate("prompt_lookup", ProposalFeatures.lookup(length, 3))
        np.testing.assert_allclose(got, p, atol=0.06)


def test_continuation_estimates_by_count_probability():
    rng = np.random.default_rng(2)
    estimator = AcceptanceEstimator()
    make = lambda rng: ProposalFeatures.continuation(4, rng.random(2))  # noqa: E731
    _simulate(estimator, rng, lambda f: 0.5 * f.probabilities, 8000, source="online_datastore", make=make)
    got = estimator.estimate("online_datastore", ProposalFeatures.continuation(4, [0.95, 0.15]))
    np.testing.assert_allclose(got, [0.475, 0.075], atol=0.06)


def test_update_counts_successes_one_failure_and_nothing_after():
    estimator = AcceptanceEstimator(prior_strength=2.0)
    features = ProposalFeatures.lookup(2, 5)
    estimator.update("prompt_lookup", features, 2)
    successes, failures = estimator._tables["prompt_lookup"].counts()  # [match length, position]
    assert successes[2, :5].tolist() == [1, 1, 0, 0, 0]
    assert failures[2, :5].tolist() == [0, 0, 1, 0, 0]
    estimator.update("prompt_lookup", features, 5)  # all accepted: no failure anywhere
    successes, failures = estimator._tables["prompt_lookup"].counts()
    assert successes[2, :5].tolist() == [2, 2, 1, 1, 1] and failures.sum() == 1
    with pytest.raises(ValueError, match="num_accepted"):
        estimator.update("prompt_lookup", features, 6)
    with pytest.raises(ValueError, match="unknown proposal source"):
        estimator.estimate("tea_leaves", features)


def test_per_request_estimates_shrink_toward_global():
    rng = np.random.default_rng(3)
    estimator = AcceptanceEstimator()
    # most requests are average (truth 0.5); request "echo" repeats itself (truth 0.95)
    make = lambda rng: ProposalFeatures.lookup(3, 4)  # noqa: E731
    _simulate(estimator, rng, lambda f: np.full(4, 0.5), 3000, source="prompt_lookup", make=make)
    features = make(rng)
    global_ = estimator.estimate("prompt_lookup", features)
    one = AcceptanceEstimator(**{k: getattr(estimator, k) for k in ("prior_strength", "lookup_prior")})
    estimator.update("prompt_lookup", features, 4, request_id="echo")
    after_one = estimator.estimate("prompt_lookup", features, "echo")
    _simulate(estimator, rng, lambda f: np.full(4, 0.95), 20, source="prompt_lookup", request_id="echo", make=make)
    after_many = estimator.estimate("prompt_lookup", features, "echo")
    assert np.all(global_ < after_one) and np.all(after_one < after_many)  # shrunk: one success moves it a little
    assert after_many[0] > 0.8 and estimator.estimate("prompt_lookup", features, "other")[0] < 0.6
    assert one.num_requests == 0 and estimator.num_requests == 1
    estimator.forget("echo")
    assert estimator.num_requests == 0
    np.testing.assert_allclose(estimator.estimate("prompt_lookup", features, "echo"),
                               estimator.estimate("prompt_lookup", features))  # fmt: skip


def test_expected_drafter_acceptance_follows_slots_and_request_history():
    rng = np.random.default_rng(4)
    estimator = AcceptanceEstimator()
    truth = lambda f: np.linspace(0.9, 0.3, f.num_tokens)  # noqa: E731  later slots are harder
    _simulate(estimator, rng, truth, 5000, make=lambda rng: _drafter_features(rng, 8))
    expected = estimator.expected_drafter_acceptance(None, 8)
    np.testing.assert_allclose(expected, np.linspace(0.9, 0.3, 8), atol=0.07)
    for _ in range(10):  # this request's drafts are all rejected at the first slot
        estimator.update("drafter", _drafter_features(rng, 8), 0, request_id="hard")
    # 10 failures against ~4 predicted acceptances (decayed), shrunk by 4 pseudo-acceptances: about half
    assert np.all(estimator.expected_drafter_acceptance("hard", 8) < 0.55 * expected)

"""The step-cost model: monotone curves fitted from a profile, refreshed online without being wrecked by outliers,
cached per host and configuration, refused (re-measured) when the file is another host's, an error when corrupt."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from hf_retrace.models.cost_model_retrace import (
    CostCurve,
    StepCostModel,
    cpu_features,
    cpu_model,
    default_cache_path,
    host_key,
    measure,
)


def _model(**kwargs):
    # the vLLM compiled numbers on 2 cores: t(1) = 19.2 ms, t(8) = 38.8 ms
    return StepCostModel.fit([(1, 0.0192), (8, 0.0388)], [(16, 0.004), (128, 0.032)], **kwargs)


def _key(**overrides):
    fields = dict(engine="vllm", target_id="Qwen/Qwen3-0.6B", dtype="float32", num_threads=2, compiled=True)
    return host_key(**(fields | overrides))


def test_curve_interpolates_extrapolates_and_costs_nothing_at_zero():
    curve = CostCurve([1, 8], [0.0192, 0.0388])
    assert curve(0) == 0.0
    assert curve(1) == pytest.approx(0.0192) and curve(8) == pytest.approx(0.0388)
    assert curve(2) == pytest.approx(0.0220)  # 2.8 ms a row
    assert curve(16) == pytest.approx(0.0388 + 8 * 0.0028)  # the last slope continues
    assert curve(0.5) == pytest.approx(0.0192)  # below the first knot: its time
    np.testing.assert_allclose(curve(np.array([1, 8])), [0.0192, 0.0388])
    assert CostCurve([16], [0.004])(32) == pytest.approx(0.008)  # one knot: proportional


@pytest.mark.parametrize("num_knots", [1, 2, 7])
def test_one_size_is_priced_as_the_array_path_prices_it(num_knots):
    # plans compare sums of these prices: a scalar fast path that rounded differently could flip a choice
    rng = np.random.default_rng(num_knots)
    curve = CostCurve(np.cumsum(rng.uniform(0.5, 9.0, num_knots)), np.cumsum(rng.uniform(0.0, 0.02, num_knots)))
    sizes = np.concatenate([curve.sizes, rng.uniform(-2.0, 1.6 * curve.sizes[-1], 200), [0.0, -1.0, 1.0, 2.0, 640.0]])
    priced = curve(sizes)
    for size, price in zip(sizes.tolist(), priced.tolist()):
        assert curve(size) == price and curve(np.float64(size)) == price
        assert type(curve(size)) is float
    assert curve(3) == curve(np.array([3]))[0] == curve(np.int64(3))


def test_marginal_row_cost_is_the_slope():
    model = _model()
    assert model.marginal_row_cost(1) == pytest.approx(0.0028)
    assert model.step_seconds(8, 0) == pytest.approx(0.0388)
    assert model.step_seconds(8, 128) == pytest.approx(0.0388 + 0.032)
    assert model.drafter_seconds(0) == 0.0


def test_fit_takes_medians_and_makes_the_curve_monotone():
    samples = [(1, 0.010), (1, 0.011), (1, 0.500), (2, 0.012), (4, 0.011), (4, 0.0112), (8, 0.020)]
    curve = CostCurve.fit(samples)
    assert curve.sizes.tolist() == [1, 2, 4, 8]
    assert curve.seconds[0] == pytest.approx(0.011)  # the 0.5 s outlier is one of three: the median ignores it
    assert np.all(np.diff(curve.seconds) >= 0)  # 4 rows measured faster than 2: pooled, never cheaper
    assert curve.seconds[1] == pytest.approx(curve.seconds[2])


@pytest.mark.parametrize("sizes, seconds", [([], []), ([1, 1], [0.1, 0.2]), ([0, 1], [0.1, 0.2]), ([1], [-1.0])])
def test_invalid_curves_are_refused(sizes, seconds):
    with pytest.raises(ValueError):
        CostCurve(sizes, seconds)


def test_observe_converges_to_the_host_and_shrugs_off_outliers():
    model = _model(alpha=0.1)
    for _ in range(200):  # this host is 25% slower than the profile said
        model.observe(4, 0, 1.25 * 0.0276)
    assert model.target_seconds(4) == pytest.approx(1.25 * 0.0276, rel=0.03)
    before = model.target_seconds(4)
    model.observe(4, 0, 10.0)  # a stalled step (page fault, another process)
    assert model.target_seconds(4) <= before * (1 + 0.1 * 0.5) + 1e-12
    assert np.all(np.diff(model.target.seconds) >= 0)


def test_observe_outside_the_profile_adds_a_knot_and_splits_drafter_time():
    model = _model(alpha=1.0)
    model.observe(64, 0, 0.250)
    assert 64 in model.target.sizes and model.target_seconds(64) > 0.0388
    t, d = model.target_seconds(8), model.drafter_seconds(128)
    model.observe(8, 128, 2 * (t + d))  # twice the prediction, no drafter timing: both parts scale
    assert model.target_seconds(8) / t == pytest.approx(model.drafter_seconds(128) / d, rel=1e-6)
    model.observe(8, 128, 0.06, drafter_seconds=0.01)  # timed apart: the drafter's own time
    assert model.num_observed == 3


def test_observe_inside_a_wide_gap_adds_a_knot_where_the_engine_runs():
    """A profile up to 8 rows and a prefill knot at 100: steps of 12 to 20 rows get knots of their own, so their
    slope is learned from them, not from the prefill's line; next to a knot (9 rows), the knot learns instead."""
    truth = CostCurve([1, 8, 100], [0.040, 0.050, 0.100])  # a dear row up to 8, a cheap one beyond (prefill)
    curve = CostCurve(truth.sizes, truth.seconds)
    curve.observe(9, 0.052, 0.05, 0.5)
    assert curve.sizes.tolist() == [1, 8, 100]
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = int(rng.integers(12, 21))
        curve.observe(rows, 0.050 + 0.0015 * (rows - 8), 0.05, 0.5)  # 1.5 ms a row here
    assert len(curve.sizes) > 3 and all(12 <= s <= 20 for s in curve.sizes[2:-1])
    assert curve(20) - curve(12) == pytest.approx(8 * 0.0015, rel=0.15)
    assert truth(20) - truth(12) < 0.5 * 8 * 0.0015  # what the prefill's line would have priced


def _two_kinds_of_rows(model, per_request, steps=2000, seed=0):
    """Steps of 2-16 requests, each verifying 0-2 tokens: 1 ms a row of either kind, plus `per_request` for each
    request's own row (its sampling, the engine's per-request work)."""
    rng = np.random.default_rng(seed)
    truth = CostCurve([1, 256], [0.040, 0.040 + 0.001 * 255])
    for _ in range(steps):
        n = int(rng.integers(2, 17))
        verified = int(rng.integers(0, 3, size=n).sum())
        seconds = truth(n + verified) + per_request * n + rng.normal(0.0, 0.001)
        model.observe(n + verified, 0, seconds, None, 0, 0, (n, verified))
    return truth


def test_a_request_row_is_priced_apart_from_a_verified_row():
    """Requests' own rows cost 2 ms more than verified rows: the request term learns the difference and a verified
    row is priced at its 1 ms; with one curve over rows (no window to fit on) it is priced as a mix of both."""
    knots = CostCurve([1, 2, 4, 8, 16, 32, 48], [0.040, 0.041, 0.043, 0.047, 0.055, 0.071, 0.087])
    learned = StepCostModel(CostCurve(knots.sizes, knots.seconds), CostCurve([16], [0.005]))
    _two_kinds_of_rows(learned, 0.002)
    assert learned.per_request == pytest.approx(0.002, abs=2e-4)
    assert learned.marginal_row_cost(12) == pytest.approx(0.001, rel=0.25)
    assert learned.step_seconds(20, 0, requests=10) == pytest.approx(0.040 + 0.019 + 0.020, rel=0.05)
    one_curve = StepCostModel(CostCurve(knots.sizes, knots.seconds), CostCurve([16], [0.005]), context_window=0)
    _two_kinds_of_rows(one_curve, 0.002)
    assert one_curve.per_request == 0.0 and one_curve.marginal_row_cost(12) > 1.5e-3


def test_the_request_term_is_kept_where_requests_do_not_vary():
    """Batch 1 (one request every step) cannot tell a request's row from a verified one: `e` keeps its value."""
    model = StepCostModel(CostCurve([1, 8, 32, 64], [0.05, 0.08, 0.15, 0.25]), CostCurve([16], [0.01]),
                          per_request=0.002)  # fmt: skip
    _one_request_at_a_time(model, 1e-6, 0.0)
    assert model.fits > 0 and model.per_request == 0.002
    with pytest.raises(ValueError, match="per_request must be a finite number"):
        StepCostModel(CostCurve([1], [0.05]), CostCurve([16], [0.01]), per_request=-1.0)


def test_measure_times_each_size(monkeypatch):
    calls = []
    samples = measure(calls.append, [1, 4], repeats=2, warmup=1)
    assert calls == [1, 1, 1, 4, 4, 4] and [s for s, _ in samples] == [1, 1, 4, 4]
    assert all(t >= 0 for _, t in samples)


def test_host_key_names_the_cpu_and_cache_path(monkeypatch, tmp_path):
    key = _key()
    assert key.cpu == cpu_model() and key.cpu
    assert key.cpu_features == cpu_features()  # the same model name covers AVX2-only and AVX-512 machines
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path))
    path = default_cache_path(key)
    assert path.parent == tmp_path / "cost" and path.name == f"vllm-{key.digest()}.json"
    assert _key(compiled=False).digest() != key.digest()


def test_save_load_round_trip(tmp_path):
    model, key = _model(), _key()
    model.observe(3, 0, 0.03)
    model.save(tmp_path / "cost.json", key)
    loaded = StepCostModel.load(tmp_path / "cost.json", key)
    np.testing.assert_allclose(loaded.target.seconds, model.target.seconds)
    np.testing.assert_allclose(loaded.drafter.sizes, model.drafter.sizes)
    assert StepCostModel.load(tmp_path / "missing.json", key) is None


@pytest.mark.parametrize("field, value", [("cpu", "Another CPU @ 9 GHz"), ("compiled", False), ("num_threads", 8),
                                          ("cpu_features", "avx2,avx512f,avx512_bf16")])  # same model name, AVX-512
def test_a_file_from_another_host_or_config_is_refused(tmp_path, caplog, field, value):
    path = tmp_path / "cost.json"
    _model().save(path, _key())
    payload = json.loads(path.read_text())
    payload["key"][field] = value
    path.write_text(json.dumps(payload))
    with caplog.at_level(logging.WARNING):
        assert StepCostModel.load(path, _key()) is None
    assert field in caplog.text and "re-measuring" in caplog.text


@pytest.mark.parametrize("text", ["{not json", '{"format": "other"}', "[]",
                                  '{"format": "hf_retrace-step-cost", "version": 1, "key": {}, "target": 3}'])
def test_a_corrupt_file_raises(tmp_path, text):
    path = tmp_path / "cost.json"
    path.write_text(text)
    key = _key()
    if "target" in text:  # a well-formed header for this key, broken knots
        payload = json.loads(text) | {"key": json.loads(json.dumps(key.__dict__)), "drafter": [[16, 0.004]]}
        path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="step-cost file"):
        StepCostModel.load(path, key)


def _context_steps(model, a, c, steps=3000, noise=0.002, seed=0):
    """Feeds `model` steps of 4-32 requests of 100-4000 tokens, each verifying 0-3 tokens, timed by a fixed curve
    plus `a` per context token of a request's first row and `c` per context token of its other rows."""
    rng = np.random.default_rng(seed)
    truth = CostCurve([1, 8, 32, 64], [0.05, 0.08, 0.15, 0.25])
    for _ in range(steps):
        n = int(rng.integers(4, 33))
        lengths, verified = rng.integers(100, 4000, size=n), rng.integers(0, 4, size=n)
        rows, first, other = n + int(verified.sum()), int(lengths.sum()), int((verified * lengths).sum())
        seconds = truth(rows) + a * first + c * other + rng.normal(0.0, noise)
        model.observe(rows, 0, seconds, None, first, other, (n, int(verified.sum())))
    return truth


@pytest.mark.parametrize(
    "a, c", [(1e-6, 1e-6), (1e-6, 0.0), (0.0, 0.0)], ids=["every-row-reads", "first-row-reads", "no-context-cost"]
)
def test_context_costs_are_learned_from_how_step_times_vary(a, c):
    """Whether a kernel reads a request's K/V once per row or once per request, the two terms are told apart; where
    context costs nothing they stay near 0 and the knots keep the steps' level."""
    model = StepCostModel(CostCurve([1, 8, 32, 64], [0.05, 0.08, 0.15, 0.25]), CostCurve([16], [0.01]), )
    truth = _context_steps(model, a, c)
    first, other = model.context
    assert first == pytest.approx(a, abs=3e-7) and other == pytest.approx(c, abs=4e-7)
    assert model.target(32) == pytest.approx(truth(32), rel=0.1)
    # a verified row of a long request costs more than one of a short request exactly when other rows read
    assert model.marginal_row_cost(32, 4000) - model.marginal_row_cost(32, 100) == pytest.approx(3900 * other)


def _one_request_at_a_time(model, a, c, requests=60, noise=0.002, seed=0):
    """Batch 1: requests of 100-5000 prompt tokens, 64 new tokens each, verifying 0-8 tokens a step: `K` grows
    slowly within a request and jumps between requests (a learner normalised by the steps' spread alone blew up
    here in an engine)."""
    rng = np.random.default_rng(seed)
    truth = CostCurve([1, 8, 32, 64], [0.05, 0.08, 0.15, 0.25])
    for _ in range(requests):
        length = int(rng.integers(100, 5000))
        end = length + 64
        while length < end:
            rows = int(rng.integers(1, 10))
            first, other = length, (rows - 1) * length + rows * (rows - 1) // 2
            seconds = truth(rows) + a * first + c * other + rng.normal(0.0, noise)
            model.observe(rows, 0, seconds, None, first, other, (1, rows - 1))
            length += int(rng.integers(1, rows + 1))
    return truth


@pytest.mark.parametrize("a, c", [(1e-6, 1e-6), (0.0, 0.0)], ids=["every-row-reads", "no-context-cost"])
def test_context_costs_at_batch_1_stay_bounded(a, c):
    model = StepCostModel(CostCurve([1, 8, 32, 64], [0.05, 0.08, 0.15, 0.25]), CostCurve([16], [0.01]), )
    truth = _one_request_at_a_time(model, a, c)
    first, other = model.context
    assert first == pytest.approx(a, abs=5e-7) and other == pytest.approx(c, abs=3e-7)
    assert model.target(4) == pytest.approx(truth(4), rel=0.05)


def test_context_costs_are_kept_with_no_window():
    model = StepCostModel(CostCurve([1, 8, 32, 64], [0.05, 0.08, 0.15, 0.25]), CostCurve([16], [0.01]),
                          context=(1e-7, 0.0), context_window=0)  # fmt: skip
    _context_steps(model, 1e-6, 1e-6, steps=200)
    assert model.context == (1e-7, 0.0) and model.fits == 0
    with pytest.raises(ValueError, match="context_window must be >= 0"):
        StepCostModel(CostCurve([1], [0.05]), CostCurve([16], [0.01]), context_window=-1)


@pytest.mark.parametrize("level", [0.7, 1.3], ids=["knots-30%-fast", "knots-30%-slow"])
def test_context_costs_do_not_take_the_level_of_knots_that_start_off(level):
    """Knots profiled 30% off the host's level: the knots catch up with it and the terms still learn only what the
    contexts add (an online learner that read the knots took the level into `a`, and the knots fell to 0)."""
    curve = CostCurve([1, 8, 32, 64], np.array([0.05, 0.08, 0.15, 0.25]) * level)
    model = StepCostModel(curve, CostCurve([16], [0.01]))
    truth = _context_steps(model, 1e-6, 2e-7)
    first, other = model.context
    assert first == pytest.approx(1e-6, abs=1e-7) and other == pytest.approx(2e-7, abs=1e-7)
    assert model.target(32) == pytest.approx(truth(32), rel=0.03)
    assert model.marginal_row_cost(40, 2000) == pytest.approx(truth(41) - truth(40) + 2e-7 * 2000, rel=0.05)


def test_context_costs_predict_a_logged_engine_at_32_running():
    """The step log of vLLM (compiled, 2 cores) serving 32 requests at once (`HF_RETRACE_VLLM_STEP_LOG`), replayed
    from that engine's own start-up profile (short contexts; served steps took up to twice as long): with the terms
    fitted as it goes, the model predicts the later decode steps more than twice as closely as the knots alone, and
    prices a long request's verified rows higher."""
    log = json.loads((Path(__file__).parent / "data" / "vllm_steps_32_running.json").read_text())
    sizes, seconds = zip(*log["profile_target"])

    def replay(window):
        model = StepCostModel(CostCurve(sizes, seconds), CostCurve([16], [0.005]), context_window=window)
        pairs = []
        for step in log["steps"]:
            first, other = step["context"]
            decode = step["prefill_rows"] == 0 and step["decoding"] > 0
            if decode:
                pairs.append((model.step_seconds(step["rows"], 0, first, other), step["target_s"]))
            rows = (step["decoding"], step["verified"]) if decode else None
            model.observe(step["rows"], 0, step["target_s"], None, first, other, rows)
        predicted, measured = np.array(pairs[len(pairs) // 3 :]).T
        return model, float(np.abs(predicted - measured).mean())

    knots_only, knots_error = replay(0)
    learned, error = replay(512)
    assert error < 0.5 * knots_error, (error, knots_error)
    first, other = learned.context
    assert 2e-6 < first < 4e-6 and 0.5e-6 < other < 1.5e-6  # seconds per token: the offline fit's 3.0 and 0.9 us
    assert learned.fits > 10 and learned.fit_r2[0] > 0.95 > 0.85 > learned.fit_r2[1]
    assert learned.marginal_row_cost(32, 700) > learned.marginal_row_cost(32, 100)


def test_context_costs_are_saved_and_an_older_file_reads_as_none(tmp_path):
    key = host_key("transformers", "t", "float32", 2, False)
    model = StepCostModel.fit([(1, 0.02), (8, 0.04)], [(16, 0.005)], context=(2e-7, 1e-7), per_request=1e-3)
    model.save(tmp_path / "m.json", key)
    loaded = StepCostModel.load(tmp_path / "m.json", key)
    assert loaded.context == (2e-7, 1e-7) and loaded.per_request == 1e-3
    payload = json.loads((tmp_path / "m.json").read_text())
    del payload["per_request"]
    payload["version"] = 2  # written before the request term: it reads as 0
    (tmp_path / "v2.json").write_text(json.dumps(payload))
    assert StepCostModel.load(tmp_path / "v2.json", key).per_request == 0.0
    del payload["context"]
    payload["version"] = 1  # written before the context terms: they read as 0
    (tmp_path / "old.json").write_text(json.dumps(payload))
    assert StepCostModel.load(tmp_path / "old.json", key).context == (0.0, 0.0)
    payload["version"], payload["context"] = 2, [1e-7, -1.0]
    (tmp_path / "bad.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="context costs must be finite numbers >= 0"):
        StepCostModel.load(tmp_path / "bad.json", key)
    with pytest.raises(ValueError, match="context must be"):
        StepCostModel.fit([(1, 0.02)], [(16, 0.005)], context=(1e-7,))

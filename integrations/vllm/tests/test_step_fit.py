"""The context terms fitted offline from a step log (`hf_retrace_vllm.step_fit`); numpy only, no engine."""

import json
from pathlib import Path

import numpy as np
import pytest

from hf_retrace_vllm.shared.cost_model_retrace import CostCurve, StepCostModel, host_key
from hf_retrace_vllm.step_fit import fit_context_terms, knots_without_context, main, read_step_log, write_terms


LOGGED = Path(__file__).resolve().parents[3] / "tests" / "data" / "vllm_steps_32_running.json"


def _steps(a, c, num_steps=400, seed=0):
    """Decode steps of 1-32 requests of 100-3000 tokens verifying 0-4 tokens each, timed as 30 ms + 1.5 ms a request
    + 1.2 ms a verified row + `a` per first-row context token + `c` per verified-row context token, 2 ms noise; and
    a few prefill steps, whose time the fit must not read."""
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(num_steps):
        n = int(rng.integers(1, 33))
        lengths, verified = rng.integers(100, 3000, size=n), rng.integers(0, 5, size=n)
        first, other = int(lengths.sum()), int((verified * lengths).sum())
        seconds = 0.03 + 0.0015 * n + 0.0012 * verified.sum() + a * first + c * other + rng.normal(0, 0.002)
        prefill = 500 if i % 40 == 0 else 0
        steps.append({"rows": n + int(verified.sum()) + prefill, "requests": n, "decoding": n,
                      "verified": int(verified.sum()), "prefill_rows": prefill, "context": [first, other],
                      "target_s": seconds + (5.0 if prefill else 0.0)})  # fmt: skip
    return steps


@pytest.mark.parametrize("a, c", [(3e-6, 1e-6), (3e-6, 0.0)], ids=["every-row-reads", "first-row-reads"])
def test_the_fit_recovers_the_context_terms(a, c):
    fit = fit_context_terms(_steps(a, c))
    assert fit.first == pytest.approx(a, abs=2e-7) and fit.other == pytest.approx(c, abs=2e-7)
    assert fit.other >= 0 and fit.r2 > 0.95 and fit.r2 > fit.r2_rows_only and fit.steps == 390
    assert fit.per_request == pytest.approx(0.0015 - 0.0012, abs=1.5e-4)  # a request's row beyond a verified row


def test_the_logged_engine_reads_its_context_at_a_few_microseconds_a_token():
    """The step log of vLLM serving 32 requests at once on 2 cores: the contexts explain most of what rows alone
    leave (R^2 0.80 to 0.97), a request's first row reading ~3 us a token and a verified row ~0.9 us."""
    fit = fit_context_terms(json.loads(LOGGED.read_text())["steps"])
    assert fit.r2_rows_only < 0.85 < 0.95 < fit.r2
    assert 2e-6 < fit.first < 4e-6 and 0.5e-6 < fit.other < 1.5e-6


def test_knots_give_back_the_contexts_they_learned():
    """Knots at 8 and 32 rows that learned steps of known mean contexts lose `a * K + c * X` at those means; a knot
    no step reached (128) is kept."""
    curve = CostCurve([8, 32, 128], [0.05, 0.10, 0.30])
    steps = [{"rows": 8, "context": [2000, 1000]}] * 5 + [{"rows": 32, "context": [10000, 4000]}] * 5
    out = knots_without_context(curve, steps, 2e-6, 1e-6)
    assert out.seconds.tolist() == pytest.approx([0.05 - 0.005, 0.10 - 0.024, 0.30])


def test_terms_are_written_into_the_cost_file(tmp_path, capsys):
    key = host_key("vllm", "t", "float32", 2, True)
    path = tmp_path / "cost.json"
    StepCostModel(CostCurve([1, 8, 32, 64], [0.04, 0.06, 0.12, 0.2]), CostCurve([16], [0.005])).save(path, key)
    steps = _steps(3e-6, 1e-6)
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    main(["--log", str(log), "--cache", str(path), "--write"])
    out = capsys.readouterr().out
    assert "a = 3.0" in out and "e = 0." in out
    model = StepCostModel.load(path, key)
    assert model.per_request == pytest.approx(3e-4, abs=1.5e-4)
    assert model.context[0] == pytest.approx(3e-6, abs=2e-7) and model.context[1] == pytest.approx(1e-6, abs=2e-7)
    assert model.target(32) < 0.12  # the knot gave back the contexts of the steps it learned from
    assert model.drafter(16) == pytest.approx(0.005)
    again = write_terms(path, steps, fit_context_terms(steps))  # the same fit again: the knots stay
    assert again.context == model.context and again.per_request == model.per_request
    assert again.target.seconds.tolist() == model.target.seconds.tolist()


def test_bad_logs_are_clear_errors(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text('{"rows": 3}\n')
    with pytest.raises(ValueError, match="is not a step-log line"):
        read_step_log(log)
    with pytest.raises(ValueError, match="a fit needs 50"):
        fit_context_terms(_steps(1e-6, 0.0, num_steps=20))

"""`benchmarks/diagnostics/replay_step_log.py`: a step log replayed through the step-cost model, engine by engine,
prices a verified row at what it cost where requests' own rows cost more."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "replay_step_log.py"


@pytest.fixture(scope="module")
def replay():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("replay_step_log", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(decoding, verified, prefill=0):
    """3 ms a request's own row, 1 ms a verified row, 0.5 ms a prefill row, over 40 ms."""
    seconds = (40 + 3 * decoding + 1 * verified + 0.5 * prefill) / 1e3
    return {"rows": decoding + verified + prefill, "requests": decoding + (prefill > 0), "decoding": decoding,
            "verified": verified, "prefill_rows": prefill, "context": [0, 0], "slots": 0, "target_s": seconds,
            "drafter_s": 0.0, "predicted_s": seconds, "committed": decoding, "verifying": min(decoding, verified),
            "policy_s": 0.0, "context_kv_s": 0.0, "propose_s": 0.0}  # fmt: skip


def _log(seed=0):
    """A batch-1 engine (4 prompts, each a prefill then 40 steps) and an engine of 5-8 running (2 groups of a
    prefill then 120 steps), as the serving bench logs them."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(4):
        steps += [_step(0, 0, prefill=150)] + [_step(1, int(rng.integers(0, 5))) for _ in range(40)]
    for _ in range(2):
        steps.append(_step(2, 0, prefill=300))
        for _ in range(120):
            n = int(rng.integers(5, 9))
            steps.append(_step(n, int(rng.integers(0, 2, size=n).sum())))
    return steps


def test_the_log_is_cut_into_engines_where_the_largest_batch_changes(replay):
    engines = replay.engines(_log())
    assert [len(e) for e in engines] == [4 * 41, 2 * 121]


def test_a_replay_prices_a_verified_row_apart_from_a_request_row(replay, capsys):
    steps = _log()
    model = replay.replay(steps, 40.5, 1.2)
    assert model.per_request == pytest.approx(2e-3, abs=5e-4)
    assert model.marginal_row_cost(10) == pytest.approx(1e-3, rel=0.3)
    late = [s for s in steps[-100:] if s["prefill_rows"] == 0]
    errors = [abs(s["replayed_s"] - s["target_s"]) for s in late]
    assert max(errors) < 3e-3  # ms-level: the late steps are predicted by what the model learned
    replay.table(steps)
    assert "| 5-8 |" in capsys.readouterr().out

"""`benchmarks/diagnostics/step_log_table.py`: a vLLM step log's decode steps by (verifying, verified), and its
prompt groups apart, on a small synthetic log."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "step_log_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("step_log_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(decoding, verified, prefill=0, verifying=None, target_s=0.1, propose_s=0.01, committed=None):
    verifying = min(decoding, verified) if verifying is None else verifying
    return {"rows": decoding + verified + prefill, "requests": decoding + (prefill > 0), "decoding": decoding,
            "verified": verified, "prefill_rows": prefill, "context": [0, 0], "slots": 0, "target_s": target_s,
            "drafter_s": 0.0, "predicted_s": 0.0, "committed": decoding if committed is None else committed,
            "verifying": verifying, "policy_s": 0.005, "context_kv_s": 0.001, "propose_s": propose_s}  # fmt: skip


def _log(tmp_path):
    group = [_step(1, 0, prefill=300), _step(32, 0, target_s=0.09), _step(32, 16, target_s=0.12, committed=40),
             _step(32, 16, target_s=0.13, committed=36), _step(31, 4, prefill=200, target_s=0.3)]  # fmt: skip
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in group + group))
    return path


def test_groups_start_at_a_prefill_with_few_decoding(table, tmp_path):
    steps = table.read(str(_log(tmp_path)))
    groups = table.split_groups(steps)
    assert [len(g) for g in groups] == [5, 5]


def test_tables_sum_the_decode_steps(table, tmp_path, capsys):
    steps = table.read(str(_log(tmp_path)))
    table.by_rows(steps, min_decoding=30)
    rows = capsys.readouterr().out.splitlines()
    assert "| 0 | 0 | 2 | 80.0 | 80.0 |" in rows  # 90 ms less the proposer's 10
    assert "| 16 | 16 | 4 | 115.0 | 115.0 |" in rows
    table.by_group(steps, min_decoding=30)
    out = capsys.readouterr().out
    # a group: 5 steps, 0.74 s; 3 decode steps of 32 requests, 32 verified rows, 12 accepted, 340 ms for 108 tokens
    assert "| 0 | 5 | 0.7 | 3 | 32.0 | 32 | 12 | 3.15 |" in out.splitlines()


def test_prices_are_the_slopes_in_verified_rows_by_load(table):
    """Steps of 5-8 requests where a verified row costs 1.3 ms and the model priced it 0.7 ms, and steps of one
    request where both say 0.9 ms: each bucket reads its own slope, whatever a request's own row costs."""
    steps = []
    for n in (1, 5, 6, 7, 8):
        for v in range(0, 12, 2):
            row = 1.3 if n > 1 else 0.9
            priced = 0.7 if n > 1 else 0.9
            step = _step(n, v, target_s=(30 + 2.5 * n + row * v) / 1e3)
            step["predicted_s"] = (31 + 2.0 * n + priced * v) / 1e3
            step["context"] = [300 * n, 250 * v]
            steps.append(step)
    prices = {p["requests"]: p for p in table.verified_row_prices(steps)}
    assert set(prices) == {"5-8"}  # one request: 6 steps, fewer than a bucket needs
    assert prices["5-8"]["measured"] == pytest.approx(1.3) and prices["5-8"]["model"] == pytest.approx(0.7)
    assert prices["5-8"]["context"] == pytest.approx(250) and prices["5-8"]["steps"] == 24
    steps += [dict(s, decoding=1, requests=1) for s in steps[:6]] * 2  # 18 one-request steps now
    assert {p["requests"] for p in table.verified_row_prices(steps)} == {"1", "5-8"}


def test_a_gzipped_log_reads_as_the_plain_one(table, tmp_path):
    plain = _log(tmp_path)
    zipped = tmp_path / "steps.jsonl.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    assert table.read(str(zipped)) == table.read(str(plain))


def test_arms_keep_the_steps_whose_two_plans_shared_an_arm(table, capsys):
    """A plain step's line after a speculating one holds the speculating plan's verification: no sample. Steps with
    a prompt chunk and lines written before the `plain` field are none either."""
    steps = []
    for i in range(24):  # 32 decoding: runs of 4 plain plans after 8 speculating ones
        plain = i % 12 >= 8
        step = _step(32, 0 if plain else 16, target_s=0.12 if plain else 0.18, committed=32 if plain else 40)
        steps.append(step | {"plain": plain})
    steps.insert(5, _step(32, 4, prefill=100) | {"plain": False})
    steps.insert(0, _step(32, 16))  # an older line: no `plain`
    samples = table.arm_samples(steps)
    assert sorted(samples) == [(20, "plain"), (20, "speculate")]
    assert samples[20, "plain"] == [(pytest.approx(120.0), 32)] * 6  # 2 runs of 4, the first of each no sample
    # 16 speculating lines, less the first of the log (after an older line) and the second run's first (after a
    # plain one); the line after the prompt chunk's counts (that step's plan speculated too)
    assert samples[20, "speculate"] == [(pytest.approx(180.0), 40)] * 14
    table.by_arm(steps, min_decoding=1)
    assert "| 20 (29.3-34.9) | 14 | 4.50 | 6 | 3.75 | 0.833 [0.833, 0.833] |" in capsys.readouterr().out.splitlines()


def test_arms_are_priced_by_tokens_summed(table):
    """Three 150 ms speculating steps committing 1, 1 and 7 tokens: 50 ms a token, not their median ratio's 150."""
    pairs = table.np.array([[150.0, 1], [150.0, 1], [150.0, 7]])
    assert table.per_token(pairs) == pytest.approx(50.0)

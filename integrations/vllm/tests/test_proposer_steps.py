"""The proposer's steps as the step-cost model sees them: a renamed vLLM attribute fails at start-up naming the
supported version; after a short generation every engine step has a `StepRecord` with sane rows, drafter slots and
timings (also summed into the stats file); the start-up profile's samples grow with the rows and slots they time."""

import json
import types

import pytest
from test_lossless_random import write_drafter

from conftest import close_llm, greedy, make_llm
from hf_retrace_vllm import STATS_ENV, contract, patches, profile, steps


BLOCK = 16  # the random drafter's block_size


def test_missing_private_attribute_is_a_clear_error():
    batch = types.SimpleNamespace(req_ids=[], num_tokens_no_spec=None, num_computed_tokens_cpu=None)  # no token_ids_cpu
    with pytest.raises(contract.UnsupportedVllmError, match=r"supports vLLM 0\.32\.0 only.*InputBatch.*token_ids_cpu"):
        contract.check_attributes(batch, "InputBatch")
    batch.token_ids_cpu = None
    contract.check_attributes(batch, "InputBatch")


def test_attribute_no_longer_assigned_is_a_clear_error(monkeypatch):
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    def __post_init__(self):
        self.prompt_length = 0  # vLLM renamed num_prompt_tokens

    monkeypatch.setattr(CachedRequestState, "__post_init__", __post_init__)
    with pytest.raises(contract.UnsupportedVllmError, match=r"0\.32\.0.*__post_init__ no longer sets.*num_prompt"):
        contract.check()


def test_profile_is_skipped_when_disabled(monkeypatch):
    drafter = types.SimpleNamespace(startup_profile=None)
    monkeypatch.setenv(profile.PROFILE_ENV, "0")
    patches.profile_after_warm_up(types.SimpleNamespace(model_runner=types.SimpleNamespace(drafter=drafter)))
    assert drafter.startup_profile is None


def test_profile_is_on_by_default(monkeypatch):
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    assert profile.is_enabled()


def test_profile_rounds_visit_every_size_in_turn_and_drop_a_spike():
    """A load spike during one round slows that round's calls, whatever their size; the median per size drops it."""
    calls, now = [], [0.0]
    cost = {1: 1.0, 2: 1.5, 4: 2.0}

    def run(size):
        calls.append(size)
        spike = 10.0 if len(calls) in (4, 5) else 0.0  # calls 4 and 5: the first timed round's 1 and 2 rows
        now[0] += cost[size] + spike

    runs = {size: (lambda size=size: run(size)) for size in cost}
    samples = profile.interleaved_medians(runs, repeats=3, clock=lambda: now[0])
    assert calls == [1, 2, 4] + [1, 2, 4] * 3  # one untimed call each, then whole rounds
    assert samples == [(1, 1.0), (2, 1.5), (4, 2.0)]


@pytest.fixture(scope="module")
def engine_run(target, tmp_path_factory, monkeypatch_module):
    """One short generation in an in-process engine (so the proposer is reachable) with a random drafter:
    `(proposer, stats, step log lines)`."""
    root = tmp_path_factory.mktemp("steps")
    write_drafter(root / "drafter", plain=False)
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch_module.setenv(STATS_ENV, str(root / "stats.json"))
    monkeypatch_module.setenv(profile.PROFILE_ENV, "1")
    # a step-cost cache of its own: the file is keyed by the drafter's config, which every random drafter of this
    # test run shares, so an earlier test's file would be read instead of profiling at start-up
    monkeypatch_module.setenv("HF_RETRACE_CACHE", str(root / "cache"))
    monkeypatch_module.setenv(steps.STEP_LOG_ENV, str(root / "steps.jsonl"))
    llm = make_llm(target, {"method": "dflash", "model": str(root / "drafter"), "num_speculative_tokens": 3})
    try:
        greedy(llm, max_tokens=24)
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        lines = [json.loads(line) for line in (root / "steps.jsonl").read_text().splitlines()]
        return runner.drafter, json.loads((root / "stats.json").read_text()), lines
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_step_records_are_sane(engine_run):
    proposer, stats, _ = engine_run
    records = list(proposer.step_records)
    assert proposer.last_step is records[-1] and len(records) == stats["steps"] > 10
    assert records[0].engine_seconds is None and all(r.engine_seconds > 0 for r in records[1:])
    for r in records:
        # a decode step verifies 1 + (0..3) rows a request; the first step is the prompts' prefill
        assert r.rows >= r.requests >= 1
        assert r.drafter_slots in (0, r.requests * BLOCK)
        parts = r.policy_seconds + r.context_kv_seconds + r.drafter_seconds
        assert min(r.policy_seconds, r.context_kv_seconds, r.drafter_seconds) >= 0 and parts <= r.propose_seconds
        assert (r.drafter_seconds > 0) == (r.drafter_slots > 0)
    decode = [r for r in records[1:] if r.rows <= 4 * r.requests]
    assert decode and any(r.drafter_slots for r in decode) and any(r.rows > r.requests for r in decode)
    assert stats["timings"]["drafter"] == pytest.approx(sum(r.drafter_seconds for r in records))
    assert stats["timings"]["engine"] == pytest.approx(sum(r.engine_seconds for r in records[1:]))


def test_step_log_lines_add_up(engine_run):
    """`HF_RETRACE_VLLM_STEP_LOG`: a line a step after the first, whose commits, verifying requests and proposer parts
    agree with its rows."""
    proposer, _, lines = engine_run
    assert len(lines) == len(proposer.step_records) - 1
    decode = [line for line in lines if line["prefill_rows"] == 0]
    assert decode and any(line["verified"] for line in decode)
    for line in decode:
        assert line["rows"] == line["decoding"] + line["verified"]
        assert line["decoding"] <= line["committed"] <= line["decoding"] + line["verified"]
        assert line["verifying"] <= min(line["decoding"], line["verified"])
        assert (line["verifying"] > 0) == (line["verified"] > 0)
    for line in lines:
        assert 0 <= line["policy_s"] + line["context_kv_s"] <= line["propose_s"] <= line["target_s"] + line["drafter_s"]
        assert line["waiting_rows"] == 0  # every prompt of this run was admitted at once: nothing queued


def _grows(samples) -> bool:
    """The largest size costs more than the smallest (128 rows or 16 blocks against 1). Neighbouring sizes are not
    compared: one timed round per size, and a load spike on a shared host can make 1 row slower than 2; the cost
    model's fit (medians, then pool-adjacent-violators) absorbs that."""
    times = [t for _, t in sorted(samples)]
    return times[-1] > times[0]


def test_startup_profile_grows_with_rows_and_slots(engine_run):
    proposer, _, _ = engine_run
    result = proposer.startup_profile
    assert result is not None, "no start-up profile after vLLM's warm-up"
    assert [r for r, _ in result.target] == list(profile.TARGET_ROWS)
    assert [s for s, _ in result.drafter] == [BLOCK * n for n in profile.DRAFTER_BLOCKS]
    assert all(t > 0 for _, t in result.target + result.drafter)
    assert _grows(result.target) and _grows(result.drafter), result
    # its wall time is its calls (one untimed and REPEATS timed a size), whatever the host's speed: no recompilation
    calls = (1 + profile.REPEATS) * sum(t for _, t in result.target + result.drafter)
    assert result.seconds < 2 * calls, (result.seconds, calls)

"""The cost-aware policy in the vLLM proposer (docs/cost-aware-speculation.md).

The step-cost adapter (`costs.py`) on synthetic steps: the prior scales to the first steps, is saved and reloaded as
this host's cache file, idle gaps are skipped, a file for another configuration or a corrupt one is re-measured.
Then engines with `speculation_policy="goodput"` and the online datastore, on a random drafter: greedy output equals
vLLM's plain greedy token for token, at batch 1 and with several requests at once, with the step costs forced cheap
(rows and drafter slots almost free: every step drafts) and expensive (nothing pays: no proposal at all), and the
online datastore frees the requests that finished; and with the load fallback (fallback.py) holding every step plain.
"""

import json
import types

import numpy as np
import pytest
import torch
from test_lossless_random import write_drafter

from conftest import PROMPTS, close_llm, greedy, make_llm
from hf_retrace_vllm import STATS_ENV, proposer as proposer_module
from hf_retrace_vllm.bookkeeping import StepBatch, prefill_left
from hf_retrace_vllm.costs import WARM_STEPS, EngineCosts, bound_threads, engine_key
from hf_retrace_vllm.fallback import FALLBACK_ENV, PLAIN, LoadFallback
from hf_retrace_vllm.shared.cost_model_retrace import CostCurve, StepCostModel
from hf_retrace_vllm.steps import STEP_LOG_ENV, PlannedStep, PredictionLedger, StepRecord


MAX_TOKENS = 32


def _record(rows, engine, drafter_slots=0, drafter=0.0, propose=0.002):
    return StepRecord(rows, 1, drafter_slots, engine, 0.001, 0.0005, drafter, propose + drafter)


def test_prior_scales_to_the_first_steps_is_saved_and_reloaded(tmp_path):
    key = engine_key(str(tmp_path / "target"), "torch.float32", 2, False, "drafter")
    costs = EngineCosts(key, tmp_path / "cost.json", save_at_exit=False)
    assert costs.source == "prior" and not costs.observe(_record(1, None))  # the first step: engine part unknown
    for _ in range(WARM_STEPS):
        costs.observe(_record(1, 0.098, drafter_slots=16, drafter=0.02))
    assert costs.source == "prior-scaled" and costs.path.exists()
    assert costs.model.target_seconds(1) == pytest.approx(0.1)  # engine + propose less the drafter forward
    assert costs.model.drafter_seconds(16) == pytest.approx(0.02)
    assert costs.model.target_seconds(8) > costs.model.target_seconds(1)  # the prior's shape, scaled
    model = costs.model
    assert not costs.observe(_record(1, 100 * 0.1)) and costs.skipped == 1  # an idle gap, not cost
    assert costs.observe(_record(1, 0.12)) and costs.model is model  # refreshed in place: the policy holds it
    assert 0.1 < model.target_seconds(1) < 0.12
    costs.save()
    again = EngineCosts(key, tmp_path / "cost.json", save_at_exit=False)
    assert again.source == "cache" and again.model.target_seconds(1) == pytest.approx(model.target_seconds(1))


def test_cost_file_from_a_machine_of_another_speed_is_rescaled_to_the_first_decode_steps(tmp_path):
    """Two machines with the same CPU model name share a key; the first decode steps tell them apart."""
    key = engine_key(str(tmp_path / "target"), "torch.float32", 2, False, "drafter")
    file_model = StepCostModel(CostCurve([1, 8], [0.04, 0.08]), CostCurve([16, 64], [0.01, 0.03]))
    for measured, source, t1 in [(0.044, "cache-checked", 0.04), (0.1, "cache-rescaled", 0.1)]:
        path = tmp_path / f"{source}.json"
        file_model.save(path, key)
        costs = EngineCosts(key, path, save_at_exit=False)
        costs.model.alpha = 0.0  # the online refresh frozen: what is checked is the start-up check alone
        assert costs.source == "cache"
        costs.observe(_record(40, 0.01))  # a prefill step (40 rows for one request) tells nothing about the scale
        for _ in range(WARM_STEPS):
            costs.observe(_record(1, measured - 0.002))  # engine part + propose = `measured`
        assert costs.source == source
        assert costs.model.target_seconds(1) == pytest.approx(t1)
        # one factor for both curves: the file's shapes kept
        assert costs.model.drafter_seconds(16) / costs.model.target_seconds(1) == pytest.approx(0.01 / 0.04)


def test_the_same_drafter_in_another_folder_shares_its_cost_file(tmp_path):
    """`d(S)` is the drafter's shape: two folders whose `config.json` differ only in the exporting commit share a key,
    a changed config does not, and a drafter named without a folder (a Hub id) is named as given."""
    folders = {}
    for name, layers, commit in (("export-a", 1, "abc"), ("export-b", 1, "def"), ("wider", 2, "abc")):
        folders[name] = tmp_path / name
        folders[name].mkdir()  # the exporting commit is provenance, not shape
        config = {"num_hidden_layers": layers, "hf_retrace": {"source_commit": commit, "num_assistant_tokens": 8}}
        (folders[name] / "config.json").write_text(json.dumps(config))
    keys = {name: engine_key(str(tmp_path / "target"), "float32", 2, True, str(f)) for name, f in folders.items()}
    assert keys["export-a"] == keys["export-b"] != keys["wider"]
    assert str(tmp_path) not in keys["export-a"].extra
    assert engine_key("t", "float32", 2, True, "org/drafter").extra.endswith("drafter=org/drafter")
    assert engine_key("t", "float32", 2, True).extra.endswith("drafter=")


def test_cost_file_of_another_configuration_or_corrupt_is_remeasured(tmp_path):
    path = tmp_path / "cost.json"
    key = engine_key(str(tmp_path), "torch.float32", 2, False, "drafter")
    StepCostModel.fit([(1, 0.01)], [(16, 0.001)]).save(path, engine_key(str(tmp_path), "torch.float32", 4, False))
    assert EngineCosts(key, path, save_at_exit=False).source == "prior"  # another thread count
    path.write_text("{not json")
    assert EngineCosts(key, path, save_at_exit=False).source == "prior"  # the engine starts, and measures again


def test_stats_are_due_as_they_are_written(tmp_path, monkeypatch):
    """`due` says what `write` then does: nothing without the variable, always at a request's end, else at most
    every `WRITE_INTERVAL` seconds."""
    from hf_retrace_vllm.stats import ProposerStats

    stats = ProposerStats()
    monkeypatch.delenv(STATS_ENV, raising=False)
    assert not stats.due(final=True)
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats.json"))
    assert stats.due(final=False)  # never written yet
    stats.write(final=False)
    assert (tmp_path / "stats.json").exists() and not stats.due(final=False) and stats.due(final=True)


def test_prediction_ledger_counts_only_the_planned_batch():
    ledger = PredictionLedger()
    planned = PlannedStep(frozenset({"a", "b"}), rows=5, target_seconds=0.03, expected_tokens=3.5)
    record = _record(5, 0.025)  # target part: engine 25 ms + propose 2 ms
    assert ledger.add(planned, record, ["b", "a"], committed=4)  # the batch's order may change
    assert not ledger.add(planned, _record(9, 0.025), ["a", "b"], committed=4)  # a prefill joined: other rows
    assert not ledger.add(planned, record, ["a", "c"], committed=4)  # another batch
    assert not ledger.add(planned, _record(5, None), ["a", "b"], committed=4)  # the first step: engine part unknown
    ledger.add_drafter(0.004, 0.006)
    assert ledger.as_dict() == pytest.approx({
        "steps": 1, "drafter_steps": 1, "target_predicted": 0.03, "target_measured": 0.027, "drafter_predicted": 0.004,
        "drafter_measured": 0.006, "tokens_predicted": 3.5, "tokens_committed": 4, "requests": 2,
    })  # fmt: skip


def test_prefill_left_counts_the_prompt_rows_after_this_chunk():
    """Request a decodes (9 of its 10 tokens computed), b ran 40 of its 100-token prompt from 20 (40 left), c's
    chunk of 20 from 30 ends its 50-token prompt (0 left)."""
    batch = types.SimpleNamespace(num_tokens_no_spec=np.array([10, 100, 50]),
                                  num_computed_tokens_cpu=np.array([9, 20, 30]))  # fmt: skip
    step = StepBatch(["a", "b", "c"], [0, 2, 42, 62], [0, 0, 0], None, None, [1, 2, 3])
    assert prefill_left(batch, step) == 40
    batch.num_computed_tokens_cpu[1] = 60  # b's last chunk
    assert prefill_left(batch, step) == 0


def test_step_context_tokens_split_first_rows_from_the_others():
    """a verifies 2 rows at positions 9, 10 (it reads 10, then 11 tokens); b runs a 3-row prefill chunk from
    position 20; c decodes 1 row at position 4 (5). With at most 2 rows a decoding request, b's chunk is left out:
    first rows 10 + 5, the others 11; with 3, b counts (21; 22 + 23)."""
    positions = torch.tensor([9, 10, 20, 21, 22, 4])
    step = StepBatch(["a", "b", "c"], [0, 2, 5, 6], [0, 0, 0], positions, None, [1, 2, 3])
    assert step.context_tokens(2) == (15, 11)
    assert step.context_tokens(3) == (36, 56)
    assert StepBatch([], [0], [], torch.zeros(0, dtype=torch.long), None, []).context_tokens(4) == (0, 0)
    assert step.row_split(2) == (2, 1, 3)  # a and c decode (a verifies 1 row beyond its first), b's 3 prefill rows
    assert step.row_split(3) == (3, 3, 0)


def test_observed_steps_pass_their_context_to_the_cost_model(tmp_path):
    costs = EngineCosts(engine_key("t", "float32", 2, True), tmp_path / "c.json", save_at_exit=False)
    seen = []
    record = StepRecord(5, 2, 0, 0.02, 0.001, 0.0, 0.0, 0.002, (300, 450), (2, 3), 2)
    costs.source = "profile"  # past the warm-up: every step refreshes the model
    assert costs.observe(record, lambda *args: seen.append(args))
    # its contexts, (requests, verified rows) of a step with no prefill rows for the fit of the terms, and the
    # requests that decoded (the request term's count, prefill steps included)
    assert seen == [(5, 0, pytest.approx(0.022), 0.0, (300, 450), (2, 3), 2)]
    prefill = StepRecord(40, 3, 0, 0.05, 0.001, 0.0, 0.0, 0.002, (300, 450), None, 2)
    assert costs.observe(prefill, lambda *args: seen.append(args)) and seen[-1][-2:] == (None, 2)


def test_bound_threads_reads_vllm_bind_lists():
    assert bound_threads("0-1") == 2 and bound_threads("0,2,4") == 3 and bound_threads("0-3|4-7") == 4
    assert bound_threads("auto") >= 1


# --- engines -------------------------------------------------------------------------------------------------------


CHEAP = StepCostModel(CostCurve([1, 4096], [0.02, 0.02]), CostCurve([16, 4096], [1e-6, 1e-5]))
# each row costs 100x the step without it (up to the 6 rows these tests run with): no token ever pays
EXPENSIVE = StepCostModel(
    CostCurve(range(1, 7), [0.02 * 100.0**r for r in range(6)]), CostCurve([16, 4096], [100.0, 1e5])
)


@pytest.fixture(scope="module")
def goodput_folder(tmp_path_factory):
    """The random drafter (test_lossless_random.py) with the cost-aware policy and the online datastore on."""
    folder = tmp_path_factory.mktemp("goodput") / "drafter"
    write_drafter(folder, plain=False)
    config = json.loads((folder / "config.json").read_text())
    config["hf_retrace"].update(speculation_policy="goodput", online_datastore_num_tokens=8,
                                online_datastore_max_bytes=32 * 2**20)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture
def engine_env(monkeypatch, tmp_path):
    """An in-process engine (its proposer reachable), a fresh step-cost cache and stats file."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats.json"))
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "steps.jsonl"))
    return tmp_path


def _run(target, folder, stats_path):
    """Greedy outputs of PROMPTS[0] alone, then of all PROMPTS at once; `(outputs, proposer, stats)`."""
    llm = make_llm(target, {"method": "dflash", "model": str(folder), "num_speculative_tokens": 3})
    try:
        alone = greedy(llm, PROMPTS[:1], max_tokens=MAX_TOKENS)
        together = greedy(llm, max_tokens=MAX_TOKENS)
        # the runner drops finished requests at its next step, and the proposer with it: one more short request
        greedy(llm, ["Hello"], max_tokens=2)
        proposer = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter
        return alone + together, proposer, json.loads(stats_path.read_text())
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def plain_short(target):
    llm = make_llm(target)
    try:
        return greedy(llm, PROMPTS[:1], max_tokens=MAX_TOKENS) + greedy(llm, max_tokens=MAX_TOKENS)
    finally:
        close_llm(llm)


def _force_costs(target, folder, model):
    """Writes `model` as this host's step-cost cache file for the engine `_run` starts."""
    key = engine_key(str(target), "torch.float32", bound_threads(), False, str(folder))
    costs = EngineCosts(key, save_at_exit=False)
    model.save(costs.path, key)
    return costs.path


def test_goodput_with_learned_costs_is_lossless_and_frees_requests(target, goodput_folder, plain_short, engine_env):
    outputs, proposer, stats = _run(target, goodput_folder, engine_env / "stats.json")
    assert outputs == plain_short
    # profiled at start-up, the default (the prior's path is unit-tested above), and saved
    assert proposer.costs.source == "profile" and proposer.costs.path.exists()
    assert proposer.costs.model.target_seconds(8) > proposer.costs.model.target_seconds(1) > 0
    records = [r for r in proposer.clock.records if r.rows]  # each step knows the contexts its rows read
    assert records and all(r.context_tokens[0] >= r.requests for r in records if r.rows == r.requests)
    decode = [r for r in records if r.decode_rows is not None]  # steps with no prefill rows: split for the fit
    assert decode and all(sum(r.decode_rows) == r.rows and r.decode_rows[0] == r.requests for r in decode)
    assert len(decode) < len(records)  # the prompts' prefill steps are not
    assert any(r.context_tokens[1] > 0 for r in records)  # verified drafts
    assert stats["online_datastore_bytes"] > 0, stats
    online = proposer.online_datastore  # every finished request freed, its response in the global index
    assert online is not None and online.num_requests == 1 and online.num_responses == 1 + len(PROMPTS)
    assert len(proposer.committed) == 1 and not proposer.speculation.estimator.num_requests > 1
    assert stats["step_costs"]["source"] == "profile" and len(stats["step_costs"]["context"]) == 2
    steps = [json.loads(line) for line in (engine_env / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == len(records) - 1  # every step but the first, whose engine part is unknown
    for line in steps:  # the log splits every step's rows and prices it with the model it had
        assert line["decoding"] + line["verified"] + line["prefill_rows"] == line["rows"], line
        assert line["target_s"] > 0 and line["predicted_s"] > 0 and len(line["context"]) == 2, line
    assert any(line["verified"] > 0 for line in steps) and any(line["prefill_rows"] > 0 for line in steps)
    prediction = stats["prediction"]  # the plans' predictions beside the steps that verified them
    assert prediction["steps"] > 10 and prediction["target_measured"] > 0, prediction
    assert 0 < prediction["tokens_predicted"] and prediction["tokens_committed"] >= prediction["steps"], prediction


@pytest.mark.parametrize("forced", ["cheap", "expensive"])
def test_goodput_with_forced_costs_is_lossless(target, goodput_folder, plain_short, engine_env, forced, monkeypatch):
    monkeypatch.setenv(FALLBACK_ENV, "0")  # the plan alone: with it on, plain steps would follow the measured times
    path = _force_costs(target, goodput_folder, CHEAP if forced == "cheap" else EXPENSIVE)
    outputs, proposer, stats = _run(target, goodput_folder, engine_env / "stats.json")
    assert proposer.costs.source.startswith("cache") and proposer.costs.path == path
    assert outputs == plain_short
    verified = sum(stats["cycles"].values())
    if forced == "cheap":  # rows and slots almost free: drafts are verified at every step
        assert stats["drafter_forwards"] > 10 and stats["cycles"]["draft"] > 10, stats
    else:  # nothing pays: no proposal, no drafter forward
        assert stats["drafter_forwards"] == 0 and verified == 0, stats


class AlwaysPlain(LoadFallback):
    """A fallback whose every plan is plain (as at a load where plain steps measured faster)."""

    seen_ids: set = set()  # the request ids the proposer gave with its plans

    def choose(self, requests: int, request_ids=None) -> str:
        ids = list(request_ids)
        assert len(ids) == requests, (requests, ids)
        AlwaysPlain.seen_ids.update(ids)
        self._arms.append(PLAIN if requests > 0 else None)
        self.plain_steps += requests > 0
        return PLAIN


def test_plain_steps_of_the_fallback_are_lossless_and_propose_nothing(target, goodput_folder, plain_short, engine_env,
                                                                      monkeypatch):  # fmt: skip
    monkeypatch.setattr(proposer_module, "LoadFallback", AlwaysPlain)  # the engine runs in this process (engine_env)
    _force_costs(target, goodput_folder, CHEAP)  # a plan would draft at every step
    outputs, proposer, stats = _run(target, goodput_folder, engine_env / "stats.json")
    assert outputs == plain_short
    assert stats["drafter_forwards"] == 0 and sum(stats["cycles"].values()) == 0, stats
    fallback = stats["fallback"]
    assert fallback["plain_steps"] > MAX_TOKENS and fallback["probes"] == 0, fallback
    # each decoding request's id came with the plans: PROMPTS[0] alone, then each of PROMPTS (and maybe "Hello")
    assert 1 + len(PROMPTS) <= len(AlwaysPlain.seen_ids) <= 2 + len(PROMPTS), AlwaysPlain.seen_ids
    # the plain steps' seconds per token are kept by load: one request alone, then all PROMPTS at once
    kept = {key: load["ms_per_token"] for key, load in fallback["loads"].items()}
    assert all(set(ms) == {PLAIN} and ms[PLAIN] > 0 for ms in kept.values()) and len(kept) >= 2, kept
    assert proposer.speculation.last_step is None and proposer.prediction.steps == 0  # no plan was made
    steps = [json.loads(line) for line in (engine_env / "steps.jsonl").read_text().splitlines()]
    assert all(line["plain"] and line["verified"] == 0 for line in steps if line["decoding"]), steps


# long prompts under a 64-row budget: chunked over several steps while other requests decode beside them
LONG_PROMPTS = [f"{i}. " + "The quick brown fox jumps over the lazy dog near the river bank. " * 12 for i in range(3)]
BUDGET = {"max_num_batched_tokens": 64, "max_num_seqs": 4}


def test_goodput_beside_chunked_prefill_is_lossless(target, goodput_folder, engine_env, monkeypatch):
    """The plan counts the prompt rows still to prefill (`prefill_left`); greedy output stays vLLM's own."""
    llm = make_llm(target, **BUDGET)
    try:
        plain = greedy(llm, PROMPTS[:2] + LONG_PROMPTS, max_tokens=MAX_TOKENS)
    finally:
        close_llm(llm)
    seen = []

    def spy(input_batch, step):
        seen.append(prefill_left(input_batch, step))
        return seen[-1]

    monkeypatch.setattr(proposer_module, "prefill_left", spy)  # the engine runs in this process (engine_env)
    _force_costs(target, goodput_folder, CHEAP)
    spec = {"method": "dflash", "model": str(goodput_folder), "num_speculative_tokens": 3}
    llm = make_llm(target, spec, **BUDGET)
    try:
        outputs = greedy(llm, PROMPTS[:2] + LONG_PROMPTS, max_tokens=MAX_TOKENS)
    finally:
        close_llm(llm)
    assert outputs == plain
    assert max(seen) > 0 and seen[-1] == 0, seen  # prompts were left to prefill at some steps, none at the end

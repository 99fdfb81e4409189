"""The waiting prompt rows the proposer's plan counts beside the runner's batch: only the requests the next step may
admit (the request slots left), requests holding KV blocks first, each with the rows it has left to compute, and only
where they compete with verification for the step's token budget. No engine starts here; the engine tests
(test_proposer_steps.py) run the patched schedule on vLLM's own scheduler every step."""

import json
import types

import pytest

import hf_retrace_vllm
from hf_retrace_vllm import contract, scheduler_queue, steps


def _request(num_tokens, num_computed=0):
    return types.SimpleNamespace(num_tokens=num_tokens, num_computed_tokens=num_computed)


def _scheduler(running, waiting, kv_holding=(), max_active=4, streaming=0):
    return types.SimpleNamespace(running=[_request(10, 10)] * running, waiting=list(waiting),
                                 kv_holding_waiting=list(kv_holding), max_num_active_reqs=max_active,
                                 num_waiting_for_streaming_input=streaming)  # fmt: skip


def test_counts_the_waiting_requests_the_free_slots_admit():
    waiting = [_request(1500), _request(900, 100), _request(700)]
    assert scheduler_queue.waiting_prefill_rows(_scheduler(running=2, waiting=waiting)) == 1500 + 800  # 2 slots


def test_requests_holding_kv_blocks_come_first():
    scheduler = _scheduler(running=3, waiting=[_request(1500)], kv_holding=[_request(300, 20)])
    assert scheduler_queue.waiting_prefill_rows(scheduler) == 280


def test_nothing_when_every_slot_is_taken():
    assert scheduler_queue.waiting_prefill_rows(_scheduler(running=3, waiting=[_request(1500)], streaming=1)) == 0
    assert scheduler_queue.waiting_prefill_rows(_scheduler(running=1, waiting=[])) == 0


def test_a_scheduler_without_the_attributes_is_a_clear_error():
    broken = types.SimpleNamespace(running=[], waiting=[], max_num_active_reqs=4)
    with pytest.raises(contract.UnsupportedVllmError, match=r"0\.32\.0.*Scheduler objects have no kv_holding_waiting"):
        scheduler_queue.waiting_prefill_rows(broken)


def test_waiting_rows_count_only_where_they_compete_for_the_budget():
    # 8 requests verifying up to 8 each take 72 rows: a 1,500-row prompt fits beside them in 4,096
    assert scheduler_queue.competing_rows(1500, 0, 8, 8, 4096) == 0
    assert scheduler_queue.competing_rows(4050, 0, 8, 8, 4096) == 4050  # it does not: every verified row displaces it
    assert scheduler_queue.competing_rows(1500, 2600, 8, 8, 4096) == 1500  # a started prompt takes the rest
    assert scheduler_queue.competing_rows(0, 5000, 8, 8, 4096) == 0


def test_schedule_and_step_are_patched_once():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hf_retrace_vllm.register()
    schedule, execute_model = Scheduler.schedule, GPUModelRunner.execute_model
    hf_retrace_vllm.register()
    assert Scheduler.schedule is schedule and GPUModelRunner.execute_model is execute_model
    assert getattr(schedule, contract.MARK) and getattr(execute_model, contract.MARK)
    assert schedule.__wrapped__.__qualname__ == "Scheduler.schedule"
    assert execute_model.__wrapped__.__qualname__ == "GPUModelRunner.execute_model"


def test_the_count_travels_on_the_output_to_an_hf_retrace_proposer_only():
    output = types.SimpleNamespace()
    scheduler_queue.record(_scheduler(running=1, waiting=[_request(2000)]), output)
    ours, theirs = types.SimpleNamespace(waiting_prefill_rows=0), types.SimpleNamespace()
    scheduler_queue.hand_over(types.SimpleNamespace(drafter=ours), output)
    scheduler_queue.hand_over(types.SimpleNamespace(drafter=theirs), output)
    scheduler_queue.hand_over(types.SimpleNamespace(drafter=None), output)
    assert ours.waiting_prefill_rows == 2000 and vars(theirs) == {}
    scheduler_queue.hand_over(types.SimpleNamespace(drafter=ours), types.SimpleNamespace())  # an unpatched scheduler
    assert ours.waiting_prefill_rows == 0


def test_an_engine_hands_the_count_of_its_queue_to_the_proposer(target, tmp_path, monkeypatch):
    """Four request slots and a 64-row budget, four prompts of ~150 tokens: the prompts queue behind the budget, and
    every step's output carries the count of their rows to the proposer, whose plan counts them (they do not fit
    beside the verifying requests) and whose step log records what it counted."""
    from test_lossless_random import write_drafter

    from conftest import PROMPTS, close_llm, greedy, make_llm

    write_drafter(tmp_path / "drafter", plain=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, where the spy is
    monkeypatch.setenv(steps.STEP_LOG_ENV, str(tmp_path / "steps.jsonl"))
    seen, counted = [], []
    hand_over, competing_rows = scheduler_queue.hand_over, scheduler_queue.competing_rows

    def spy(runner, scheduler_output):
        seen.append(getattr(scheduler_output, scheduler_queue.ATTRIBUTE, None))
        hand_over(runner, scheduler_output)

    def counting(*args):
        counted.append(competing_rows(*args))
        return counted[-1]

    monkeypatch.setattr(scheduler_queue, "hand_over", spy)
    monkeypatch.setattr(scheduler_queue, "competing_rows", counting)
    spec = {"method": "dflash", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 3}
    llm = make_llm(target, spec, max_num_seqs=4, max_num_batched_tokens=64)
    try:
        outputs = greedy(llm, [prompt * 8 for prompt in PROMPTS], max_tokens=8)
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        assert hasattr(runner.drafter, "waiting_prefill_rows")
    finally:
        close_llm(llm)
    assert all(len(tokens) == 8 for tokens in outputs)
    assert seen and None not in seen  # every step's output carried a count
    assert max(seen) > 64 and seen[-1] == 0  # queued prompts longer than the budget; none left at the end
    assert max(counted) > 0  # and the plan of a step counted it, as its line of the step log says
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["waiting_rows"] for line in lines] == counted[1:]  # a line a step after the first

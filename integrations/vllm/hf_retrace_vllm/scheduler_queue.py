"""The prompt rows waiting in vLLM's scheduler that its next step may admit: what the model runner cannot see.

The proposer plans the step that will verify its proposals before the scheduler builds it. The runner's batch holds
the requests already running, and `bookkeeping.prefill_left` counts the prompt rows those still have to prefill; but
requests still in the scheduler's waiting queue join the next step too, as far as its request slots and its token
budget allow. Under the budget the scheduler serves the running requests' rows, verified drafts included, first:
a verified row there takes the place of a waiting prompt's row, which delays that request's start and the batch
it would fill (docs/cost-aware-speculation.md, "Steps that also prefill").

After each `Scheduler.schedule` (patches.py), `waiting_prefill_rows(scheduler)` counts the rows the waiting requests
the next step may admit have left to compute: the first `free` of the waiting queues, in vLLM's order (requests
holding KV blocks, then the rest), `free` being the request slots left after this step's running requests. The
count travels to the worker on the `SchedulerOutput` (attribute `ATTRIBUTE`: the scheduler and the model runner are
separate processes under vLLM's multiprocessing executor, the default on CPU), and the proposer reads it from
there. `competing_rows` keeps it only where the prompts compete with verification for the budget.
"""

from itertools import chain, islice

from .contract import check_attributes


ATTRIBUTE = "hf_retrace_waiting_prefill_rows"  # set on each SchedulerOutput


def waiting_prefill_rows(scheduler) -> int:
    """The prompt rows the waiting requests that `scheduler`'s next step may admit have left to compute.

    Raises:
        UnsupportedVllmError: `scheduler` lacks an attribute this reads (another vLLM version).
    """
    check_attributes(scheduler, "Scheduler")
    running = len(scheduler.running) + scheduler.num_waiting_for_streaming_input
    free = max(scheduler.max_num_active_reqs - running, 0)
    queued = chain(scheduler.kv_holding_waiting, scheduler.waiting)
    return sum(max(r.num_tokens - r.num_computed_tokens, 0) for r in islice(queued, free))


def record(scheduler, output) -> None:
    """Sets `output.<ATTRIBUTE>` (a `SchedulerOutput`) to `waiting_prefill_rows(scheduler)`."""
    setattr(output, ATTRIBUTE, waiting_prefill_rows(scheduler))


def hand_over(runner, scheduler_output) -> None:
    """Gives the count `scheduler_output` carries (0 without one) to `runner`'s drafter if it is an hf-retrace
    proposer (it has `waiting_prefill_rows`); any other drafter is left alone."""
    drafter = getattr(runner, "drafter", None)
    if hasattr(drafter, "waiting_prefill_rows"):
        drafter.waiting_prefill_rows = getattr(scheduler_output, ATTRIBUTE, 0)


def competing_rows(waiting: int, prefill_left: int, num_requests: int, max_verified: int, max_rows: int) -> int:
    """The waiting prompt rows the plan counts: all of them when, beside the prompts already started
    (`prefill_left`), they would not fit in the step's budget `max_rows` with each of the `num_requests` requests
    verifying its most (`max_verified`), else 0. A prompt that fits beside any plan runs in the step whatever the
    plan verifies: counted as work done in the step, it would only make the plan skip drafts that pay (the rate
    `(E + P) / T` nears one token per row cost with hundreds of prompt rows in it)."""
    if waiting <= 0 or num_requests * (1 + max_verified) + prefill_left + waiting <= max_rows:
        return 0
    return waiting

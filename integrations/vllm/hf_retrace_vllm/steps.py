"""Per-step timing of the proposer, for the step-cost model: what each engine step verified and cost.

Cheap by design: `time.perf_counter` at the proposer's part boundaries, no device synchronisation beyond the host
copies the proposer makes anyway. The engine's own part (the target's forward of the step's rows, sampling,
scheduling) is the wall time between two `propose()` calls.
"""

import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass


PARTS = ("policy", "context_kv", "drafter")
STEP_LOG_ENV = "HF_RETRACE_VLLM_STEP_LOG"  # a path: every engine step appended there as one JSON line (StepLog)


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the proposer saw it.

    Attributes:
        rows (`int`): `R`, the tokens the target verified this step (every request's scheduled tokens; a prefill's
            chunk included).
        requests (`int`): requests in the step's batch.
        drafter_slots (`int`): `S`, query slots of the drafter forward (`requests * block_size`); 0 when no request
            drafted and the forward was skipped.
        engine_seconds (`float` or `None`): wall time from the end of the previous `propose()` to the start of this
            one: the target's forward of the `R` rows, sampling, output processing and scheduling. `None` at the
            first step; it also holds any idle time between requests (a consumer filters those out).
        policy_seconds (`float`): bookkeeping of the verified cycles, lookups, ReTrace conditioning.
        context_kv_seconds (`float`): the drafter's input preparation, and the context-K/V write of the rows kept
            since the last one when it is due (context_kv.py).
        drafter_seconds (`float`): the drafter's block forward and draft logits (0 when skipped).
        propose_seconds (`float`): the whole `propose()`.
        context_tokens (`tuple[int, int]`): `(K, X)`, the context tokens the decoding requests' rows read (a row at
            position `p` reads `p + 1`), over each request's first row and over its verified rows: the cost model's
            context terms (`StepBatch.context_tokens`).
        decode_rows (`tuple[int, int]` or `None`): `(requests, verified rows)` of a step with no prefill rows (the
            context terms are fitted on those), `None` for one with prefill rows.
        decoding (`int`): the requests that decoded (the cost model's request term counts them), prefill steps
            included.
    """

    rows: int
    requests: int
    drafter_slots: int
    engine_seconds: float | None
    policy_seconds: float
    context_kv_seconds: float
    drafter_seconds: float
    propose_seconds: float
    context_tokens: tuple = (0, 0)
    decode_rows: tuple | None = None
    decoding: int = 0

    def timings(self) -> dict[str, float]:
        """`{part: seconds}` of this step, `engine` included when known (the stats file's `timings` adds these)."""
        parts = {"policy": self.policy_seconds, "context_kv": self.context_kv_seconds,
                 "drafter": self.drafter_seconds, "propose": self.propose_seconds}  # fmt: skip
        return parts if self.engine_seconds is None else {"engine": self.engine_seconds, **parts}


class StepClock:
    """Times one `propose()` in parts: `start()`, `lap(part)` at the end of each part, `finish(...)`, `close()`.

    Attributes:
        records (`collections.deque[StepRecord]`): the last `max_records` steps, oldest first.
    """

    def __init__(self, max_records: int = 1024):
        self.records: deque[StepRecord] = deque(maxlen=max_records)
        self._last_end: float | None = None
        self._start = self._mark = 0.0
        self._engine: float | None = None
        self._parts: dict[str, float] = {}

    def start(self) -> None:
        now = time.perf_counter()
        self._engine = None if self._last_end is None else now - self._last_end
        self._start = self._mark = now
        self._parts = dict.fromkeys(PARTS, 0.0)

    def lap(self, part: str) -> None:
        """Adds the time since the last lap (or the start) to `part`."""
        now = time.perf_counter()
        self._parts[part] += now - self._mark
        self._mark = now

    def finish(self, rows: int, requests: int, drafter_slots: int, context_tokens: tuple = (0, 0),
               decode_rows: tuple | None = None, decoding: int = 0) -> StepRecord:  # fmt: skip
        record = StepRecord(
            rows, requests, drafter_slots, self._engine, self._parts["policy"], self._parts["context_kv"],
            self._parts["drafter"], time.perf_counter() - self._start, context_tokens, decode_rows, decoding,
        )  # fmt: skip
        self.records.append(record)
        return record

    def close(self) -> None:
        """Marks the end of the proposer's step: the next `start()` measures the engine's part from here."""
        self._last_end = time.perf_counter()


@dataclass
class PredictionLedger:
    """What the cost-aware policy predicted for its steps beside what the engine then measured
    (docs/cost-aware-speculation.md).

    A goodput plan predicts, for the step that verifies it, the target's time `t(R)`, the drafter's time `d(S)` of the
    forward it runs now, and the tokens the step commits (`E`: 1 + survival probabilities per request). Only steps
    whose batch is exactly the planned one are counted: a request that joined (its prefill rows) or left makes the
    step another one than the plan's.

    Attributes:
        steps (`int`): steps compared.
        drafter_steps (`int`): drafter forwards compared.
        target_predicted (`float`), target_measured (`float`): seconds of the target's part, summed.
        drafter_predicted (`float`), drafter_measured (`float`): seconds of the drafter's forward, summed.
        tokens_predicted (`float`), tokens_committed (`int`): tokens, summed.
        requests (`int`): requests of those steps, summed: each commits one token for sure, so
            `tokens_predicted - requests` is the predicted number of accepted proposals, beside
            `tokens_committed - requests` accepted.
    """

    steps: int = 0
    drafter_steps: int = 0
    target_predicted: float = 0.0
    target_measured: float = 0.0
    drafter_predicted: float = 0.0
    drafter_measured: float = 0.0
    tokens_predicted: float = 0.0
    tokens_committed: int = 0
    requests: int = 0

    def add(self, planned: "PlannedStep", record: StepRecord, req_ids, committed: int) -> bool:
        """Counts one step against its plan (`planned`, made at the previous `propose()`); `committed`: tokens the
        step committed over its requests. Returns whether it counted."""
        if record.engine_seconds is None or record.rows != planned.rows or frozenset(req_ids) != planned.req_ids:
            return False
        self.steps += 1
        self.target_predicted += planned.target_seconds
        self.target_measured += record.engine_seconds + record.propose_seconds - record.drafter_seconds
        self.tokens_predicted += planned.expected_tokens
        self.tokens_committed += int(committed)
        self.requests += len(planned.req_ids)
        return True

    def add_drafter(self, predicted: float, measured: float) -> None:
        """The drafter's forward of this step: the cost model's `d(S)` of the slots that ran, and its measured
        seconds."""
        self.drafter_steps += 1
        self.drafter_predicted += float(predicted)
        self.drafter_measured += float(measured)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PlannedStep:
    """A goodput plan's prediction of the step that verifies it: its requests, target rows `R`, the target's part of
    its time (`T - d(S)`: `t(R)` and the context terms) in seconds and expected committed tokens `E`."""

    req_ids: frozenset
    rows: int
    target_seconds: float
    expected_tokens: float


class StepLog:
    """Every engine step as one JSON line, appended to the file `HF_RETRACE_VLLM_STEP_LOG` names (nothing without
    it): what the step-cost model is fitted to, to check it offline against the steps it priced.

    A line: `rows` (`R`), `requests`, `decoding` (requests of at most `1 + K` rows), `verified` (their rows beyond the
    first), `prefill_rows` (the other requests' rows), `context` (`[K, X]`), `slots` (`S`), `target_s`, `drafter_s`
    (the parts the model learns from, `costs.step_costs`), `predicted_s` (the model's `t(R) + a K + c X` before
    it learned from the step), `committed` (tokens the step committed over its requests), `verifying` (decoding
    requests that verified at least one proposed token), the proposer's own parts of `target_s`: `policy_s`,
    `context_kv_s` and `propose_s` (the whole `propose()`, the drafter included), and `waiting_rows` (the prompt rows
    of requests queued in the scheduler that this step's plan, made for the next step, counted; scheduler_queue.py),
    and `plain` (the plan made in this step was a plain one, fallback.py).
    """

    def __init__(self, path: str | None = None):
        path = path if path is not None else os.environ.get(STEP_LOG_ENV)
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record: StepRecord, split: tuple[int, int, int], costs, predicted: float, committed: int,
              verifying: int, waiting_rows: int = 0, plain: bool = False) -> None:  # fmt: skip
        """Appends `record` (with `split = (decoding, verified, prefill_rows)`, `costs = (target_s, drafter_s)`, the
        tokens the step `committed`, the requests `verifying` a proposal, the queued `waiting_rows` its plan counted
        and whether that plan was `plain`)."""
        if self._file is None or costs is None:
            return
        line = {"rows": record.rows, "requests": record.requests, "decoding": split[0], "verified": split[1],
                "prefill_rows": split[2], "context": list(record.context_tokens), "slots": record.drafter_slots,
                "target_s": round(costs[0], 6), "drafter_s": round(costs[1], 6), "predicted_s": round(predicted, 6),
                "committed": int(committed), "verifying": int(verifying), "policy_s": round(record.policy_seconds, 6),
                "context_kv_s": round(record.context_kv_seconds, 6), "propose_s": round(record.propose_seconds, 6),
                "waiting_rows": int(waiting_rows), "plain": bool(plain)}
        self._file.write(json.dumps(line) + "\n")

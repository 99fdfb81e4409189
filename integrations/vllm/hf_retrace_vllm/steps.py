"""Per-step timing of the proposer, for the step-cost model: what each engine step verified and cost.

Cheap by design: `time.perf_counter` at the proposer's part boundaries, no device synchronisation beyond the host
copies the proposer makes anyway. The engine's own part (the target's forward of the step's rows, sampling,
scheduling) is the wall time between two `propose()` calls.
"""

import time
from collections import deque
from dataclasses import dataclass


PARTS = ("policy", "context_kv", "drafter")


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
        context_kv_seconds (`float`): the drafter's input preparation and the context-K/V write of the `R` rows.
        drafter_seconds (`float`): the drafter's block forward and draft logits (0 when skipped).
        propose_seconds (`float`): the whole `propose()`.
    """

    rows: int
    requests: int
    drafter_slots: int
    engine_seconds: float | None
    policy_seconds: float
    context_kv_seconds: float
    drafter_seconds: float
    propose_seconds: float

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

    def finish(self, rows: int, requests: int, drafter_slots: int) -> StepRecord:
        record = StepRecord(
            rows, requests, drafter_slots, self._engine, self._parts["policy"], self._parts["context_kv"],
            self._parts["drafter"], time.perf_counter() - self._start,
        )  # fmt: skip
        self.records.append(record)
        return record

    def close(self) -> None:
        """Marks the end of the proposer's step: the next `start()` measures the engine's part from here."""
        self._last_end = time.perf_counter()

"""Per-engine counters of the hf-retrace proposer, readable from outside the engine process.

vLLM runs the proposer in its engine-core process, so the counters are written (atomically) to the JSON file named
by the environment variable `HF_RETRACE_VLLM_STATS` when it is set; `read_stats(path)` reads them back. A write (a
file and a rename: ~0.3 ms on a 2-core host, which every step paid when each step wrote) happens at a step where a
request reaches its end (its length limit or a stop token), so the file is complete once a `generate` call returns,
and otherwise at most every `WRITE_INTERVAL` seconds. Every 200 cycles the counters are also logged as one line.
"""

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path


STATS_ENV = "HF_RETRACE_VLLM_STATS"
WRITE_INTERVAL = 0.5  # seconds between two writes of the stats file while no request ends
SOURCES = ("lookup", "datastore", "draft")  # always reported; a registered source adds its own name on its first cycle


@dataclass
class ProposerStats:
    """Counts over verification cycles (one cycle = one target forward that verified a proposal of a request).

    Attributes:
        cycles (`dict[str, int]`): cycles by source: `lookup` (prompt lookup), `datastore`, `draft` (the drafter),
            and any other registered candidate source by its name (e.g. `online_datastore`).
        committed (`dict[str, int]`): tokens committed by those cycles, the bonus/correction token included.
        drafter_forwards (`int`): drafter forward passes (one per engine step that had a drafting request).
        conditioned_blocks (`int`): drafted blocks that received a ReTrace rejected trajectory.
        retained_slots (`int`): mask slots those blocks conditioned (sum of `L`).
        steps (`int`): proposer calls timed through `record_step` (one per engine step).
        timings (`dict[str, float]`): seconds spent in each timed part of those steps, in total (`policy`,
            `drafter`, ...: the names are the proposer's), so `timings[name] / steps` is that part's time per step.
        online_datastore_bytes (`int`, *optional*): the online datastore's peak size in bytes, sampled when the file
            is written (whenever a request ends, when its running index is largest, and every `WRITE_INTERVAL`);
            `None` without one.
        prediction (`dict`, *optional*): the goodput policy's predictions beside the measured steps
            (`steps.PredictionLedger.as_dict()`); `None` under the fixed policy.
        step_costs (`dict`, *optional*): where the goodput policy's step-cost model came from (`source`) and its
            learned context terms (`context`: `[a, c]`, seconds per context token of a request's first row and of
            its verified rows); `None` under the fixed policy.
        fallback (`dict`, *optional*): the goodput policy's plain steps (`LoadFallback.as_dict()`: `plain_steps`,
            `probes`, and per load bucket the arm in use, its interval, `due`, the plans' median `predicted_gain`
            and each arm's ms per committed token); `None` when it is off.
    """

    cycles: dict = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    committed: dict = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    drafter_forwards: int = 0
    conditioned_blocks: int = 0
    retained_slots: int = 0
    steps: int = 0
    timings: dict = field(default_factory=dict)
    online_datastore_bytes: int | None = None
    prediction: dict | None = None
    step_costs: dict | None = None
    fallback: dict | None = None
    _last_write: float = field(default=float("-inf"), repr=False)

    def record(self, source: str, committed: int) -> None:
        self.cycles[source] = self.cycles.get(source, 0) + 1
        self.committed[source] = self.committed.get(source, 0) + committed

    def record_step(self, timings: dict[str, float]) -> None:
        """Counts one proposer step and adds the seconds of its timed parts (`{"policy": s, "drafter": s, ...}`)."""
        self.steps += 1
        for name, seconds in timings.items():
            self.timings[name] = self.timings.get(name, 0.0) + seconds

    def record_online_datastore_bytes(self, num_bytes: int) -> None:
        """Keeps the peak of the online datastore's size."""
        self.online_datastore_bytes = max(self.online_datastore_bytes or 0, num_bytes)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification cycle, over all sources, bonus included."""
        return sum(self.committed.values()) / max(sum(self.cycles.values()), 1)

    def as_dict(self) -> dict:
        # a shallow copy: `asdict` deep-copies every field, a cost paid on every engine step while the file is written
        return {**{f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}, "tau": self.tau}

    def log_line(self) -> str:
        by_source = ", ".join(f"{s} {self.cycles[s]}/{self.committed[s]}" for s in self.cycles)
        return (
            f"hf-retrace proposer: tau {self.tau:.3f} over {sum(self.cycles.values())} cycles (cycles/tokens: "
            f"{by_source}); {self.drafter_forwards} drafter forwards, {self.conditioned_blocks} ReTrace-conditioned"
        )

    def due(self, final: bool = True) -> bool:
        """Whether `write(final)` would write now (a caller fills costly fields only then)."""
        if not os.environ.get(STATS_ENV):
            return False
        return final or time.monotonic() - self._last_write >= WRITE_INTERVAL

    def write(self, final: bool = True) -> None:
        """Writes the counters to `HF_RETRACE_VLLM_STATS` (if set): always when `final` (a request ended this step),
        else only when `WRITE_INTERVAL` seconds passed since the last write."""
        if not self.due(final):
            return
        path = os.environ[STATS_ENV]
        self._last_write = time.monotonic()
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(self.as_dict()))
        os.replace(tmp, path)


def read_stats(path) -> dict:
    """The last counters an engine wrote to `path` (see the module docstring): `cycles`, `committed`, `tau`, ..."""
    return json.loads(Path(path).read_text())

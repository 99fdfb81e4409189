"""Plain steps at a load where speculating measured slower: seconds per committed token, both ways, per load.

The goodput plan prices its steps with the step-cost model. Where many requests run, that model can be off (on the
2-core AVX-512 host at 32 running it priced a verified row at ~1.0 ms that cost ~1.6), and the proposer's own time
(lookups and plan, ~9 ms a step there) is not in the plan's choice at all. Both can make speculating lose against
the engine's plain steps where the plan cannot see it. `LoadFallback` measures instead of predicting: per load (the
requests decoding, in quarter octaves), the engine's recent decode steps' seconds per committed token in two arms,
`speculate` (the policy plans the step) and `plain` (no lookups, no plan, no drafter forward: each request verifies
nothing and commits one token), and the policy plans only at loads where `speculate` is not the slower.

The arm not in use is probed: `probe_steps` consecutive plans every `interval` plans at that load. The interval
doubles each time a probe confirms the arm in use (up to `max_interval`) and starts again at `first_interval` when a
probe changes it. An arm changes only when its seconds per token are fewer by more than `margin`, so noise does not
flip it.

An arm's seconds per committed token are its last 16 samples' seconds summed over their tokens summed, not a median
of each step's ratio: a speculating step commits from 1 token a request to `1 + K`, and the median of per-step ratios
misprices that spread (three 150 ms steps committing 1, 1 and 7 tokens: a median of 150 ms a token, where they took
450 ms for 9 tokens, 50 ms a token). At batch 1, where a request's steps commit 1 token or many, it priced speculating
as dear as plain steps; with many requests a step's tokens are a sum over them and vary less.

Where the plans themselves expect little, plain probes come sooner: each plan's predicted gain over a plain step
(`StepPlan.predicted_gain`, the model's goodput of the plan over that of verifying nothing) is kept per load, and a
speculating load whose median predicted gain `g` is below `reference_gain` probes after `interval * g /
reference_gain` plans (at least `min_interval`). At 32 running the plans expect a few percent, which a model off by
~20% cannot tell from a loss, and a 64-token wave lasts ~30-40 steps: the probe must come within it; a plain probe
there costs about what speculating would have gained, little. At batch 1 the plans expect ~2x, where a plain probe
costs most and is least needed, and the interval stays whole. A load running plain keeps its whole interval: a
speculating probe there costs what speculating measured to lose.

A load running plain learns afresh when its requests change: speculating's seconds per token are a property of the
requests that were speculating (how often their drafts are accepted), a plain step's of the load. Once none of the
requests of the load's last speculating plan is still decoding there (at batch 1: a new request), its speculating
samples are dropped and it probes speculating after `min_interval` plans, not after its whole interval (up to
`max_interval`, hundreds of steps: a batch-1 engine that measured plain faster on one request otherwise served the
next ones plain, however repetitive). Where the same requests run on, or some of them, the schedule stays.

A step's wall time, as the proposer measures it, holds the verification of the plan made at the step before and the
making of the next plan (`propose()`), so only a step whose two plans were of the same arm is a sample of that arm.

Lossless either way: a plain step proposes nothing. The choice depends on step times and step counts, never on the
tokens sampled, so sampling stays exact.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


SPECULATE, PLAIN = "speculate", "plain"
FALLBACK_ENV = "HF_RETRACE_VLLM_LOAD_FALLBACK"  # "0": off, every step the policy plans


def load_key(requests: int) -> int:
    """The load bucket of `requests` decoding: quarter octaves, `round(4 * log2(requests))` (8 -> 12, 32 -> 20)."""
    return round(4 * math.log2(max(int(requests), 1)))


def _other(arm: str) -> str:
    return PLAIN if arm == SPECULATE else SPECULATE


@dataclass
class LoadArms:
    """One load's state: the arm in use, its probe schedule, and each arm's last seconds per committed token."""

    interval: int
    arm: str = SPECULATE
    since_probe: int = 0  # plans at this load since its last probe ended
    # the last 16 samples per arm: (seconds, tokens committed) of a step
    samples: dict = field(default_factory=lambda: {SPECULATE: deque(maxlen=16), PLAIN: deque(maxlen=16)})
    gains: deque = field(default_factory=lambda: deque(maxlen=16))  # the last plans' predicted gains over plain
    speculated_for: frozenset = frozenset()  # the request ids of the load's last speculating plan
    stale: bool = False  # running plain, and none of those requests decodes here any more: probe soon

    def seconds_per_token(self) -> dict:
        """`{arm: its samples' seconds summed over their committed tokens summed}` of the arms with samples."""
        return {arm: sum(t for t, _ in s) / sum(n for _, n in s) for arm, s in self.samples.items() if s}


class LoadFallback:
    """Chooses, per engine step, whether the policy plans (`"speculate"`) or the step runs plain (module docstring).

    Args:
        first_interval (`int`, *optional*, defaults to 32): plans at a load before its first probe, and after a
            probe that changed its arm.
        max_interval (`int`, *optional*, defaults to 512): the longest interval between two probes of a load.
        probe_steps (`int`, *optional*, defaults to 6): plans a probe makes in the other arm (the first step of a
            run of an arm is no sample of it, see the module docstring: a probe adds `probe_steps - 1`).
        min_samples (`int`, *optional*, defaults to 4): samples each arm needs before a probe may change the arm.
        margin (`float`, *optional*, defaults to 0.02): by how much (a fraction) the other arm's seconds per token
            must be fewer.
        reference_gain (`float`, *optional*, defaults to 0.5): the predicted gain over a plain step from which a
            load probes after its whole interval; below it the interval shrinks in proportion (module docstring).
        min_interval (`int`, *optional*, defaults to 8): the fewest plans between two probes of a load.

    Attributes:
        plain_steps (`int`), probes (`int`): plans made plain, probes started.
        turnovers (`int`): times a load running plain saw its requests change and probed again sooner.
    """

    def __init__(self, first_interval: int = 32, max_interval: int = 512, probe_steps: int = 6,
                 min_samples: int = 4, margin: float = 0.02, reference_gain: float = 0.5,
                 min_interval: int = 8):  # fmt: skip
        if not (1 <= min_interval <= first_interval <= max_interval and probe_steps >= 2
                and 1 <= min_samples < probe_steps and 0.0 <= margin < 1.0 and reference_gain > 0):  # fmt: skip
            raise ValueError(
                "LoadFallback needs 1 <= min_interval <= first_interval <= max_interval, probe_steps >= 2, "
                "1 <= min_samples < probe_steps, 0 <= margin < 1 and reference_gain > 0; got "
                f"min_interval={min_interval}, first_interval={first_interval}, max_interval={max_interval}, "
                f"probe_steps={probe_steps}, min_samples={min_samples}, margin={margin}, "
                f"reference_gain={reference_gain}"
            )
        self.min_interval, self.reference_gain = int(min_interval), float(reference_gain)
        self.first_interval, self.max_interval = int(first_interval), int(max_interval)
        self.probe_steps, self.min_samples, self.margin = int(probe_steps), int(min_samples), float(margin)
        self.loads: dict[int, LoadArms] = {}
        self._probe: list | None = None  # [load key, arm, plans left]
        self._arms = deque([None, None], maxlen=2)  # the arms of the last two plans, the older one verified now
        self.plain_steps = self.probes = self.turnovers = 0

    def _load(self, key: int) -> LoadArms:
        return self.loads.setdefault(key, LoadArms(self.first_interval))

    def choose(self, requests: int, request_ids=None) -> str:
        """The arm of the plan made now for `requests` decoding requests (0: nothing to plan, `"speculate"`), whose
        ids are `request_ids` (an iterable of `requests` ids; `None`: not known, the requests never count as
        changed)."""
        if requests <= 0:
            self._arms.append(None)
            return SPECULATE
        key = load_key(requests)
        ids = None if request_ids is None else frozenset(request_ids)
        arm = self._probing(key)
        if arm is None:
            load = self._load(key)
            self._turnover(load, ids)
            load.since_probe += 1
            arm = load.arm
            if load.since_probe >= self.due(load):
                arm = _other(load.arm)
                self._probe = [key, arm, self.probe_steps - 1]
                self.probes += 1
        if arm == SPECULATE and ids is not None:
            self._load(key).speculated_for = ids
        self._arms.append(arm)
        self.plain_steps += arm == PLAIN
        return arm

    def _turnover(self, load: LoadArms, ids: frozenset | None) -> None:
        """At a load running plain, once none of the requests of its last speculating plan decodes (module
        docstring): its speculating samples are dropped and its next probe comes after `min_interval` plans."""
        if load.arm != PLAIN or load.stale or ids is None or not load.speculated_for:
            return
        if load.speculated_for.isdisjoint(ids):
            load.stale, load.since_probe = True, 0
            load.samples[SPECULATE].clear()
            self.turnovers += 1

    def due(self, load: LoadArms) -> int:
        """Plans between `load`'s probes: its interval, shrunk while it speculates and its plans' median predicted
        gain `g` is below `reference_gain` (`interval * max(g, 0) / reference_gain`, at least `min_interval`);
        `min_interval` at most once its requests changed while it ran plain (`_turnover`)."""
        if load.stale:
            return min(load.interval, self.min_interval)
        if load.arm != SPECULATE or not load.gains:
            return load.interval
        scale = min(max(statistics.median(load.gains), 0.0) / self.reference_gain, 1.0)
        return max(self.min_interval, round(load.interval * scale))

    def expect(self, requests: int, gain: float | None) -> None:
        """The plan just made for `requests` decoding predicts `gain` over a plain step (`StepPlan.predicted_gain`;
        `None`: not priced, ignored)."""
        if gain is not None and requests > 0 and math.isfinite(gain):
            self._load(load_key(requests)).gains.append(float(gain))

    def _probing(self, key: int) -> str | None:
        """The probe's arm while a probe of `key` has plans left; ends a probe (and decides) otherwise."""
        if self._probe is None:
            return None
        probe_key, arm, left = self._probe
        if probe_key == key and left > 0:
            self._probe[2] -= 1
            return arm
        self._probe = None
        self._decide(probe_key)
        return None

    def _decide(self, key: int) -> None:
        """After a probe of `key`: the other arm where its seconds per token are fewer by more than `margin`, else
        the one in use."""
        load = self._load(key)
        load.since_probe = 0
        if min(len(s) for s in load.samples.values()) < self.min_samples:
            return  # a probe cut short by a change of load: nothing learned, the schedule stays
        load.stale = False  # speculating measured again on the requests now running
        rates = load.seconds_per_token()
        challenger = _other(load.arm)
        if rates[challenger] < (1.0 - self.margin) * rates[load.arm]:
            load.arm, load.interval = challenger, self.first_interval
        else:
            load.interval = min(2 * load.interval, self.max_interval)

    def observe(self, seconds: float, committed: int, requests: int, decode_only: bool) -> bool:
        """One engine step's wall time (`seconds`, the proposer's part included) and the tokens it `committed` for
        `requests` decoding. Kept as a sample of an arm when the step only decoded and the plan it verified and the
        plan made in it were of that arm. Returns whether it was kept."""
        older, newer = self._arms
        if not decode_only or committed <= 0 or older is None or older != newer or seconds <= 0:
            return False
        self._load(load_key(requests)).samples[newer].append((float(seconds), int(committed)))
        return True

    def as_dict(self) -> dict:
        """The counters and, per load bucket, the arm in use, its interval and the plans before its next probe
        (`due`), its plans' median predicted gain over plain, and each arm's ms per committed token."""
        loads = {}
        for key, load in sorted(self.loads.items()):
            rates = {arm: round(1e3 * m, 3) for arm, m in load.seconds_per_token().items()}
            gain = round(statistics.median(load.gains), 4) if load.gains else None
            loads[str(key)] = {"arm": load.arm, "interval": load.interval, "due": self.due(load),
                               "predicted_gain": gain, "ms_per_token": rates}  # fmt: skip
        return {"plain_steps": self.plain_steps, "probes": self.probes, "turnovers": self.turnovers, "loads": loads}


__all__ = ["FALLBACK_ENV", "PLAIN", "SPECULATE", "LoadFallback", "load_key"]

# Copied from hf_retrace/models/cost_model_retrace.py by utils/check_copies.py --fix; edit the original.
# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports numpy and the standard library only (no torch), so both engines share it unchanged; the vLLM
# plugin vendors it byte-identical.
"""The step-cost model of cost-aware speculation (docs/cost-aware-speculation.md): how long a target step takes
for `R` verified rows in the batch (batch x tokens), `t(R)`, plus what each request's own row and reading the
requests' contexts add, and a drafter forward for `S` slots, `d(S)`.

Both are monotone piecewise-linear curves through measured points, fitted once from a profile (engine start, or
first use in transformers), cached per host and configuration, and refreshed online from the step times the engine
observes. A cached file from another host or configuration is refused, so the caller re-measures.
"""

import hashlib
import json
import logging
import os
import platform
import time
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


logger = logging.getLogger(__name__)

FORMAT = "hf_retrace-step-cost"
VERSION = 3  # 2 added the context terms, 3 the request term; older files read with those terms at 0
KNOT_GAP = 0.25  # an observed size this far (relative) from both neighbouring knots becomes a knot


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Non-decreasing least-squares fit of `values` (pool adjacent violators): a step never gets cheaper with more
    rows, whatever the noise of one measurement says."""
    blocks = []  # [mean, weight, count]
    for value, weight in zip(values.tolist(), weights.tolist()):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.array([v for v, _, c in blocks for _ in range(c)], dtype=np.float64)


@dataclass
class CostCurve:
    """A monotone piecewise-linear time curve through `(size, seconds)` knots.

    Between knots it interpolates; past the last knot it extends the last segment's slope (a lone knot scales
    proportionally); below the first knot (but above 0) it keeps the first knot's time, and `size <= 0` costs 0.

    Args:
        sizes (`np.ndarray` of shape `(num_knots,)`): increasing sizes (rows or slots), all > 0.
        seconds (`np.ndarray` of shape `(num_knots,)`): the time at each size, non-decreasing.
    """

    sizes: np.ndarray
    seconds: np.ndarray

    def __post_init__(self):
        self.sizes = np.asarray(self.sizes, dtype=np.float64).reshape(-1)
        self.seconds = np.asarray(self.seconds, dtype=np.float64).reshape(-1)
        if self.sizes.size == 0 or self.sizes.shape != self.seconds.shape:
            raise ValueError(f"a cost curve needs matching, non-empty knots, got {self.sizes} and {self.seconds}")
        if np.any(self.sizes <= 0) or np.any(np.diff(self.sizes) <= 0):
            raise ValueError(f"cost curve sizes must be positive and increasing, got {self.sizes.tolist()}")
        if not np.all(np.isfinite(self.seconds)) or np.any(self.seconds < 0):
            raise ValueError(f"cost curve seconds must be finite and >= 0, got {self.seconds.tolist()}")
        self.seconds = np.maximum.accumulate(self.seconds)
        self._observed = np.zeros(self.sizes.size)  # online observations per knot (interpolation weights summed)

    @classmethod
    def fit(cls, samples) -> "CostCurve":
        """Fits a curve to `(size, seconds)` samples: the median per size (robust to a slow outlier), then made
        non-decreasing."""
        sizes = sorted({int(s) for s, _ in samples})
        medians = np.array([np.median([t for s, t in samples if int(s) == size]) for size in sizes])
        counts = np.array([sum(1 for s, _ in samples if int(s) == size) for size in sizes], dtype=np.float64)
        return cls(np.array(sizes), _isotonic(medians, counts))

    def __call__(self, size) -> np.ndarray | float:
        """The time for `size` (scalar or array), per the rules in the class docstring."""
        if isinstance(size, (int, float, np.integer, np.floating)):
            return self._scalar(float(size))
        size = np.asarray(size, dtype=np.float64)
        out = np.interp(size, self.sizes, self.seconds)
        last, top = self.sizes[-1], self.seconds[-1]
        slope = (top - self.seconds[-2]) / (last - self.sizes[-2]) if self.sizes.size > 1 else top / last
        out = np.where(size > last, top + slope * (size - last), out)
        out = np.where(size <= 0, 0.0, out)
        return float(out) if out.ndim == 0 else out

    def _scalar(self, x: float) -> float:
        """`self(x)` for one size, in Python floats: the policy prices a dozen single sizes a step, and numpy's
        per-call overhead there is most of the cost. The arithmetic is `np.interp`'s, so both paths agree bit for
        bit (a plan must not depend on which one priced it)."""
        if x <= 0:
            return 0.0
        sizes, seconds = self.sizes.tolist(), self.seconds.tolist()
        last, top = sizes[-1], seconds[-1]
        if x > last:
            slope = (top - seconds[-2]) / (last - sizes[-2]) if len(sizes) > 1 else top / last
            return top + slope * (x - last)
        j = bisect_right(sizes, x) - 1  # sizes[j] <= x < sizes[j + 1]
        if j < 0:
            return seconds[0]
        if j == len(sizes) - 1 or sizes[j] == x:
            return seconds[j]
        slope = (seconds[j + 1] - seconds[j]) / (sizes[j + 1] - sizes[j])
        return slope * (x - sizes[j]) + seconds[j]

    def observe(self, size: float, seconds: float, alpha: float, max_change: float) -> None:
        """Moves the knots around `size` toward one observed time (an exponentially weighted average per knot,
        weighted by the interpolation weights); a slower step counts as at most `1 + max_change` x the prediction, so
        a stalled step moves the curve by a bounded amount (a faster one is believed: nothing speeds a step up). A
        size past the ends becomes a new knot, and so does one inside a wide gap (both neighbours farther than
        `KNOT_GAP` of it, and at least 2 away): the curve gets knots where the engine runs. Without them, sizes
        between a profile's last knot (8 rows) and a prefill's (100) would share one straight segment, its slope
        set by the prefill steps.

        A knot's first observations weigh more than `alpha`: `1 / (n + 4)` for its `n`-th (the profile counts as 3),
        until that falls to `alpha`. A profile taken during a load spike, or a size first seen long after start
        (the drafter, when the policy rarely runs it), is corrected within a few steps. `alpha = 0` freezes it."""
        predicted = self(size)
        # only upward: interference (another process, a page fault) slows a step down, nothing makes it faster
        residual = min(float(seconds - predicted), max_change * predicted)
        right = int(np.searchsorted(self.sizes, size))  # sizes[right - 1] < size <= sizes[right]
        left = max(right - 1, 0)
        if size < self.sizes[0] or size > self.sizes[-1] or self._in_wide_gap(size, left, right):
            self._insert(size, predicted + self._weight(0.0, alpha) * residual)
            return
        share = 1.0  # of the update the right knot gets: its interpolation weight
        if self.sizes[right] != size:
            share = (size - self.sizes[left]) / (self.sizes[right] - self.sizes[left])
        self.seconds[right] += self._weight(self._observed[right], alpha) * share * residual
        self.seconds[left] += self._weight(self._observed[left], alpha) * (1.0 - share) * residual
        self._observed[right] += share
        self._observed[left] += 1.0 - share
        self.seconds = _isotonic(np.maximum(self.seconds, 0.0), np.ones_like(self.seconds))

    def _in_wide_gap(self, size: float, left: int, right: int) -> bool:
        """Whether `size`, inside the curve between knots `left < right`, is far enough from both to be a knot."""
        if right == left or self.sizes[right] == size:
            return False
        below, above = size - self.sizes[left], self.sizes[right] - size
        return min(below, above) >= 2.0 and below >= KNOT_GAP * self.sizes[left] and above >= KNOT_GAP * size

    @staticmethod
    def _weight(observed: float, alpha: float) -> float:
        return 0.0 if alpha <= 0 else max(alpha, 1.0 / (observed + 4.0))

    def _insert(self, size: float, seconds: float) -> None:
        at = int(np.searchsorted(self.sizes, size))
        self.sizes = np.insert(self.sizes, at, float(size))
        self._observed = np.insert(self._observed, at, 1.0)
        self.seconds = _isotonic(np.maximum(np.insert(self.seconds, at, seconds), 0.0), np.ones(self.sizes.size))

    def to_list(self) -> list[list[float]]:
        return [[float(s), float(t)] for s, t in zip(self.sizes, self.seconds)]


@dataclass(frozen=True)
class HostKey:
    """What a measured cost depends on: the engine, the target, its dtype, the thread count, compiled or eager, the
    CPU model, the machine type, the CPU's vector extensions (`cpu_features`: the same model name covers AVX2-only and
    AVX-512 machines) and any `extra` the engine adds (e.g. its version). Build it with [`host_key`]."""

    engine: str
    target_id: str
    dtype: str
    num_threads: int
    compiled: bool
    cpu: str
    machine: str
    extra: str = ""
    cpu_features: str = ""

    def digest(self) -> str:
        """16 hex digits naming this configuration's cache file."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _cpuinfo(*fields: str) -> str | None:
    """The value of the first `/proc/cpuinfo` line that starts with one of `fields`; `None` without the file."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(fields):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU model name: `/proc/cpuinfo`'s "model name" on Linux, else `platform.processor()`."""
    return _cpuinfo("model name") or platform.processor() or "unknown"


_KERNEL_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_features() -> str:
    """The CPU's vector extensions that change which kernels run (from `/proc/cpuinfo`'s flags), comma separated;
    `""` where the file is missing."""
    flags = set((_cpuinfo("flags", "features") or "").split())
    return ",".join(name for name in _KERNEL_FEATURES if name in flags)


MIN_FIT_STEPS = 50  # decode steps a fit of the context terms needs
MIN_REQUEST_SPREAD = 2  # requests a step must vary by in a fit's window for the request term to be fitted
MIN_KNOT_WEIGHT = 3.0  # steps (interpolation weights summed) a knot needs to give back their contexts
RESCALE_TOLERANCE = 1.25  # a cache file whose t(R) is off what this host measures by more than this is not trusted


def speed_agrees(ratio: float) -> bool:
    """Whether a measured / predicted step-time `ratio` is within `RESCALE_TOLERANCE` either way: a cache file
    that fails it was written on another machine of the same key (both engines check a loaded file with it)."""
    return 1.0 / RESCALE_TOLERANCE <= ratio <= RESCALE_TOLERANCE


def host_key(engine: str, target_id: str, dtype: str, num_threads: int, compiled: bool, extra: str = "") -> HostKey:
    """The [`HostKey`] of this host for one engine configuration (the CPU model is read here; no torch needed)."""
    return HostKey(str(engine), str(target_id), str(dtype), int(num_threads), bool(compiled), cpu_model(),
                   platform.machine(), str(extra), cpu_features())  # fmt: skip


def default_cache_path(key: HostKey) -> Path:
    """`~/.cache/hf_retrace/cost/<engine>-<digest>.json`; the `HF_RETRACE_CACHE` environment variable replaces
    `~/.cache/hf_retrace`."""
    root = Path(os.environ.get("HF_RETRACE_CACHE") or Path.home() / ".cache" / "hf_retrace")
    return root / "cost" / f"{key.engine}-{key.digest()}.json"


def measure(run, sizes, repeats: int = 3, warmup: int = 1) -> list[tuple[int, float]]:
    """Times `run(size)` for every size: a profile, as `(size, seconds)` samples for [`StepCostModel.fit`].

    Args:
        run (`Callable[[int], Any]`): one target step with `size` rows (or one drafter forward with `size` slots);
            it must finish its work before returning (synchronise an accelerator inside it).
        sizes (`Iterable[int]`): the sizes to time, e.g. `(1, 2, 4, 8, 16, 32)`.
        repeats (`int`), warmup (`int`): timed and untimed calls per size.
    """
    samples = []
    for size in sizes:
        for i in range(warmup + repeats):
            start = time.perf_counter()
            run(int(size))
            if i >= warmup:
                samples.append((int(size), time.perf_counter() - start))
    return samples


def fit_context_terms(requests, verified, first_rows_context, other_rows_context, seconds) -> tuple:
    """`(a, c, e, r2, r2_rows_only)`: least squares of decode steps' target `seconds` (arrays of shape `(steps,)`) as
    `b0 + b1 * requests + b2 * verified + a * K + c * X`, beside the rows-only fit's R^2. A term the data make
    negative is dropped and the other refitted: a context never makes a step faster. Columns that never vary (batch
    1: one request a step) are fine; least squares takes the smallest solution.

    `e = max(b1 - b2, 0)` is what a request's own row costs beyond a verified row (its sampling, the engine's
    per-request work), `None` when the requests a step varied by less than `MIN_REQUEST_SPREAD` (it is not
    identified then: batch 1).

    Raises:
        ValueError: fewer than `MIN_FIT_STEPS` steps.
    """
    seconds = np.asarray(seconds, dtype=np.float64)
    if seconds.size < MIN_FIT_STEPS:
        raise ValueError(f"{seconds.size} decode steps, a fit of the context terms needs {MIN_FIT_STEPS}")
    rows = np.stack([np.ones_like(seconds), np.asarray(requests, np.float64), np.asarray(verified, np.float64)], 1)
    context = np.stack([np.asarray(first_rows_context, np.float64), np.asarray(other_rows_context, np.float64)], 1)
    spread = float(((seconds - seconds.mean()) ** 2).sum()) or 1e-30

    def solve(columns):
        coef = np.linalg.lstsq(columns, seconds, rcond=None)[0]
        return coef, 1.0 - float(((seconds - columns @ coef) ** 2).sum()) / spread

    r2_rows = solve(rows)[1]
    identified = np.ptp(rows[:, 1]) >= MIN_REQUEST_SPREAD  # `e` needs steps of different request counts
    keep = [0, 1]
    while True:
        coef, r2 = solve(np.hstack([rows, context[:, keep]]))
        terms = dict(zip(keep, coef[3:]))
        negative = [k for k, v in terms.items() if v < 0]
        if not negative:
            per_request = max(float(coef[1] - coef[2]), 0.0) if identified else None
            return float(terms.get(0, 0.0)), float(terms.get(1, 0.0)), per_request, r2, r2_rows
        keep = [k for k in keep if k != min(negative, key=terms.get)]


def knots_less_context(curve: "CostCurve", rows, first_rows_context, other_rows_context, first: float,
                       other: float, requests=None, per_request: float = 0.0) -> "CostCurve":  # fmt: skip
    """`curve` with each knot less `first * K + other * X + per_request * n` at the mean contexts and requests of the
    steps (arrays of `rows`, `K`, `X`, `n`) it learned from, weighted as [`CostCurve.observe`] spreads a step
    between two knots; a knot that saw fewer than `MIN_KNOT_WEIGHT` of them is kept. The knots learn steps' times
    beyond the terms they had: when the terms grow by `(first, other, per_request)`, this is what the knots give
    back."""
    sizes = curve.sizes
    rows = np.asarray(rows, dtype=np.float64)
    right = np.clip(np.searchsorted(sizes, rows), 0, sizes.size - 1)
    left = np.maximum(right - 1, 0)
    gap = np.where(right > left, sizes[right] - sizes[left], 1.0)
    share = np.where((right > left) & (sizes[right] != rows), np.clip((rows - sizes[left]) / gap, 0.0, 1.0), 1.0)
    weight = np.bincount(right, share, sizes.size) + np.bincount(left, 1.0 - share, sizes.size)
    tokens = np.zeros(sizes.size)
    terms = ((first_rows_context, first), (other_rows_context, other), (requests, per_request))
    for values, term in terms:
        if values is None or term == 0:
            continue
        values = np.asarray(values, dtype=np.float64)
        summed = np.bincount(right, share * values, sizes.size) + np.bincount(left, (1.0 - share) * values, sizes.size)
        tokens += term * summed
    seen = weight >= MIN_KNOT_WEIGHT
    seconds = curve.seconds.copy()
    seconds[seen] = np.maximum(seconds[seen] - tokens[seen] / weight[seen], 0.0)
    return CostCurve(sizes, seconds)


@dataclass
class StepCostModel:
    """Target step time for `R` verified rows of `n` requests, `t(R) + e * n + a * K + c * X`, and drafter time
    `d(S)` for `S` drafter slots, in seconds.

    A step's rows are of two kinds. Each request's first row carries its sampling and the engine's per-request work
    beyond a row's compute: `e` prices that, so `t(R)` is what a row costs whichever kind it is. Without it the
    knots learn plain steps of many requests as dear rows, and a verified row in a step of few requests as cheap
    ones, and the slope between two knots mixes both.

    A row at position `p` attends to `p + 1` tokens. `K` sums that over each request's first row (one read of every
    request's context) and `X` over its other rows (its verified tokens). Whether an
    attention kernel reads a request's K/V once for all its rows or once per row decides whether a verified row's
    context costs little (`c` near 0) or as much as the first row's (`c` near `a`), so both are learned.

    `t(R)` is measured with short contexts and refreshed from the steps' times less the terms; `a`, `c` and `e` are
    fitted online by least squares on recent decode steps, with their own intercept and per-row terms, so they never
    trade the level with the knots (see [`StepCostModel.observe`]). A verified row of a request with `L` tokens costs
    `t(R + 1) - t(R) + c * L`: a long request pays more for its drafts than a short one.

    Args:
        target (`CostCurve`): `t(R)`.
        drafter (`CostCurve`): `d(S)`; `d(0) = 0` (no drafter forward).
        context (`tuple[float, float]`, *optional*, defaults to `(0, 0)`): `(a, c)`, seconds per context token of a
            request's first row and of its other rows.
        per_request (`float`, *optional*, defaults to 0): `e`, seconds a request's own row costs beyond a verified
            row.
        alpha (`float`, *optional*, defaults to 0.05): weight of one observed step in the online refresh, once a
            knot has seen `1 / alpha - 4` of them (earlier ones weigh more, see [`CostCurve.observe`]); 0 freezes it.
        max_change (`float`, *optional*, defaults to 0.5): a slower observation moves a knot up by at most this
            fraction of the prediction (times its weight), so an outlier (a page fault, another process) cannot
            wreck the curve.
        context_window (`int`, *optional*, defaults to 512): decode steps the terms are fitted on; every
            `refit_every` of them, `(a, c, e)` are refitted by least squares on the last `context_window` (see
            [`StepCostModel.observe`]); 0 keeps them at their given values.
        refit_every (`int`, *optional*, defaults to 16): decode steps between two fits.

    Example:
    ```python
    >>> model = StepCostModel.fit([(1, 0.0192), (8, 0.0388)], [(16, 0.004), (128, 0.030)])
    >>> round(model.marginal_row_cost(1) * 1000, 1)  # ms
    2.8
    ```
    """

    target: CostCurve
    drafter: CostCurve
    context: tuple = (0.0, 0.0)
    per_request: float = 0.0
    alpha: float = 0.05
    max_change: float = 0.5
    context_window: int = 512
    refit_every: int = 16
    num_observed: int = field(default=0, compare=False)

    def __post_init__(self):
        self.context = tuple(_context(v) for v in self.context)
        if len(self.context) != 2:
            raise ValueError(f"context must be (a, c), seconds per context token of first and other rows, got "
                             f"{self.context}")  # fmt: skip
        if not isinstance(self.per_request, (int, float)) or not np.isfinite(self.per_request) or self.per_request < 0:
            raise ValueError(f"per_request must be a finite number of seconds >= 0, got {self.per_request!r}")
        self.per_request = float(self.per_request)
        if self.context_window < 0 or self.refit_every < 1:
            raise ValueError(f"context_window must be >= 0 (0 keeps the context terms) and refit_every >= 1, got "
                             f"{self.context_window}, {self.refit_every}")  # fmt: skip
        # the last `context_window` decode steps: requests, verified rows (their sum is the step's rows), K, X, the
        # target's seconds
        self._steps = np.zeros((self.context_window, 5))
        self._num_steps = 0  # decode steps seen; the newest sits at `(_num_steps - 1) % context_window`
        self.fits = 0  # fits of the context terms taken
        self.fit_r2 = None  # the last fit's R^2 (and that of the rows alone), `None` before the first

    @property
    def context_per_row(self) -> float:
        """`c`: seconds per context token for each row of a request beyond its first (a verified token's row)."""
        return self.context[1]
    @classmethod
    def fit(cls, target_samples, drafter_samples, **kwargs) -> "StepCostModel":
        """A model from a profile: `(rows, seconds)` samples of target steps, `(slots, seconds)` of drafter
        forwards."""
        return cls(CostCurve.fit(target_samples), CostCurve.fit(drafter_samples), **kwargs)

    def target_seconds(self, rows) -> np.ndarray | float:
        return self.target(rows)

    def drafter_seconds(self, slots) -> np.ndarray | float:
        return self.drafter(slots)

    def context_seconds(self, first_rows_context, other_rows_context=0) -> np.ndarray | float:
        """`a * K + c * X`: what reading the contexts adds to a target step beyond `t(R)`, for `K` context tokens of
        the requests' first rows and `X` of their other rows."""
        return self.context[0] * first_rows_context + self.context[1] * other_rows_context

    def step_seconds(self, rows, slots, first_rows_context=0, other_rows_context=0, requests=0) -> np.ndarray | float:
        """`t(rows) + e * requests + a * K + c * X + d(slots)`."""
        context = self.context_seconds(first_rows_context, other_rows_context)
        return self.target(rows) + self.per_request * requests + context + self.drafter(slots)

    def marginal_row_cost(self, rows: int, context_tokens: int = 0) -> float:
        """`t(rows + 1) - t(rows) + c * context_tokens`: what one more verified row, of a request with
        `context_tokens` tokens, costs in a step of `rows` rows."""
        return float(self.target(rows + 1) - self.target(rows)) + self.context[1] * context_tokens

    def observe(self, rows: int, slots: int, seconds: float, drafter_seconds: float | None = None,
                first_rows_context: int = 0, other_rows_context: int = 0,
                decode_rows: tuple | None = None, requests: int | None = None) -> None:  # fmt: skip
        """Refreshes the model from one observed step of `rows` verified rows and `slots` drafter slots that took
        `seconds` in all; its rows read `first_rows_context` (`K`) and `other_rows_context` (`X`) context tokens, and
        `requests` decoding requests ran in it (`n`; defaults to `decode_rows`' requests, else 0).
        With `drafter_seconds` (timed apart) each curve gets its own time; without it a step that drafted is split in
        proportion to the predictions.

        The knots learn the target's part less `e * n + a * K + c * X`. `decode_rows = (requests, verified)`, for a
        step with no prefill rows, also keeps the step for the terms' fit: every `refit_every` such steps, `(a, c, e)`
        are refitted by least squares (`fit_context_terms`) on the last `context_window`, with their own intercept
        and per-row terms, so the fit never reads the knots and the knots cannot trade their level with it. The
        knots then give back what the change of the terms now prices (`knots_less_context`)."""
        if seconds <= 0 or not np.isfinite(seconds) or rows <= 0:
            return
        if requests is None:
            requests = decode_rows[0] if decode_rows is not None else 0
        context_part = self.context_seconds(first_rows_context, other_rows_context) + self.per_request * requests
        if slots > 0 and drafter_seconds is None:
            predicted_t, predicted_d = self.target(rows) + context_part, self.drafter(slots)
            drafter_seconds = seconds * predicted_d / max(predicted_t + predicted_d, 1e-12)
        if slots > 0:
            self.drafter.observe(slots, drafter_seconds, self.alpha, self.max_change)
        target_seconds = seconds - (drafter_seconds or 0.0)
        self.target.observe(rows, target_seconds - context_part, self.alpha, self.max_change)
        self.num_observed += 1
        if decode_rows is not None and self.context_window > 0:
            self._steps[self._num_steps % self.context_window] = (*decode_rows, first_rows_context,
                                                                  other_rows_context, target_seconds)  # fmt: skip
            self._num_steps += 1
            if self._num_steps >= MIN_FIT_STEPS and self._num_steps % self.refit_every == 0:
                self._refit_context()

    def _refit_context(self) -> None:
        """Refits `(a, c, e)` on the kept decode steps (`e` kept where the window cannot tell it: batch 1); a fit
        whose terms alone would exceed the steps' mean time (a degenerate window) is not taken."""
        steps = self._steps[: min(self._num_steps, self.context_window)]
        requests, verified, first, other, seconds = steps.T
        a, c, e, r2, r2_rows = fit_context_terms(requests, verified, first, other, seconds)
        e = self.per_request if e is None else e
        if a * first.mean() + c * other.mean() + e * requests.mean() > seconds.mean():
            return
        change = (a - self.context[0], c - self.context[1])
        rows = requests + verified  # a decode step's rows: each request's first, then its verified tokens
        less = knots_less_context(self.target, rows, first, other, *change, requests, e - self.per_request)
        self.target.seconds = less.seconds  # in place: the observation counts stay
        self.context, self.per_request = (a, c), e
        self.fits += 1
        self.fit_r2 = (r2, r2_rows)

    def save(self, path, key: HostKey) -> None:
        """Writes the curves and `key` as JSON (atomically: a crash never leaves half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": FORMAT, "version": VERSION, "key": asdict(key), "target": self.target.to_list(),
                   "drafter": self.drafter.to_list(), "context": [float(v) for v in self.context],
                   "per_request": self.per_request}  # fmt: skip
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path, key: HostKey, **kwargs) -> "StepCostModel | None":
        """The model saved at `path` for `key`, or `None` (with a log line saying why) when there is no file or it
        was measured on another host or configuration: the caller re-measures rather than trust it.

        Raises:
            ValueError: the file exists but is not a valid step-cost file (corrupt, truncated, wrong format).
        """
        path = Path(path)
        if not path.exists():
            logger.info("no step-cost file at %s: measuring", path)
            return None
        payload = _read_payload(path)
        stored = payload["key"]
        differ = {k: (stored.get(k), v) for k, v in asdict(key).items() if stored.get(k) != v}
        if differ:
            what = ", ".join(f"{k}: file {a!r} vs here {b!r}" for k, (a, b) in sorted(differ.items()))
            logger.warning("step-cost file %s was measured for another host or configuration (%s): re-measuring",
                           path, what)  # fmt: skip
            return None
        try:
            return cls(_curve(payload["target"], path), _curve(payload["drafter"], path),
                       _context_pair(payload.get("context", [0.0, 0.0])), payload.get("per_request", 0.0),
                       **kwargs)  # fmt: skip
        except ValueError as error:
            raise ValueError(f"{path} is not a valid step-cost file: {error}") from error


def _read_payload(path: Path) -> dict:
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a valid step-cost file ({error}); delete it to re-measure") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not isinstance(payload.get("key"), dict):
        raise ValueError(f"{path} is not a step-cost file (format {FORMAT!r} expected); delete it to re-measure")
    if payload.get("version") not in (1, 2, VERSION):
        version = payload.get("version")
        raise ValueError(f"{path} has step-cost format version {version}, this code reads 1 to {VERSION}")
    return payload


def _curve(knots, path: Path) -> CostCurve:
    if not isinstance(knots, list) or not all(isinstance(k, list) and len(k) == 2 for k in knots):
        raise ValueError(f"knots must be [[size, seconds], ...], got {str(knots)[:80]}")
    array = np.array(knots, dtype=np.float64).reshape(-1, 2)
    return CostCurve(array[:, 0], array[:, 1])


def _context_pair(value) -> tuple:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"context must be [a, c], seconds per context token, got {str(value)[:80]}")
    return tuple(value)


def _context(value) -> float:
    if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise ValueError(f"context costs must be finite numbers >= 0 (seconds per context token), got {value!r}")
    return float(value)

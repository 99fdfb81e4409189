"""The engine's step-cost model for the cost-aware policy (docs/cost-aware-speculation.md): `t(R)`, the time of a
step whose target verifies `R` rows, and `d(S)`, the drafter's forward of `S` slots, on this host.

Where the model comes from, in order:
1. the per-host cache file (`default_cache_path(key)`, under `HF_RETRACE_CACHE`), when its key matches this host
   and configuration (`engine_key`: target path and config, dtype, bound threads, compiled or eager, vLLM version,
   the drafter's config); a file for another host or configuration, or a corrupt one, is re-measured, never
   trusted. Machines that share a CPU model name still differ in speed (clock, memory, neighbours), so the file's
   curves are checked against the first `WARM_STEPS` decode steps too, and rescaled to them when off by more than
   `RESCALE_TOLERANCE`;
2. the start-up profile's samples (profile.py; on unless `HF_RETRACE_VLLM_PROFILE=0`);
3. else a prior of the right shape (`prior_model`), scaled to this host by the first observed steps.

Every engine step refreshes it online from the proposer's `StepRecord` (steps.py): the step's wall time less the
drafter's forward is `t(R)`, the drafter's forward is `d(S)`. A step far slower than predicted is idle time between
requests, not cost, and is skipped. The model is saved every `SAVE_EVERY` refreshes and at engine exit.

numpy and the standard library only (with the shared `cost_model_retrace.py`), so it runs without an engine.
"""

import atexit
import hashlib
import json
import os
import statistics
import weakref
from pathlib import Path

import numpy as np

from .logs import get_logger
from .shared.cost_model_retrace import CostCurve, HostKey, StepCostModel, default_cache_path, host_key, speed_agrees


logger = get_logger(__name__)

VLLM_EXTRA = "vllm-0.32"
SAVE_EVERY = 500  # refreshes between saves of the cache file
IDLE_FACTOR = 5.0  # a step this many times slower than predicted is idle time, not cost
WARM_STEPS = 4  # observed decode steps whose median scales the prior (or a cache file that is off) to this host
DECODE_ROWS = 4  # a step with more rows a request than this is taken for a prefill while the prior is scaled
# The prior's shape, relative to a one-row target step: ~19.2 ms for 1 row and ~38.8 ms for 8 on the development
# host (vLLM compiled, SmolLM2-135M, 2 cores), so a row costs ~0.146 of a one-row step; a drafter block of 16 slots
# ~0.35 of it, and 8 blocks about as much as the 8-row target step.
PRIOR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PRIOR_ROW_SLOPE = 0.146
PRIOR_SLOTS = (16, 32, 64, 128, 256)
PRIOR_DRAFTER = (0.12, 0.0145)  # d(S) / t(1) = a + b * S
PRIOR_ONE_ROW_SECONDS = 0.02  # t(1) before the first observed steps


def bound_threads(bind: str | None = None) -> int:
    """Cores a CPU worker computes on: `VLLM_CPU_OMP_THREADS_BIND` (`"0-1"`, `"0,2,4"`, `"0-3|4-7"`: the first
    rank's list), or this process's CPU affinity when unset, `"auto"` or `"nobind"`."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") if bind is None else bind
    first = bind.split("|")[0].strip()
    if first in ("", "auto", "nobind", "all"):
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = set()
    for part in first.split(","):
        low, _, high = part.strip().partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return len(cores)


def _config_digest(folder: str) -> str | None:
    """12 hex digits of `folder/config.json` less its provenance (the export's `hf_retrace.source_commit`, which
    changes with every commit of this package and not what a step costs); `None` where there is no such file (e.g.
    a Hub id). A file that is not a JSON object is digested as its bytes."""
    config = Path(folder, "config.json")
    if not config.is_file():
        return None
    data = config.read_bytes()
    try:
        fields = json.loads(data)
    except ValueError:
        fields = None
    if isinstance(fields, dict):
        if isinstance(fields.get("hf_retrace"), dict):
            fields["hf_retrace"].pop("source_commit", None)
        data = json.dumps(fields, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:12]


def engine_key(target: str, dtype: str, num_threads: int, compiled: bool, drafter: str = "") -> HostKey:
    """The cache key of one engine configuration on this host. The target is named by its path and a digest of its
    `config.json` (so a changed checkpoint in the same folder is re-measured). `d(S)` depends on the drafter's shape,
    not on where it lies or which commit exported it, so the drafter is named by its `config.json`'s digest alone,
    provenance left out: the same drafter exported into another folder reads the same file (a drafter folder
    without one, or a Hub id, is named as given)."""
    target_digest = _config_digest(target) or "no-config"
    drafter_id = (_config_digest(drafter) or drafter) if drafter else ""
    return host_key("vllm", f"{target}@{target_digest}", dtype, num_threads, compiled,
                    f"{VLLM_EXTRA};drafter={drafter_id}")  # fmt: skip


def key_from_vllm_config(vllm_config) -> HostKey:
    """[`engine_key`] of a `VllmConfig` (compiled: compilation mode other than `NONE`)."""
    model_config = vllm_config.model_config
    mode = vllm_config.compilation_config.mode
    drafter = vllm_config.speculative_config.draft_model_config.model if vllm_config.speculative_config else ""
    return engine_key(model_config.model, str(model_config.dtype), bound_threads(), int(mode or 0) != 0, drafter)


def prior_model(one_row_seconds: float = PRIOR_ONE_ROW_SECONDS) -> StepCostModel:
    """The prior's curves (module constants), for a host whose one-row target step takes `one_row_seconds`."""
    rows = np.array(PRIOR_ROWS, dtype=np.float64)
    slots = np.array(PRIOR_SLOTS, dtype=np.float64)
    target = CostCurve(rows, one_row_seconds * (1.0 + PRIOR_ROW_SLOPE * (rows - 1)))
    drafter = CostCurve(slots, one_row_seconds * (PRIOR_DRAFTER[0] + PRIOR_DRAFTER[1] * slots))
    return StepCostModel(target, drafter)


def step_costs(record) -> tuple[float, float] | None:
    """`(target_seconds, drafter_seconds)` of one `StepRecord`, or `None` when the engine's part is unknown (the
    first step). The target's part is the whole step (engine, bookkeeping, context K/V) less the drafter's forward,
    so `t(R) + d(S)` predicts a step's wall time."""
    if record.engine_seconds is None or record.rows <= 0:
        return None
    return record.engine_seconds + record.propose_seconds - record.drafter_seconds, record.drafter_seconds


class EngineCosts:
    """The engine's [`StepCostModel`] with where it came from, its online refresh and its cache file.

    Args:
        key ([`HostKey`]): this host and configuration; `path` defaults to `default_cache_path(key)`.
        save_at_exit (`bool`): save the refreshed model when the process exits.

    Attributes:
        model ([`StepCostModel`]): `t(R)` and `d(S)`, what the policy plans with.
        source (`str`): `"cache"`, `"profile"` or `"prior"` (until `WARM_STEPS` steps scale it: `"prior-scaled"`; a
            cache file they found off by more than `RESCALE_TOLERANCE`: `"cache-rescaled"`).
        skipped (`int`): steps skipped as idle time.
    """

    def __init__(self, key: HostKey, path=None, save_at_exit: bool = True):
        self.key = key
        self.path = Path(path) if path is not None else default_cache_path(key)
        self.model, self.source = self._load(), "cache"
        if self.model is None:
            self.model, self.source = prior_model(), "prior"
        self.skipped = 0
        self._warm: list[tuple[float, float, float, float]] = []  # (target s, t(R), drafter s, d(S)) of early steps
        self._since_save = 0
        if save_at_exit:
            ref = weakref.ref(self)
            atexit.register(lambda: ref() is not None and ref().save())

    def _load(self) -> StepCostModel | None:
        try:
            return StepCostModel.load(self.path, self.key)
        except ValueError as error:  # a corrupt cache file: the engine still starts, and measures again
            logger.warning("hf-retrace: %s; re-measuring", error)
            return None

    def use_profile(self, target_samples, drafter_samples) -> None:
        """Fits the model to the start-up profile's `(size, seconds)` samples, unless the cache file matched."""
        if self.source == "cache" or not target_samples or not drafter_samples:
            return
        fitted = StepCostModel.fit(target_samples, drafter_samples)
        self._replace_curves(fitted.target, fitted.drafter)
        self.source = "profile"
        self.save()

    def observe(self, record, step_time=None) -> bool:
        """Refreshes the model from one `StepRecord`. Returns whether it counted (not the first step, not idle).

        `step_time(rows, slots, target_seconds, drafter_seconds, context_tokens, decode_rows, requests)` refreshes the
        curves (the policy's, which owns this `model` too); without it, `model.observe` does."""
        costs = step_costs(record)
        if costs is None:
            return False
        target_s, drafter_s = costs
        rows, slots = record.rows, record.drafter_slots
        if self.source in ("prior", "cache"):
            if rows > DECODE_ROWS * record.requests:  # a prefill (and the engine's first, cold steps): not its scale
                return False
            if self._warm_up(rows, slots, target_s, drafter_s, record.context_tokens, record.decoding):
                return True
        if target_s > IDLE_FACTOR * self.model.target_seconds(rows):
            self.skipped += 1
            return False
        if step_time is not None:
            step_time(rows, slots, target_s, drafter_s, record.context_tokens, record.decode_rows, record.decoding)
        else:
            self.model.observe(rows, slots, target_s + drafter_s, drafter_s if slots else None, *record.context_tokens,
                               record.decode_rows, record.decoding)  # fmt: skip
        self._since_save += 1
        if self._since_save >= SAVE_EVERY:
            self.save()
        return True

    def _warm_up(self, rows: int, slots: int, target_s: float, drafter_s: float, context=(0, 0),
                 requests: int = 0) -> bool:  # fmt: skip
        """Collects the first decode steps, then scales the model's target curve by their median ratio to it, and
        its drafter curve by the drafting steps' ratio (the target's when none drafted yet): always for the prior;
        for a cache file only when its target curve is off by more than `RESCALE_TOLERANCE`, and then both curves by
        the target's ratio (a faster or slower machine, the file's shapes kept). Returns whether the step was taken
        here (a cache file the steps confirmed learns from them as usual)."""
        d_pred = self.model.drafter_seconds(slots) if slots else 0.0
        predicted = float(self.model.step_seconds(rows, 0, *context, requests))  # a file's terms too
        self._warm.append((target_s, predicted, drafter_s, d_pred))
        if len(self._warm) < WARM_STEPS:
            return True
        target_scale = statistics.median(t / p for t, p, _, _ in self._warm)
        drafted = [d / p for _, _, d, p in self._warm if p > 0]
        drafter_scale = statistics.median(drafted) if drafted else target_scale
        self._warm, was = [], self.source
        if was == "cache":
            if speed_agrees(target_scale):
                self.source = "cache-checked"
                return False
            drafter_scale = target_scale  # another machine's speed: one factor, the file's shapes kept
        self._replace_curves(
            CostCurve(self.model.target.sizes, self.model.target.seconds * target_scale),
            CostCurve(self.model.drafter.sizes, self.model.drafter.seconds * drafter_scale),
        )
        self.source = "prior-scaled" if was == "prior" else "cache-rescaled"
        if was == "cache":
            logger.warning("hf-retrace: step-cost file %s predicts %.2fx this host's decode steps (another machine of "
                           "the same CPU model?): rescaled to them", self.path, 1.0 / target_scale)  # fmt: skip
        logger.info("hf-retrace step costs: %s to this host, t(1) %.1f ms, d(16) %.1f ms", self.source,
                    self.model.target_seconds(1) * 1e3, self.model.drafter_seconds(16) * 1e3)  # fmt: skip
        self.save()
        return True

    def _replace_curves(self, target: CostCurve, drafter: CostCurve) -> None:
        """Swaps the curves in place: the policy holds this `model` object."""
        self.model.target, self.model.drafter = target, drafter

    def save(self) -> None:
        """Writes the model to the cache file (not a prior no step has scaled yet)."""
        if self.source == "prior":
            return
        try:
            self.model.save(self.path, self.key)
            self._since_save = 0
        except OSError as error:  # a read-only cache: the engine runs on, and measures again next start
            logger.warning("hf-retrace: could not save the step-cost model to %s (%s)", self.path, error)

# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch, transformers and the Hub files `.acceptance_retrace`, `.cost_model_retrace`,
# `.online_datastore_retrace` only, so `trust_remote_code=True` loads it.
"""What the cost-aware policy learns across `generate` calls of one drafter object (docs/cost-aware-speculation.md),
and the transformers side's step-cost profile.

[`speculation_state`] hangs a [`SpeculationState`] on the drafter on first use: the acceptance estimator, the
online datastore and the step-cost models, per host key. It is a plain attribute, never saved with the weights.
A cost model is loaded from its per-host cache file, or profiled once ([`profile_cost_model`]: the target at a few
row counts on a fresh small cache, and one drafter block; about a second for a 0.6B target on 2 cores) and saved.
Machines with the same CPU model name share a key but not a speed, so a loaded file is checked first against a few
timed target steps ([`time_target_step`]) and profiled again when it is off by more than `RESCALE_TOLERANCE`.
"""

import functools
import hashlib
import logging
import time

import torch
from transformers import DynamicCache

from .acceptance_retrace import AcceptanceEstimator
from .cost_model_retrace import HostKey, StepCostModel, default_cache_path, host_key, measure, speed_agrees
from .online_datastore_retrace import OnlineDatastore


logger = logging.getLogger(__name__)

TARGET_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # rows profiled (those above the drafter's block are skipped)
PROFILE_CONTEXT = 32  # tokens in the profile's fresh cache


class SpeculationState:
    """The cost-aware policy's memory on one drafter object.

    Attributes:
        estimator ([`AcceptanceEstimator`]): calibrated acceptance, learned from every verification.
        cost_models (`dict[HostKey, StepCostModel]`): step costs per configuration, refreshed online.
        cost_model ([`StepCostModel`], *optional*): when set, used for every configuration (tests, a user's own
            profile); `None` loads or profiles per configuration.
        open_request (`tuple`, *optional*): `(policy, request_id)` of the last `generate` call, finished (its response
            moved to the online datastore's global index) when the next call starts.
        num_requests (`int`): `generate` calls served, the source of request ids.
    """

    def __init__(self):
        self.estimator = AcceptanceEstimator()
        self.cost_models: dict[HostKey, StepCostModel] = {}
        self.cost_model: StepCostModel | None = None
        self._online: OnlineDatastore | None = None
        self.open_request = None
        self.num_requests = 0
        self._saved: dict[HostKey, int] = {}  # observations the cache file holds, per key

    def online_datastore(self, max_bytes: int) -> OnlineDatastore:
        """The online datastore of this drafter (the sources' `resources.online_datastore`), with `max_bytes` as its
        budget; the same index across calls."""
        if self._online is None:
            self._online = OnlineDatastore(max_bytes=int(max_bytes))
        self._online.max_bytes = int(max_bytes)
        return self._online

    def new_request(self, policy):
        """Finishes the previous call's request and opens a new one; returns its id."""
        self.finish_open_request()
        self.num_requests += 1
        self.open_request = (policy, self.num_requests)
        return self.num_requests

    def finish_open_request(self) -> None:
        if self.open_request is not None:
            policy, request_id = self.open_request
            policy.finish(request_id)
            self.open_request = None
            self._save_refreshed()

    def cost_model_for(self, key: HostKey, profile, check=None) -> StepCostModel:
        """The model for `key`: the override, the one in memory, the cache file's, or `profile()`'s (then saved).
        `check()`, when given, times `(rows, seconds)` of a target step here: a cache file that predicts it off by
        more than `RESCALE_TOLERANCE` (another machine of the same CPU model) is profiled again."""
        if self.cost_model is not None:
            return self.cost_model
        if key not in self.cost_models:
            path = default_cache_path(key)
            model = StepCostModel.load(path, key)  # None when absent or measured for another host or configuration
            if model is not None and check is not None and not _agrees(model, *check(), path):
                model = None
            if model is None:
                model = profile()
                _save(model, path, key)
            self.cost_models[key] = model
            self._saved[key] = model.num_observed
        return self.cost_models[key]

    def _save_refreshed(self) -> None:
        """Writes back the models the online refresh moved, so the next process starts from them."""
        for key, model in self.cost_models.items():
            if model.num_observed != self._saved.get(key):
                _save(model, default_cache_path(key), key)
                self._saved[key] = model.num_observed


def _agrees(model: StepCostModel, rows: int, seconds: float, path) -> bool:
    ratio = seconds / max(float(model.target_seconds(rows)), 1e-12)
    if speed_agrees(ratio):
        return True
    logger.warning("step-cost file %s predicts %.2fx this host's target step of %d rows (another machine of the same "
                   "CPU model?): profiling again", path, 1.0 / ratio, rows)  # fmt: skip
    return False


def _save(model: StepCostModel, path, key: HostKey) -> None:
    try:
        model.save(path, key)
    except OSError as error:  # a read-only home: the model still works for this process
        logger.warning("could not save the step-cost profile to %s: %s", path, error)


def speculation_state(drafter) -> SpeculationState:
    """The drafter's [`SpeculationState`], created on first use (a plain attribute: not in the state dict)."""
    state = getattr(drafter, "speculation_state", None)
    if state is None:
        state = SpeculationState()
        drafter.speculation_state = state
    return state


def _config_digest(config) -> str:
    return hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:12]


def _rerouted_modules(model) -> str:
    """Modules whose `forward` was replaced on the instance (skinny GEMM routing, accelerate hooks), and a digest of
    the settings bound into those forwards (the skinny GEMM's kernel per row count, tuned on this host): they change
    what a step costs, so a profile taken without them, or with other settings, is not this model's."""
    forwards = [module.__dict__["forward"] for module in model.modules() if "forward" in module.__dict__]
    bound = sorted({repr(f.args[1:]) for f in forwards if isinstance(f, functools.partial)})
    digest = hashlib.sha256("|".join(bound).encode()).hexdigest()[:8] if bound else "-"
    return f"{len(forwards)}/{digest}"


def transformers_host_key(target, drafter) -> HostKey:
    """The cache key of a target and drafter pair on this host (eager transformers, this thread count, the same
    rerouted linears)."""
    name = getattr(target.config, "_name_or_path", "") or type(target).__name__
    target_id = f"{name}:{_config_digest(target.config)}"
    dtype = str(next(target.parameters()).dtype).replace("torch.", "")
    rerouted = f"{_rerouted_modules(target)},{_rerouted_modules(drafter)}"
    extra = f"drafter:{_config_digest(drafter.config)}:rerouted:{rerouted}"
    return host_key("transformers", target_id, dtype, torch.get_num_threads(), compiled=False, extra=extra)


def _target_step(target, target_kwargs: dict):
    """`step(rows)`: the target verifying `rows` rows after a cached context of `PROFILE_CONTEXT` tokens."""
    device = next(target.parameters()).device
    cache = DynamicCache(config=target.config)
    context = torch.full((1, PROFILE_CONTEXT), 1, dtype=torch.long, device=device)
    target(input_ids=context, cache=cache, use_cache=True)

    def target_step(rows: int) -> None:
        ids = torch.full((1, rows), 1, dtype=torch.long, device=device)
        target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=rows, **target_kwargs)
        cache.crop(-rows)  # back to the context: every row count runs on the same cache

    return target_step


@torch.no_grad()
def time_target_step(target, target_kwargs: dict, rows: int = 4, repeats: int = 5) -> tuple[int, float]:
    """`(rows, seconds)`: the median of `repeats` timed target steps of `rows` rows (one untimed first), as
    [`profile_cost_model`] times them; what a loaded cache file is checked against."""
    samples = measure(_target_step(target, target_kwargs), [rows], repeats=repeats, warmup=1)
    return rows, float(sorted(t for _, t in samples)[len(samples) // 2])


@torch.no_grad()
def profile_cost_model(target, drafter, head, target_kwargs: dict, repeats: int = 3) -> StepCostModel:
    """Profiles `t(R)` (the target verifying `R` rows after a short cached context) and `d(B)` (one drafter block and
    its draft lm head `head`) on this host.

    Args:
        target (`PreTrainedModel`): the target.
        drafter (`ReTraceDrafterModel`): the drafter.
        head (`nn.Module`): the draft lm head (`draft_head_retrace.draft_lm_head`).
        target_kwargs (`dict`): what verification adds to the target's call (`output_hidden_states`).
    """
    start = time.perf_counter()
    block_size = drafter.config.block_size
    target_step = _target_step(target, target_kwargs)

    hidden = drafter.config.hidden_size
    dtype = next(drafter.parameters()).dtype
    noise = torch.zeros(1, block_size, hidden, dtype=dtype, device=drafter.device)
    features = torch.zeros(1, 1, len(drafter.config.target_layer_ids) * hidden, dtype=dtype, device=drafter.device)
    positions = torch.arange(PROFILE_CONTEXT, PROFILE_CONTEXT + 1 + block_size, device=drafter.device)[None]

    def drafter_block(slots: int) -> None:
        out = drafter(noise_embeds=noise, context_hidden_states=features, position_ids=positions)
        head(out.last_hidden_state[:, 1:].to(head.weight.device))

    sizes = [r for r in TARGET_ROWS if r <= max(block_size, 2)]
    target_samples, drafter_samples = [], []
    for _ in range(repeats + 1):  # the first round warms up; rounds, not sizes, outside: a load spike hits all sizes
        target_samples += measure(target_step, sizes, repeats=1, warmup=0)
        drafter_samples += measure(drafter_block, [block_size], repeats=1, warmup=0)
    warm = len(sizes)
    model = StepCostModel.fit(target_samples[warm:], drafter_samples[1:])
    logger.info("profiled step costs in %.2f s: t(R) at %s = %s ms, d(%d) = %.2f ms", time.perf_counter() - start,
                sizes, [round(float(model.target_seconds(r)) * 1e3, 2) for r in sizes], block_size,
                float(model.drafter_seconds(block_size)) * 1e3)  # fmt: skip
    return model


__all__ = ["SpeculationState", "profile_cost_model", "speculation_state", "time_target_step", "transformers_host_key"]

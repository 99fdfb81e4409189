"""A start-up profile of step costs on this host: the samples a step-cost model is fitted to.

Once the engine has warmed up and allocated its KV cache (after the worker's `compile_or_warm_up_model`), times:
- the target's step at a grid of `R` verified rows: vLLM's own dummy forward of a uniform spec-decode batch
  (`R / (1 + K)` requests of `1 + K` rows, attention on), plus the logits of every row, as a verification step
  computes them;
- the drafter's block forward at a grid of `S` query slots (whole blocks of `B`), plus the logits of the `k`
  drafts a block proposes.
The context-K/V write, sampling and scheduling are not in these samples; the proposer's `StepRecord`s time the
real steps, so a model can be refreshed online. Each point is the median of a few runs after one warm-up run.
Off unless `HF_RETRACE_VLLM_PROFILE=1` until its start-up cost is measured on a quiet host (it is meant to take a
few seconds for a small model on 2 cores, then to become the default, skipped by `HF_RETRACE_VLLM_PROFILE=0`).
"""

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from . import patches


logger = init_logger(__name__)

PROFILE_ENV = "HF_RETRACE_VLLM_PROFILE"
TARGET_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
DRAFTER_BLOCKS = (1, 2, 4, 8, 16)


@dataclass
class StartupProfile:
    """Step-cost samples measured at engine start.

    Attributes:
        target (`list[tuple[int, float]]`): `(R, seconds)`: the target's forward and logits for `R` verified rows.
        drafter (`list[tuple[int, float]]`): `(S, seconds)`: the drafter's block forward of `S` query slots and the
            logits of its proposed drafts.
        seconds (`float`): the profile's own wall time.
    """

    target: list = field(default_factory=list)
    drafter: list = field(default_factory=list)
    seconds: float = 0.0


def is_enabled() -> bool:
    return os.environ.get(PROFILE_ENV, "0") != "0"


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up: first calls of a shape allocate (and, compiled, may specialise)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextmanager
def _without_drafter_dummy_run(drafter):
    """vLLM's dummy step also runs the drafter's dummy forward: left out of the target's samples."""
    drafter.dummy_run = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del drafter.dummy_run  # back to the class's method


def target_samples(runner, rows=TARGET_ROWS, repeats: int = 3) -> list[tuple[int, float]]:
    """`(R, seconds)` of the target's step for `R` rows: a uniform spec-decode dummy batch and its logits."""
    per_request = runner.uniform_decode_query_len  # 1 + K
    most = min(runner.max_num_tokens, runner.scheduler_config.max_num_seqs * per_request)
    samples = []
    with torch.inference_mode(), _without_drafter_dummy_run(runner.drafter):
        for num_rows in [r for r in rows if r <= most]:

            def step(num_rows=num_rows):
                hidden, _ = runner._dummy_run(num_rows, force_attention=True, uniform_decode=True)
                runner.model.compute_logits(hidden[:num_rows])

            samples.append((num_rows, _median_seconds(step, repeats)))
    return samples


def drafter_samples(proposer, blocks=DRAFTER_BLOCKS, repeats: int = 3) -> list[tuple[int, float]]:
    """`(S, seconds)` of the drafter's block forward of `S` slots (no attention metadata: vLLM's dummy-forward
    way, so its context attention is not in the samples) and the logits of `k` drafts a block."""
    block, drafts = proposer.policy.block_size, proposer.num_drafts_verified
    samples = []
    with torch.inference_mode():
        for num_blocks in [n for n in blocks if n * block <= proposer.max_query_tokens]:
            slots = num_blocks * block

            def forward(slots=slots, num_blocks=num_blocks):
                with set_forward_context(None, proposer.vllm_config, num_tokens=slots):
                    hidden = proposer.model(input_ids=proposer.input_ids[:slots], positions=proposer.positions[:slots])
                states = hidden.view(num_blocks, block, -1)[:, 1 : 1 + drafts]
                proposer.model.compute_logits(states.reshape(-1, states.shape[-1]))

            samples.append((slots, _median_seconds(forward, repeats)))
    return samples


def profile_step_costs(runner) -> StartupProfile:
    """Times the target and the drafter (module docstring) on `runner`, whose drafter is the hf-retrace proposer."""
    patches.check_attributes(runner, "loaded GPUModelRunner")
    start = time.perf_counter()
    profile = StartupProfile(target_samples(runner), drafter_samples(runner.drafter))
    profile.seconds = time.perf_counter() - start
    logger.info(
        "hf-retrace start-up profile (%.1f s): target %s; drafter %s", profile.seconds,
        ", ".join(f"R={r} {s * 1e3:.1f} ms" for r, s in profile.target),
        ", ".join(f"S={n} {s * 1e3:.1f} ms" for n, s in profile.drafter),
    )  # fmt: skip
    return profile


def profile_after_warm_up(worker) -> None:
    """Called after a CPU worker's `compile_or_warm_up_model`: profiles the step costs and hands them to the
    hf-retrace proposer (`startup_profile`, and its step-cost model, costs.py), unless disabled, the drafter is not
    hf-retrace's, or the proposer's cost model came from this host's cache file."""
    from .proposer import ReTraceDFlashProposer

    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    if not (is_enabled() and isinstance(drafter, ReTraceDFlashProposer)) or drafter.costs.source == "cache":
        return
    drafter.startup_profile = profile_step_costs(runner)
    drafter.costs.use_profile(drafter.startup_profile.target, drafter.startup_profile.drafter)

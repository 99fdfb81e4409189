"""A start-up profile of step costs on this host: the samples a step-cost model is fitted to.

Once the engine has warmed up and allocated its KV cache (after the worker's `compile_or_warm_up_model`), times:
- the target's step at a grid of `R` verified rows: vLLM's own dummy forward of a uniform spec-decode batch
  (`R / (1 + K)` requests of `1 + K` rows, attention on), plus the logits of every row, as a verification step
  computes them;
- the drafter's block forward at a grid of `S` query slots (whole blocks of `B`), plus the logits of the `k`
  drafts a block proposes.
The context-K/V write, sampling and scheduling are not in these samples; the proposer's `StepRecord`s time the
real steps, so the model is refreshed online.

Each size is called once untimed, then timed in `repeats` rounds that visit every size in turn: a load spike on a
shared host then slows one round of all sizes, not every sample of one size, and the median per size drops it. The
row grid is fine where a batch-1 request's verification lives (1 to 1 + K rows), since that is where the policy
weighs one more row against its acceptance.

On by default (a few seconds on 2 cores for a small target, beside minutes of vLLM start-up); skipped with
`HF_RETRACE_VLLM_PROFILE=0`, and whenever this host's cache file already holds the configuration's curves.
"""

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from vllm.forward_context import set_forward_context

from .contract import check_attributes
from .logs import get_logger


logger = get_logger(__name__)

PROFILE_ENV = "HF_RETRACE_VLLM_PROFILE"
TARGET_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
DRAFTER_BLOCKS = (1, 2, 4, 8, 16)
REPEATS = 5  # timed rounds over every size, after one untimed call each


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
    return os.environ.get(PROFILE_ENV, "1") != "0"


def interleaved_medians(runs: dict, repeats: int, clock=time.perf_counter) -> list[tuple[int, float]]:
    """`(size, median seconds)` of `runs[size]()` for every size, in `runs`' order: one untimed call each (first
    calls of a shape allocate and, compiled, may specialise), then `repeats` timed rounds over all sizes in turn."""
    for run in runs.values():
        run()
    times = {size: [] for size in runs}
    for _ in range(repeats):
        for size, run in runs.items():
            start = clock()
            run()
            times[size].append(clock() - start)
    return [(size, statistics.median(seconds)) for size, seconds in times.items()]


@contextmanager
def _without_drafter_dummy_run(drafter):
    """vLLM's dummy step also runs the drafter's dummy forward: left out of the target's samples."""
    drafter.dummy_run = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del drafter.dummy_run  # back to the class's method


def target_samples(runner, rows=TARGET_ROWS, repeats: int = REPEATS) -> list[tuple[int, float]]:
    """`(R, seconds)` of the target's step for `R` rows: a uniform spec-decode dummy batch and its logits."""
    per_request = runner.uniform_decode_query_len  # 1 + K
    most = min(runner.max_num_tokens, runner.scheduler_config.max_num_seqs * per_request)

    def step(num_rows):
        hidden, _ = runner._dummy_run(num_rows, force_attention=True, uniform_decode=True)
        runner.model.compute_logits(hidden[:num_rows])

    runs = {r: (lambda r=r: step(r)) for r in rows if r <= most}
    with torch.inference_mode(), _without_drafter_dummy_run(runner.drafter):
        return interleaved_medians(runs, repeats)


def drafter_samples(proposer, blocks=DRAFTER_BLOCKS, repeats: int = REPEATS) -> list[tuple[int, float]]:
    """`(S, seconds)` of the drafter's block forward of `S` slots (no attention metadata: vLLM's dummy-forward
    way, so its context attention is not in the samples) and the logits of `k` drafts a block."""
    block, drafts = proposer.policy.block_size, proposer.num_drafts_verified

    def forward(num_blocks):
        slots = num_blocks * block
        with set_forward_context(None, proposer.vllm_config, num_tokens=slots):
            hidden = proposer.model(input_ids=proposer.input_ids[:slots], positions=proposer.positions[:slots])
        states = hidden.view(num_blocks, block, -1)[:, 1 : 1 + drafts]
        proposer.model.greedy_top1(states.reshape(-1, states.shape[-1]))

    runs = {n * block: (lambda n=n: forward(n)) for n in blocks if n * block <= proposer.max_query_tokens}
    with torch.inference_mode():
        return interleaved_medians(runs, repeats)


def profile_step_costs(runner) -> StartupProfile:
    """Times the target and the drafter (module docstring) on `runner`, whose drafter is the hf-retrace proposer."""
    check_attributes(runner, "loaded GPUModelRunner")
    start = time.perf_counter()
    profile = StartupProfile(target_samples(runner), drafter_samples(runner.drafter))
    profile.seconds = time.perf_counter() - start
    logger.info(
        "hf-retrace start-up profile (%.1f s): target %s; drafter %s", profile.seconds,
        ", ".join(f"R={r} {s * 1e3:.1f} ms" for r, s in profile.target),
        ", ".join(f"S={n} {s * 1e3:.1f} ms" for n, s in profile.drafter),
    )  # fmt: skip
    return profile

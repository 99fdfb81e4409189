"""Where this plugin patches vLLM. What it relies on there is listed and checked in contract.py: `install()` first
checks that every hook point exists with the expected signature (`contract.check`), which raises
`UnsupportedVllmError` naming the supported version otherwise. Idempotent: a second `install()` (vLLM loads general
plugins in every process, sometimes twice) changes nothing.

Hook points (vLLM 0.32.0):
1. `GPUModelRunner.__init__` (the CPU runner inherits it): after it builds vLLM's `DFlashProposer`, a drafter folder
   whose config has an `hf_retrace` block gets `ReTraceDFlashProposer` (a subclass) instead. Plain DFlash folders
   keep vLLM's proposer untouched.
2. `VllmConfig.num_lookahead_tokens` (KV slots the scheduler reserves past the verified tokens): DFlash reserves
   `1 + K` there, the hf-retrace drafter writes K/V for its whole block, so for its folders it is `block_size`.
3. Read, not patched: `DFlashProposer.set_inputs_first_pass`, `build_model_inputs_first_pass`,
   `build_per_group_and_layer_attn_metadata`, `_determine_batch_execution_and_padding`, `_get_slot_mapping`,
   `SpecDecodeBaseProposer.propose`'s arguments, and `DFlashQwen3ForCausalLM`'s methods, which the proposer and the
   model build on; the attributes in `contract.PRIVATE_ATTRIBUTES` and `contract.ASSIGNED`, read on vLLM's objects
   at run time.
4. `CPUWorker.compile_or_warm_up_model`: after vLLM's warm-up, an hf-retrace proposer gets its start-up profile of
   step costs (profile.py; skipped with `HF_RETRACE_VLLM_PROFILE=0`).
5. `Scheduler.schedule` and `GPUModelRunner.execute_model`: each `SchedulerOutput` carries the prompt rows of the
   waiting requests the next step may admit, and an hf-retrace proposer gets them before the step runs
   (scheduler_queue.py). Read-only: the schedule and the step are unchanged.
6. `SpeculativeConfig.use_eagle_block_drop`: for EAGLE-like drafters vLLM drops the last block of every prefix-cache
   hit, so that its prompt rows are computed again and the drafter gets their target states. An hf-retrace drafter
   reads its context from its own K/V cache, which the proposer fills from the target's states of every row the
   target computes (context_kv.py) and writes before any drafter forward reads it, so its folders keep the whole
   hit, as vLLM without speculation does. On CPU a block is 128 tokens: a prompt that repeats a cached prefix of
   fewer than 256 tokens otherwise reuses none of it.
"""

import functools
import inspect

from . import sampler_patch, scheduler_queue
from .contract import MARK, check


def is_hf_retrace_config(vllm_config) -> bool:
    """Whether the speculative config loads an hf-retrace export (a DFlash folder with an `hf_retrace` block)."""
    return is_hf_retrace_speculation(getattr(vllm_config, "speculative_config", None))


def is_hf_retrace_speculation(spec) -> bool:
    """Whether a `SpeculativeConfig` (or `None`) loads an hf-retrace export."""
    if spec is None or spec.method != "dflash" or getattr(spec, "draft_model_config", None) is None:
        return False
    return isinstance(getattr(spec.draft_model_config.hf_config, "hf_retrace", None), dict)


def install() -> None:
    """Checks the hook points, then patches them (once)."""
    check()
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.__init__, MARK, False):
        GPUModelRunner.__init__ = _mark(_wrap_runner_init(GPUModelRunner.__init__))
    lookahead = inspect.getattr_static(VllmConfig, "num_lookahead_tokens")
    if not getattr(lookahead.fget, MARK, False):
        VllmConfig.num_lookahead_tokens = property(_mark(_wrap_lookahead(lookahead.fget)), doc=lookahead.__doc__)
    if not getattr(SpeculativeConfig.use_eagle_block_drop, MARK, False):
        SpeculativeConfig.use_eagle_block_drop = _mark(_wrap_block_drop(SpeculativeConfig.use_eagle_block_drop))
    sampler_patch.install()
    _install_startup_profile()
    _install_scheduler_queue()


def _install_startup_profile() -> None:
    """`CPUWorker.compile_or_warm_up_model`: once vLLM has warmed up, the step-cost profile (profile.py)."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUWorker.compile_or_warm_up_model, MARK, False):
        return
    original = CPUWorker.compile_or_warm_up_model

    @functools.wraps(original)
    def compile_or_warm_up_model(self):
        times = original(self)
        profile_after_warm_up(self)
        return times

    CPUWorker.compile_or_warm_up_model = _mark(compile_or_warm_up_model)


def _install_scheduler_queue() -> None:
    """`Scheduler.schedule` counts the waiting prompt rows into its output; `GPUModelRunner.execute_model` hands them
    to an hf-retrace proposer (scheduler_queue.py)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(Scheduler.schedule, MARK, False):
        schedule = Scheduler.schedule

        @functools.wraps(schedule)
        def counting_schedule(self, *args, **kwargs):
            output = schedule(self, *args, **kwargs)
            scheduler_queue.record(self, output)
            return output

        Scheduler.schedule = _mark(counting_schedule)
    if not getattr(GPUModelRunner.execute_model, MARK, False):
        execute_model = GPUModelRunner.execute_model

        @functools.wraps(execute_model)
        def handing_execute_model(self, scheduler_output, *args, **kwargs):
            scheduler_queue.hand_over(self, scheduler_output)
            return execute_model(self, scheduler_output, *args, **kwargs)

        GPUModelRunner.execute_model = _mark(handing_execute_model)


def _mark(func):
    setattr(func, MARK, True)
    return func


def _wrap_runner_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        if getattr(self, "drafter", None) is not None and is_hf_retrace_config(vllm_config):
            from .proposer import ReTraceDFlashProposer

            self.drafter = ReTraceDFlashProposer(vllm_config, self.device, self)

    return __init__


def _wrap_lookahead(original):
    @functools.wraps(original)
    def num_lookahead_tokens(self) -> int:
        tokens = original(self)
        if is_hf_retrace_config(self):
            tokens = max(tokens, int(self.speculative_config.draft_model_config.hf_config.block_size))
        return tokens

    return num_lookahead_tokens


def _wrap_block_drop(original):
    @functools.wraps(original)
    def use_eagle_block_drop(self) -> bool:
        return False if is_hf_retrace_speculation(self) else original(self)  # hook point 6 (module docstring)

    return use_eagle_block_drop


def profile_after_warm_up(worker) -> None:
    """Called after a CPU worker's `compile_or_warm_up_model`: profiles the step costs and hands them to the
    hf-retrace proposer (`startup_profile`, and its step-cost model, costs.py), unless disabled, the drafter is not
    hf-retrace's, or the proposer's cost model came from this host's cache file."""
    from . import profile  # torch and vLLM's forward context: imported in the worker only
    from .proposer import ReTraceDFlashProposer

    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    if not (profile.is_enabled() and isinstance(drafter, ReTraceDFlashProposer)) or drafter.costs.source == "cache":
        return
    drafter.startup_profile = profile.profile_step_costs(runner)
    drafter.costs.use_profile(drafter.startup_profile.target, drafter.startup_profile.drafter)

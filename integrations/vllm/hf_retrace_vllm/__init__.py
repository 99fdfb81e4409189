"""vLLM plugin for hf-retrace drafters (registered through the `vllm.general_plugins` entry point)."""


def register() -> None:
    """Called by vLLM in every process at start-up."""

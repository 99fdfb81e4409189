"""Exports of a drafter folder for other inference engines: `vllm` (`hf-retrace export --format vllm`)."""

from .vllm import export_for_vllm, vllm_config, vllm_state_dict


__all__ = ["export_for_vllm", "vllm_config", "vllm_state_dict"]

"""The plugin's log lines go where vLLM's go (its handler, format and level), INFO included."""

import logging

import vllm.logger  # noqa: F401  (configures the `vllm` logger, as in an engine's process)

from hf_retrace_vllm import costs, profile, proposer


def test_plugin_lines_reach_vllms_handler():
    vllm_logger = logging.getLogger("vllm")
    level = max(logging.INFO, vllm_logger.getEffectiveLevel())  # INFO unless VLLM_LOGGING_LEVEL is higher
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    vllm_logger.addHandler(handler)
    try:
        for module in (costs, profile, proposer):
            module.logger.log(level, "line from %s", module.__name__)
    finally:
        vllm_logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == [
        f"line from {module.__name__}" for module in (costs, profile, proposer)
    ]

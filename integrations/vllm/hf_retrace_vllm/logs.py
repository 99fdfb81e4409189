"""The plugin's loggers, named under `vllm.` so that vLLM's own logging configuration covers them.

vLLM configures one logger, `vllm` (its handler, its line format, `VLLM_LOGGING_LEVEL`), and does not propagate it
further. A logger outside that name has no handler of its own, so Python's last-resort handler prints its warnings
bare and drops its INFO lines: the start-up profile's step costs and the proposer's counters never showed in the
engine's log. Under `vllm.` they are printed like vLLM's own lines, with the file and line that logged them.
vLLM-free (the main suite imports the modules that log).
"""

import logging


def get_logger(module_name: str) -> logging.Logger:
    """The logger of the plugin module `module_name` (pass `__name__`): `vllm.<module_name>`."""
    return logging.getLogger(f"vllm.{module_name}")


__all__ = ["get_logger"]

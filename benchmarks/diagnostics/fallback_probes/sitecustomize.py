"""Diagnostic, not a product path: the vLLM plugin's load fallback (hf_retrace_vllm/fallback.py) probes plain steps
every 8 plans at every load, 4 plans a probe, and never changes its arm, so one engine samples both arms' seconds per
committed token in turns, minutes apart: a shared host's drift between engines, which can reach 25-45% per step on a
2-core host, cancels. Read the step log with `step_log_table.py --arms`. See README.md."""

import os


if os.environ.get("HF_RETRACE_DIAGNOSTIC") == "fallback_probes":
    try:
        from hf_retrace_vllm import fallback
    except ImportError:  # a process without the plugin (the bench's driver): nothing to patch
        fallback = None
    if fallback is not None:
        init = fallback.LoadFallback.__init__

        def __init__(self, *args, **kwargs):
            init(self, first_interval=8, max_interval=8, probe_steps=4, min_samples=2)

        def _decide(self, key):  # the probe's samples are kept, the arm stays "speculate"
            self._load(key).since_probe = 0

        fallback.LoadFallback.__init__ = __init__
        fallback.LoadFallback._decide = _decide

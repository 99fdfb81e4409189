"""Diagnostic, not a product path: the hf-retrace vLLM plugin's policy plans nothing (no lookups, no drafter, no
verified token), so an engine with the plugin runs its machinery alone (the target's auxiliary states, the proposer's
bookkeeping, the drafter's context K/V): the floor any decision of the policy starts from. See README.md."""

import os


if os.environ.get("HF_RETRACE_DIAGNOSTIC") == "nothing_verified":
    # the load fallback weighs each plan's predicted gain, which these plans do not carry: nothing is planned anyway
    os.environ["HF_RETRACE_VLLM_LOAD_FALLBACK"] = "0"
    try:
        from hf_retrace_vllm.shared import speculation_retrace
    except ImportError:  # a process without the plugin (the bench's driver): nothing to patch
        speculation_retrace = None
    if speculation_retrace is not None:

        def plan(self, requests, prefill_rows: int = 0):
            return speculation_retrace.SpeculationPlan({request[0]: ("none",) for request in requests})

        speculation_retrace.SpeculationPolicy.plan = plan

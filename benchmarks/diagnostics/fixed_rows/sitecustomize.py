"""Diagnostic, not a product path: the hf-retrace vLLM plugin's policy verifies a fixed pattern of rows, step by step
through `PATTERNS`: `(m, v)`, the first `m` requests of the batch propose `v` tokens each (their last token repeated;
what verification accepts does not matter here). With the step log on, the engine's time of a step can then be read
against its requests and verified rows at one load, apart from what the policy would choose. See README.md."""

import os


PATTERNS = [(0, 0), (32, 1), (8, 1), (8, 4), (32, 2), (4, 8), (16, 4), (2, 1), (16, 1), (1, 8)]

if os.environ.get("HF_RETRACE_DIAGNOSTIC") == "fixed_rows":
    try:
        from hf_retrace_vllm.shared import speculation_retrace
    except ImportError:  # a process without the plugin (the bench's driver): nothing to patch
        speculation_retrace = None
    if speculation_retrace is not None:
        steps = [0]

        def plan(self, requests, prefill_rows: int = 0):
            m, v = PATTERNS[steps[0] % len(PATTERNS)]
            steps[0] += 1
            actions = {}
            for i, (request_id, tokens, max_tokens) in enumerate(requests):
                k = min(v, int(max_tokens)) if i < m else 0
                actions[request_id] = ("lookup", [int(tokens[-1])] * k, "prompt_lookup") if k > 0 else ("none",)
            return speculation_retrace.SpeculationPlan(actions)

        speculation_retrace.SpeculationPolicy.plan = plan

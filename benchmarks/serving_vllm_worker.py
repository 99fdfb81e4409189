"""One vLLM engine, driven by `benchmarks/serving.py` over JSON lines (runs in `.venv-vllm`; never imports hf_retrace).

    .venv-vllm/bin/python benchmarks/serving_vllm_worker.py --target DIR [--speculative-config JSON] [--compile]
        [--max-num-seqs C]

Protocol: after the engine is up, the worker writes `{"ready": true, "preloaded": {...}, ...}` (`preloaded`: whether
tcmalloc and Intel OpenMP are mapped in this process, i.e. whether `LD_PRELOAD` took); then, for each request line
on stdin, one reply line on stdout:

    {"cmd": "generate", "prompts": [[id, ...], ...], "max_new_tokens": 64, "sampling": null, "cache_salt": null}
      -> {"outputs": [{"token_ids": [...], "cycles": [n, ...], "first_token_s": s, "finish_s": s}, ...],
          "seconds": s, "counters": {...}, "peaks": {...}}
    {"cmd": "quit"} -> {"bye": true}, then exit

`cache_salt` (optional): a string that keeps the call's prompts from reusing the prefix cache of earlier calls (the
bench's prefill-only pass re-reads the prompts it just timed). `sampling`: null for greedy, or `{"temperature": t,
"seeds": [one per prompt]}` (plain temperature sampling: no top-k, no top-p; each request seeded, so a rerun draws
the same).

All prompts of one `generate` are submitted at once and stepped to completion: all of them run together, or with
`--max-num-seqs C` C at a time, the rest queued (vLLM starts a queued request when a running one finishes).
`first_token_s` and `finish_s` are the seconds from submission to the request's first token (its time to first
token, the prefill) and to its last; what lies between is its decode (time per output token: `(finish_s -
first_token_s) / (tokens - 1)`). `cycles` are the tokens each engine step committed for that request (bonus
included), read from per-step output deltas, after the prefill step's first token: the exact per-cycle record
`hf-retrace bench` keeps for its drafters,
with no truncation at `max_new_tokens` guessed. `counters` are deltas over the call: vLLM's own spec-decode counters
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`; zero without speculation), the
engine's steps and the wall time spent in them (`engine_steps`, `engine_step_s`), and, with the hf-retrace plugin's
proposer (from the file `HF_RETRACE_VLLM_STATS` names): its cycles and committed tokens by source
(`proposer_cycles_draft`, ...), its steps and the seconds of each timed part (`proposer_steps`,
`proposer_s_<part>`). `peaks` are gauges read after the call (`online_datastore_bytes`, the proposer's peak).
Everything vLLM prints goes to stderr: stdout carries only replies.
"""

import argparse
import json
import os
import sys
import time


COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def read_counters(engine) -> dict:
    """Spec-decode counters summed over engines (all zero when the engine does not speculate)."""
    values = dict.fromkeys(COUNTERS.values(), 0)
    for metric in engine.get_metrics():
        name = COUNTERS.get(metric.name) or COUNTERS.get(metric.name.removesuffix("_total"))
        if name is not None:
            values[name] += int(metric.value)
    return values


PROPOSER_STATS_ENV = "HF_RETRACE_VLLM_STATS"  # the hf-retrace plugin's proposer writes its counters there (JSON)


def read_proposer_stats() -> tuple[dict, dict]:
    """The hf-retrace proposer's counters, flat, and its gauges; both empty without the plugin's proposer.

    Counters: cycles and committed tokens by source (`lookup`, `datastore`, `online_datastore`, `draft`) as
    `proposer_cycles_draft`, ...;
    when the proposer times its parts (stats fields `steps` and `timings`, name -> seconds in total),
    `proposer_steps` and `proposer_s_<name>`; under the goodput policy its predictions beside the measured steps
    (stats field `prediction`) as `proposer_pred_<field>`. Gauges: `online_datastore_bytes` (peak) when written.
    """
    path = os.environ.get(PROPOSER_STATS_ENV)
    if not path or not os.path.isfile(path):
        return {}, {}
    with open(path) as f:
        stats = json.load(f)
    flat = {f"proposer_{kind}_{source}": n for kind in ("cycles", "committed") for source, n in stats[kind].items()}
    if "steps" in stats:
        flat["proposer_steps"] = stats["steps"]
    flat |= {f"proposer_s_{name}": seconds for name, seconds in (stats.get("timings") or {}).items()}
    flat |= {f"proposer_pred_{name}": value for name, value in (stats.get("prediction") or {}).items()}
    peak = stats.get("online_datastore_bytes")
    gauges = {} if peak is None else {"online_datastore_bytes": peak}
    return flat, gauges


def preloaded() -> dict:
    """Whether tcmalloc and Intel OpenMP are mapped into this process (vLLM's CPU guide wants both preloaded)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return {"tcmalloc": "libtcmalloc" in maps, "iomp5": "libiomp5" in maps}


def sampling_params(prompts: list, max_new_tokens: int, sampling: dict | None) -> list:
    """One `SamplingParams` per prompt: greedy, or temperature sampling seeded per request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    delta = RequestOutputKind.DELTA
    if sampling is None:
        return [SamplingParams(temperature=0.0, max_tokens=max_new_tokens, output_kind=delta)] * len(prompts)
    return [
        SamplingParams(temperature=sampling["temperature"], top_p=1.0, top_k=0, seed=seed, max_tokens=max_new_tokens,
                       output_kind=delta)  # fmt: skip
        for seed in sampling["seeds"]
    ]


def generate(engine, prompts: list[list[int]], max_new_tokens: int, sampling: dict | None = None,
             cache_salt: str | None = None) -> dict:
    """Submits every prompt at once, steps the engine until all finish; `max_new_tokens` at most each. `cache_salt`
    keeps vLLM's prefix cache from reusing blocks of calls without it (or with another salt)."""
    params = sampling_params(prompts, max_new_tokens, sampling)
    before = read_counters(engine) | read_proposer_stats()[0]
    start = time.perf_counter()
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]  # outputs carry these (add_request's return
    steps = {rid: [] for rid in ids}  # value is vLLM's internal id)
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, {"prompt_token_ids": prompt} | ({"cache_salt": cache_salt} if cache_salt else {}), p)
    engine_steps, step_seconds, first, last = 0, 0.0, {}, {}
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_end = time.perf_counter()
        step_seconds += step_end - step_start
        engine_steps += 1
        for output in outputs:
            new = len(output.outputs[0].token_ids)
            if new:  # a chunked-prefill step commits nothing
                steps[output.request_id].append((new, output.outputs[0].token_ids))
                first.setdefault(output.request_id, step_end - start)
                last[output.request_id] = step_end - start
    seconds = time.perf_counter() - start
    proposer, gauges = read_proposer_stats()
    after = read_counters(engine) | proposer
    counters = {k: v - before.get(k, 0) for k, v in after.items()}
    counters |= {"engine_steps": engine_steps, "engine_step_s": step_seconds}
    outputs = []
    for rid in ids:
        tokens = [t for _, delta in steps[rid] for t in delta]
        outputs.append({"token_ids": tokens, "cycles": [n for n, _ in steps[rid][1:]],  # [0]: the prefill's token
                        "first_token_s": first.get(rid), "finish_s": last.get(rid)})  # fmt: skip
    return {"outputs": outputs, "seconds": seconds, "counters": counters, "peaks": gauges}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a save_pretrained folder vLLM can load")
    parser.add_argument("--speculative-config", default=None, help="JSON for vLLM's speculative_config")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--compile", action="store_true", help="vLLM's default compiled mode (else enforce_eager)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="requests the engine runs at once; the "
                        "rest wait in its queue (default: vLLM's)")  # fmt: skip
    args = parser.parse_args()

    reply_fd = os.dup(1)  # replies go here; vLLM's prints (and its engine process's) go to stderr
    os.dup2(2, 1)
    replies = os.fdopen(reply_fd, "w", buffering=1)

    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=args.target,
        dtype="float32",
        enforce_eager=not args.compile,
        max_model_len=args.max_model_len,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
        disable_log_stats=False,  # the spec-decode counters need stats
        seed=0,
        **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}),
    )
    import vllm

    engine = llm.llm_engine
    ready = {"ready": True, "startup_s": time.perf_counter() - start, "vllm": vllm.__version__,
             "preloaded": preloaded(), "compiled": args.compile}  # fmt: skip
    replies.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request["cmd"] == "quit":
            replies.write(json.dumps({"bye": True}) + "\n")
            break
        if request["cmd"] != "generate":
            replies.write(json.dumps({"error": f"unknown cmd {request['cmd']!r}; expected generate or quit"}) + "\n")
            continue
        reply = generate(engine, request["prompts"], request["max_new_tokens"], request.get("sampling"),
                         request.get("cache_salt"))
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()

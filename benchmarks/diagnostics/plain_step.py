"""What a decode step costs with the hf-retrace plugin when it proposes nothing, beside vLLM alone's step.

At a load where plain steps win, the plugin's load fallback runs plain: nothing is looked up, planned or verified. Such
a step still carries what an engine with a speculative config does every step (the target's auxiliary states, the
proposer's bookkeeping, the drafter's context K/V, vLLM's spec-decode path). This times it: `N` requests of `P`
random prompt tokens each, all running, stepped one engine step at a time once every prompt is in (decode steps only),
with the plugin's fallback held on its plain arm (`--drafter`) or without a drafter (vLLM alone). Run each engine in
its own process, alternated, the engine in this process:

    scripts/vllm-env.sh .venv-vllm/bin/python benchmarks/diagnostics/plain_step.py [--drafter EXPORTED_FOLDER] \\
        [--requests 32] [--prompt-tokens 256] [--steps 48] [--profile 25]

Prints the median and mean ms of the timed decode steps; `--profile K` runs them under `cProfile` as well and prints
its K costliest functions by cumulative time (the profiler's overhead inflates Python-heavy parts: compare the two
engines' listings with each other, not with the untimed medians).
"""

import argparse
import cProfile
import os
import pstats
import statistics
import time


def force_plain() -> None:
    """Holds the plugin's load fallback on its plain arm: every step proposes nothing."""
    from hf_retrace_vllm import fallback

    fallback.LoadFallback.choose = lambda self, num_requests, request_ids=None: fallback.PLAIN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.expanduser("~/.cache/hf_retrace/smollm2-135m-instruct"))
    parser.add_argument("--drafter", default=None, help="an `hf-retrace export --format vllm` folder")
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed, after 4 untimed ones")
    parser.add_argument("--profile", type=int, default=0, help="print the K costliest functions (cProfile)")
    parser.add_argument("--profile-match", default=None, help="only functions whose file:line(name) matches this")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and worker in this process
    import numpy as np
    from vllm import LLM, SamplingParams

    spec = None
    if args.drafter:
        force_plain()
        spec = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(model=args.target, dtype="float32", max_model_len=2048, speculative_config=spec, seed=0,
              max_num_seqs=args.requests, enable_prefix_caching=False)  # fmt: skip
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    vocab = engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(args.requests):
        ids = rng.integers(100, vocab - 100, args.prompt_tokens).tolist()
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    started = set()
    while len(started) < args.requests:  # the prefill steps, untimed
        started.update(out.request_id for out in engine.step() if out.outputs and out.outputs[0].token_ids)
    for _ in range(4):
        engine.step()
    times, profiler = [], cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        times.append(time.perf_counter() - start)
    label = "plugin, plain arm" if args.drafter else "vLLM alone"
    print(f"{label}: {args.requests} requests decoding, {args.prompt_tokens} prompt tokens each, {args.steps} steps: "
          f"median {1000 * statistics.median(times):.2f} ms, mean {1000 * statistics.fmean(times):.2f} ms a step")
    if profiler is not None:
        restrictions = [args.profile_match] if args.profile_match else []
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(*restrictions, args.profile)


if __name__ == "__main__":
    main()

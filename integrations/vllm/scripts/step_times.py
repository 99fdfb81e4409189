"""Target and drafter forward times of the hf-retrace plugin in vLLM, compiled (vLLM's default) against eager, with
and without the CPU preloads of scripts/vllm-env.sh (tcmalloc, Intel OpenMP).

    .venv-vllm/bin/python integrations/vllm/scripts/step_times.py --drafter EXPORTED_DIR [--configs compiled,eager]

Each config is one fresh engine in its own process (`LD_PRELOAD` only acts at exec), on a fresh compile cache unless
`--cache-root` names one. It generates greedily for 1 request, then for 8 at once, and times every forward of the
target (`[tokens]`: batch x verified rows) and of the drafter (`[rows]`: 16 slots a drafting request) inside the
worker. Printed: the median milliseconds by rows, per config; `--json` writes them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[3]
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table handles collisions, with an example in Python.",
    "List ten countries in Europe and their capitals.",
    "Question: A train travels 60 km in 45 minutes. What is its speed in km/h?\nAnswer:",
    "Describe the water cycle for a ten-year-old.",
    "def merge_sort(items):\n",
    "Summarize the causes of the French Revolution in five bullet points.",
    "Translate to French: The weather is nice today and we are going to the beach.",
]


def install_timers(worker) -> None:
    """Runs in the worker: wraps the target's and the drafter's `forward` with a timer keyed by input rows."""
    runner = worker.model_runner
    runner._step_times = {"target": {}, "drafter": {}}

    def timed(name, forward):
        def wrapper(input_ids=None, positions=None, *args, **kwargs):
            start = time.perf_counter()
            out = forward(input_ids, positions, *args, **kwargs)
            rows = int(positions.shape[-1])
            runner._step_times[name].setdefault(rows, []).append(time.perf_counter() - start)
            return out

        return wrapper

    runner.model.forward = timed("target", runner.model.forward)
    runner.drafter.model.forward = timed("drafter", runner.drafter.model.forward)


def read_timers(worker) -> dict:
    runner = worker.model_runner
    times, runner._step_times = runner._step_times, {"target": {}, "drafter": {}}
    return times


def child(args) -> None:
    """One engine: warm up, then time 1 request and 8 at once."""
    from statistics import median

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.target, dtype="float32", max_model_len=1024, max_num_seqs=8, seed=0,
              enforce_eager=args.mode == "eager",
              speculative_config={"method": "dflash", "model": args.drafter, "num_speculative_tokens": 3})  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)  # warm-up: first calls of each shape
    llm.collective_rpc(install_timers)
    result = {}
    for batch in (1, 8):
        llm.generate(PROMPTS[:batch], params, use_tqdm=False)
        times = llm.collective_rpc(read_timers)[0]
        result[f"batch{batch}"] = {
            part: {rows: [round(1000 * median(t), 2), len(t)] for rows, t in sorted(by_rows.items()) if len(t) >= 3}
            for part, by_rows in times.items()
        }  # fmt: skip
    print("STEP_TIMES " + json.dumps(result), flush=True)


def run_config(args, mode: str, preload: bool) -> dict:
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc sends the timer functions
    env.pop("LD_PRELOAD", None)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if os.cpu_count() >= 2 else "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["VLLM_CACHE_ROOT"] = args.cache_root or tempfile.mkdtemp(prefix="vllm-cache-")
    command = [sys.executable, __file__, "--child", mode, "--target", args.target, "--drafter", args.drafter,
               "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
    if preload:
        command = [str(REPO / "scripts" / "vllm-env.sh"), *command]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("STEP_TIMES ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{mode} (preload {preload}) failed:\n{(done.stdout + done.stderr)[-3000:]}")
    result = json.loads(lines[-1].removeprefix("STEP_TIMES "))
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["openmp_warning"] = "without Intel OpenMP in LD_PRELOAD" in done.stdout + done.stderr
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.expanduser("~/.cache/hf_retrace/smollm2-135m-instruct"))
    parser.add_argument("--drafter", required=True, help="an `hf-retrace export --format vllm` folder")
    parser.add_argument("--configs", default="compiled,eager", help="comma list of compiled, eager")
    parser.add_argument("--preloads", default="on,off", help="comma list of on, off")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--cache-root", help="VLLM_CACHE_ROOT for every config (default: a fresh one each)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=("compiled", "eager"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        child(args)
        return
    results = {}
    for mode in args.configs.split(","):
        for preload in args.preloads.split(","):
            name = f"{mode}, preloads {preload}"
            results[name] = run_config(args, mode, preload == "on")
            print(name, json.dumps(results[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

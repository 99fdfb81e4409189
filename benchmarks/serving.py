"""Serving bench: transformers and vLLM, target alone and speculative, greedy and sampled, from batch 1 to 32
concurrent requests, in one interleaved run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --output-dir runs/serving              # the full bench
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --quick --output-dir runs/serving-dev  # a few minutes
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --modes compiled,eager --resume ...     # eager beside

The full bench prints its estimated wall time at start (about 40 minutes on a quiet 2-core CPU: 30 vLLM engine
start-ups in compiled mode, ~1,000 requests of 64 new tokens); `--quick` (2 prompts a set, concurrency 1 and 4,
32 new tokens, compiled only) takes under ten.

Methods (`--methods`, comma separated; default all):

    hf_ar                 transformers, target alone
    hf_drafter[=CARD]     transformers + the drafter CARD with its own policy (default model_cards/smollm2-135m-dflash)
    vllm_ar               vLLM, target alone
    vllm_suffix[=K]       vLLM `suffix` decoding: vLLM's defaults (up to 24 tokens), or K tokens (named vllm_suffixK)
    vllm_ngram[=K]        vLLM `ngram` (prompt lookup, n-grams 3..2, K drafts; default 3; named vllm_ngramK with =K)
    vllm_dflash[=CARD]    vLLM `dflash` with the hf-retrace plugin, CARD exported by `hf-retrace export --format vllm`
    vllm_retrace[=CARD]   the same for the ReTrace card (default model_cards/smollm2-135m-retrace)

The drafter methods take decoding settings after the card, written into a copy of its generation_config.json:
`vllm_retrace:speculation_policy=fixed` (named `vllm_retrace_fixed`), `hf_drafter=CARD:online_datastore_num_tokens=8`.

Every method needs its engine's target-alone method (`hf_ar`, `vllm_ar`), added when missing: greedy outputs are
checked against it token for token (same engine, mode and concurrency, per prompt), and speedups are over it. A
method whose pieces are missing (the export, the plugin, a worker that fails to start) is skipped with a line why.

vLLM runs as its users run it: `--modes compiled` (vLLM's default, torch.compile; the default here)
and/or `eager` (enforce_eager), with tcmalloc and Intel OpenMP in `LD_PRELOAD`: read from `scripts/vllm-env.sh` when
it exists, else found on the machine (`serving_engines.vllm_preload_env`). Each worker reports whether both were
really mapped; the run info records it, and a loud warning goes to stderr and results.md when they were not.

Prompts: two groups, reported apart. `pool_eval`: the eval splits of the pool's families that `hf-retrace bench`
reads (gsm_symbolic, humaneval, open_ended); `unseen`: families no training pool used (codeio, knights_knaves); all
at evaluation seeds from 10000 (`hf_retrace.data.prompts`), chat template applied once, the same token ids to both
engines. At concurrency C each group holds max(`--num-prompts-per-set` a set, `--prompt-factor` x C) distinct
prompts (so the engine is full at least twice over). `--schedule queue` (the default, as a server under steady load
and as `vllm bench serve --max-concurrency C` runs): each group's prompts are submitted together to an engine that
runs C of them at a time (`max_num_seqs = C`), a queued request starting as soon as a running one finishes.
`--schedule batches`: closed batches of C prompts of one group, each stepped until its last request finishes; a
batch then lasts as long as its slowest request, and steps near its end run part-empty. The sampled passes read
further prompts of the same sets, disjoint from every greedy one.

Measurement. A block is one method in one mode at one concurrency (and round): a fresh vLLM engine in its own worker
process (`serving_vllm_worker.py` in `.venv-vllm`, fp32, `VLLM_CPU_OMP_THREADS_BIND=0-1`), warmed up on token ids of
no benched prompt (start-up and warmup untimed), then the greedy pass, then (at `--sampled-concurrency`) the sampled
pass at `--temperature` (plain temperature sampling, seeded per request), then the engine ends: one engine alive at a
time, and `suffix`, whose tree keeps every response, never meets at one concurrency the answers of another.
transformers (in this process, 2 torch threads, skinny GEMM) is batch 1 only. The methods' order rotates by one per
concurrency and round, so slow drift of a shared machine lands on all alike (where two blocks of one comparison
still meet hosts of different speeds, `serving_paired.py` runs two vLLM methods at once, one core each). Sampled
continuations are scored by the target in transformers (`serving_engines.continuation_nll`): the NLL/token column,
which an exact sampler keeps equal to the target alone's within noise.

tau is pooled over cycles (committed tokens, bonus included, over all verification cycles of all prompts, prefill
not counted); vLLM: the tokens each engine step commits per request. `tau_drafted`: vLLM's own counters
(1 + accepted / drafts). Step timing: the engine's wall time per `step()`, and the plugin proposer's own timers per
part (`hf_retrace_vllm/stats.py` fields `steps`, `timings`) with its online datastore's peak bytes when written.
Prefill and decode apart (vLLM): per request, the time to its first token (TTFT: the prefill, and any queueing) and
the time per output token after it (TPOT); the decode's speedup is the target alone's TPOT over the method's. With
64 new tokens after long prompts (codeio's ~950 tokens) the prefill, which speculation leaves as it is, is a large
share of the end-to-end time, and the end-to-end speedup stays under the decode's.

Outputs in `--output-dir`, rewritten after every block: `results.json` (run info, rows, failures, per-batch records
without token ids), `results.md`, `tokens_per_s.png`, and `batches.json` (token ids and the blocks done: `--resume`
skips those, and refuses a store measured with other settings). Exit code 1 when any greedy output differs from its
engine's target alone.
"""

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from hf_retrace.data.assets import default_target_cache_dir, ensure_default_target
from serving_engines import (
    HfEngine, VllmWorker, card_with_settings, export_card, plugin_available, vllm_available, vllm_preload_env,
)  # fmt: skip
from serving_methods import (
    ALL_METHODS, GROUPS, PromptPlan, chunk_rounds, concurrent_batches, encode_prompts, parse_concurrency, too_long,
    parse_methods, parse_modes, rotated,
)  # fmt: skip
from serving_records import GREEDY, SAMPLED, Batch, block_key, check_lossless, load_store, save_store, summarize
from serving_report import PLOT, plot, preload_warning, render_markdown, write_outputs


# the default target's cache folder (`$HF_RETRACE_CACHE` or `~/.cache/hf_retrace`), made on first use
DEFAULT_TARGET = default_target_cache_dir()
# untimed warmup request: token ids of no benched prompt, so a method that learns from past requests (vLLM's suffix
# decoding adds every prompt and response to its tree) learns nothing about the prompts it is then timed on
WARMUP_TOKEN_IDS = list(range(1000, 1032))
# for the start-up estimate only, on a quiet 2-core host: an engine's start-up in s (eager measured ~20; compiled
# guessed, most starts reuse the compile cache), the target's step in ms (compiled: 19.2 for 1 row + 2.8 a further
# row, measured; eager guessed), transformers' tokens/s at batch 1
STARTUP_S = {"compiled": 30.0, "eager": 20.0}
SCHEDULES = ("queue", "batches")  # how a group's prompts reach an engine at concurrency C (`--schedule`)
STEP_MS = {"compiled": (19.2, 2.8), "eager": (25.0, 2.8)}
HF_TOKENS_PER_S = 25.0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--methods", default=ALL_METHODS, help=f"comma separated (default: {ALL_METHODS})")
    parser.add_argument("--modes", default="compiled", help="vLLM modes: compiled (vLLM's default), eager, or both")
    parser.add_argument("--concurrency", default="1,4,8,16,32", help="vLLM requests running at once; transformers: "
                        "1 only")  # fmt: skip
    parser.add_argument("--schedule", choices=SCHEDULES, default="queue", help="queue: a group's prompts submitted "
                        "together, C running (max_num_seqs), a queued one starting when one finishes; batches: closed "
                        "batches of C, each run to its last request")  # fmt: skip
    parser.add_argument("--sampled-concurrency", default="1,8", help="concurrencies that also run a sampled pass "
                        "(a subset of --concurrency; empty: none)")  # fmt: skip
    parser.add_argument("--num-prompts-per-set", type=int, default=4, help="prompts of each of the 5 sets, at least")
    parser.add_argument("--prompt-factor", type=int, default=2, help="each group holds >= this x concurrency prompts")
    parser.add_argument("--quick", action="store_true", help="2 prompts a set, concurrency 1 and 4 (sampled at 1), "
                        "32 new tokens, compiled only")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="prompt chunks, each a fresh engine per block")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096, help="vLLM's max_model_len: every prompt plus "
                        "--max-new-tokens must fit (checked before any engine starts)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampled passes")
    parser.add_argument("--sampling-seed", type=int, default=0, help="request k of the sampled passes: this + k")
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="a save_pretrained folder (both engines)")
    parser.add_argument("--prompt-seed", type=int, default=10_000, help="evaluation seeds start at 10000")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--no-preload", action="store_true", help="run vLLM without tcmalloc / Intel OpenMP")
    parser.add_argument("--resume", action="store_true", help="keep the blocks a previous run into --output-dir did")
    parser.add_argument("--output-dir", default="runs/serving")
    return parser


def parse_args(argv: list[str] | None = None):
    """The arguments, with `--quick` applied and the lists parsed (`methods`, `modes`, `concurrencies`,
    `sampled_concurrencies`); exits with a usage error on bad input."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts_per_set, args.prompt_factor, args.rounds, args.max_new_tokens = 2, 0, 1, 32
        args.modes, args.concurrency, args.sampled_concurrency = "compiled", "1,4", "1"
    try:
        args.specs = parse_methods(args.methods)
        args.mode_list = parse_modes(args.modes)
        args.concurrencies = parse_concurrency(args.concurrency)
        text = args.sampled_concurrency
        sampled = parse_concurrency(text, "--sampled-concurrency") if text.strip() else []
    except ValueError as error:
        parser.error(str(error))
    if set(sampled) - set(args.concurrencies):
        parser.error(f"--sampled-concurrency {sampled} must be a subset of --concurrency {args.concurrencies}")
    args.sampled_concurrencies = sampled
    if args.num_prompts_per_set < 1 or args.prompt_factor < 0 or args.rounds < 1 or args.max_new_tokens < 1:
        parser.error("--num-prompts-per-set, --rounds and --max-new-tokens must be >= 1, --prompt-factor >= 0")
    if args.max_model_len <= args.max_new_tokens:
        parser.error(f"--max-model-len {args.max_model_len} must be more than --max-new-tokens {args.max_new_tokens}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if args.target == str(DEFAULT_TARGET):
        ensure_default_target(DEFAULT_TARGET)  # dequantizes the shipped GGUF there on first use
    if not Path(args.target, "config.json").is_file():
        parser.error(f"--target {args.target} has no config.json: pass a save_pretrained folder of the target, "
                     "or leave --target out for the default (made on first use)")
    return args


def make_plan(args) -> PromptPlan:
    return PromptPlan(args.num_prompts_per_set, args.prompt_factor, args.concurrencies, args.sampled_concurrencies)


def estimate_seconds(args, plan: PromptPlan, vllm_specs: list, hf_specs: list) -> dict:
    """A rough wall-time estimate, by part: vLLM start-ups, vLLM generation (the target alone's step time at each
    concurrency; speculative methods land near it), transformers at batch 1, card exports."""
    steps = {"startup": 0.0, "vllm": 0.0, "hf": 0.0, "export": 30.0 * sum(s.kind == "dflash" for s in vllm_specs)}
    for mode in args.mode_list:
        first, extra = STEP_MS[mode]
        steps["startup"] += STARTUP_S[mode] * len(vllm_specs) * len(args.concurrencies) * args.rounds
        for c in args.concurrencies:
            batches = sum(math.ceil((plan.greedy(g, c) + plan.sampled(g, c)) * len(s) / c) for g, s in GROUPS.items())
            steps["vllm"] += batches * args.max_new_tokens * (first + extra * (c - 1)) / 1000 * len(vllm_specs)
    requests = sum((plan.greedy(g, 1) + plan.sampled(g, 1)) * len(s) for g, s in GROUPS.items())
    steps["hf"] = requests * args.max_new_tokens / HF_TOKENS_PER_S * len(hf_specs)
    return steps | {"total": sum(steps.values())}


def sampling_for(prompts: list, args) -> dict:
    """Seeds per request: `--sampling-seed` + a stable number of the prompt (its set's place in GROUPS, its index)."""
    sets = [name for sets in GROUPS.values() for name in sets]
    return {"temperature": args.temperature,
            "seeds": [args.sampling_seed + 100_000 * sets.index(p.prompt_set) + p.index for p in prompts]}  # fmt: skip


def _batch(spec, mode, c, r, group, reply, decoding) -> Batch:
    outputs = reply["outputs"]
    return Batch(spec.name, "vllm", c, r, [p.key for p in group], [o["token_ids"] for o in outputs],
                 [o["cycles"] for o in outputs], reply["seconds"], reply["counters"], mode, decoding,
                 peaks=reply.get("peaks") or {}, first_token_s=[o.get("first_token_s") for o in outputs],
                 finish_s=[o.get("finish_s") for o in outputs])  # fmt: skip


def run_vllm_block(spec, worker, mode, c, r, greedy, sampled, args) -> list[Batch]:
    """The greedy then the sampled prompts of one block on a warm `worker`, `c` requests running at once."""
    worker.generate([WARMUP_TOKEN_IDS], 16)
    if sampled:
        worker.generate([WARMUP_TOKEN_IDS], 16, {"temperature": args.temperature, "seeds": [args.sampling_seed]})
    batches, queue = [], args.schedule == "queue"
    for group in concurrent_batches(greedy, c, queue):
        reply = worker.generate([p.token_ids for p in group], args.max_new_tokens)
        batches.append(_batch(spec, mode, c, r, group, reply, GREEDY))
        if spec.kind == "ar":  # the same prompts' prefill alone: what no speculation shortens (a fresh prefix cache)
            batches[-1].prefill_s = worker.generate([p.token_ids for p in group], 1, cache_salt="prefill")["seconds"]
    for group in concurrent_batches(sampled, c, queue):
        reply = worker.generate([p.token_ids for p in group], args.max_new_tokens, sampling_for(group, args))
        batches.append(_batch(spec, mode, c, r, group, reply, SAMPLED))
    return batches


def vllm_block(spec, config, mode, c, r, greedy, sampled, args, state) -> list[Batch] | None:
    """One fresh engine for `spec` in `mode` at concurrency `c`; None when its worker fails to start or dies (that
    block only is lost, with a line saying why)."""
    log = Path(args.output_dir) / "logs" / f"{spec.name}-{mode}-c{c}-round{r}.log"
    worker = None
    try:
        max_num_seqs = c if args.schedule == "queue" else None  # batches: vLLM's default, above every batch
        worker = VllmWorker(args.target, config, log, mode, args.vllm_threads_bind, state.preload_env | spec.env,
                            args.max_model_len, max_num_seqs)  # fmt: skip
        state.note_worker(spec, mode, c, worker.info)
        return run_vllm_block(spec, worker, mode, c, r, greedy, sampled, args)
    except RuntimeError as error:
        state.skipped.append(f"{spec.name} ({mode}) round {r + 1} concurrency {c}: {error} (log {log})")
        print(f"skipping {spec.name} ({mode}) in round {r + 1} at concurrency {c}: {error}", file=sys.stderr)
        return None
    finally:
        if worker is not None:
            worker.close()


def hf_block(spec, hf, r, greedy, sampled, args) -> list[Batch]:
    batches = []
    for p in greedy:
        tokens, cycles, seconds = hf.generate(spec.name, p.token_ids, args.max_new_tokens)
        batches.append(Batch(spec.name, "hf", 1, r, [p.key], [tokens], [cycles], seconds))
    for p, seed in zip(sampled, sampling_for(sampled, args)["seeds"]):
        tokens, cycles, seconds = hf.generate(spec.name, p.token_ids, args.max_new_tokens, args.temperature, seed)
        batches.append(Batch(spec.name, "hf", 1, r, [p.key], [tokens], [cycles], seconds, decoding=SAMPLED))
    return batches


def score_nll(hf, batches: list[Batch], prompts: dict, temperature: float) -> None:
    """Fills each sampled batch's `nll` (per request, summed over its tokens) with the target's scores."""
    for b in batches:
        if b.decoding == SAMPLED:
            b.nll = [hf.nll(prompts[key].token_ids, out, temperature) for key, out in zip(b.prompts, b.outputs)]


class RunState:
    """What the run has measured so far, written after every block (`write`)."""

    def __init__(self, args, settings: dict, run_info: dict, preload_env: dict):
        self.args, self.settings, self.run_info, self.preload_env = args, settings, run_info, preload_env
        self.done, self.batches, self.skipped = [], [], []

    def note_worker(self, spec, mode, c, info: dict) -> None:
        self.run_info["vllm"] = info.get("vllm")
        self.run_info["vllm_startup_s"].append([spec.name, mode, c, round(info.get("startup_s", 0.0), 1)])
        workers = self.run_info["preloads"]["workers"]
        if info.get("preloaded") not in workers:
            workers.append(info.get("preloaded"))
            warning = preload_warning(self.run_info)
            if warning:
                print(f"\n{'!' * 100}\n{warning}\n{'!' * 100}\n", file=sys.stderr, flush=True)

    def write(self):
        """Checks, summarizes and writes every output for the batches so far; (failures, rows)."""
        output_dir = Path(self.args.output_dir)
        failures = check_lossless(self.batches)
        rows = summarize(self.batches, failures)
        why = plot(rows, output_dir / PLOT)
        self.run_info["plot"] = PLOT if why is None else f"not drawn: {why}"
        save_store(output_dir, self.settings, self.done, self.batches, self.run_info)
        write_outputs(output_dir, rows, self.batches, self.run_info, failures, self.skipped)
        return failures, rows


def _settings(args) -> dict:
    """What the rows of a resumed run must share with the blocks already stored."""
    keys = ("target", "max_new_tokens", "prompt_seed", "num_prompts_per_set", "prompt_factor", "rounds",
            "concurrencies", "sampled_concurrencies", "temperature", "sampling_seed", "max_model_len",
            "schedule")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def _run_info(args, methods, configs, preloads) -> dict:
    import torch
    import transformers

    return {
        "target": args.target, "max_new_tokens": args.max_new_tokens, "max_model_len": args.max_model_len,
        "prompts_per_set": args.num_prompts_per_set,
        "prompt_factor": args.prompt_factor, "prompt_seed": args.prompt_seed, "groups": GROUPS,
        "rounds": args.rounds, "modes": args.mode_list, "concurrency": args.concurrencies, "schedule": args.schedule,
        "sampling": {"temperature": args.temperature, "seed": args.sampling_seed,
                     "concurrency": args.sampled_concurrencies} if args.sampled_concurrencies else None,
        "methods": [asdict(s) for s in methods], "speculative_configs": configs,
        "preloads": preloads | {"workers": []},
        "torch_threads": args.torch_threads, "vllm_threads_bind": args.vllm_threads_bind,
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "vllm": None, "vllm_startup_s": [], "estimate_s": None, "wall_s": None,
        "complete": False,  # until the run ends: a run still going, or killed, leaves partial results
    }  # fmt: skip


def prepare_vllm(specs, args, skipped) -> tuple[list, dict]:
    """The vLLM methods that can run (cards exported into `OUTPUT_DIR/exports/`) and their speculative configs."""
    vllm_specs, configs = [], {}
    for spec in (s for s in specs if s.engine == "vllm"):
        export_dir = Path(args.output_dir) / "exports" / Path(spec.card or "").name
        why = vllm_available()
        if why is None and spec.kind == "dflash":
            why = plugin_available() or export_card(spec.card, export_dir)
        if why is not None:
            skipped.append(f"{spec.name}: {why}")
            print(f"skipping {spec.name}: {why}", file=sys.stderr)
            continue
        vllm_specs.append(spec)
        configs[spec.name] = spec.speculative_config(str(export_dir))
    return vllm_specs, configs


def _round_chunk(prompts: list, rounds: int, r: int) -> list:
    """Round `r`'s share of `prompts` (empty when there are fewer prompts than rounds)."""
    chunks = chunk_rounds(prompts, rounds) if prompts else []
    return chunks[r] if r < len(chunks) else []


def schedule(args, hf_specs, vllm_specs):
    """(round, mode, concurrency, spec) for every block, in run order: the methods rotate by one per concurrency and
    round; transformers' methods join the first mode's first concurrency, at batch 1."""
    order, turn = [], 0
    for r in range(args.rounds):
        for m, mode in enumerate(args.mode_list):
            for i, c in enumerate(args.concurrencies):
                specs = (hf_specs if m == 0 and i == 0 else []) + vllm_specs
                order += [(r, mode, c, spec) for spec in rotated(specs, turn)]
                turn += 1
    return order


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a `timeout` or `kill` ends the run through `finally` blocks, which close the vLLM worker and its engine
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    output_dir = Path(args.output_dir)
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    settings, skipped = _settings(args), []
    try:
        done, stored, previous = load_store(output_dir, settings) if args.resume else ([], [], {})
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for spec in (s for s in args.specs if s.settings):  # the card with its settings, under the method's name
        spec.card = card_with_settings(spec.card, spec.settings, output_dir / "cards" / spec.name)
    vllm_specs, configs = prepare_vllm(args.specs, args, skipped)
    preload_env, preloads = vllm_preload_env(disabled=args.no_preload)
    hf_specs = [s for s in args.specs if s.engine == "hf"]
    state = RunState(args, settings, _run_info(args, hf_specs + vllm_specs, configs, preloads), preload_env)
    state.done, state.batches, state.skipped = list(done), stored, skipped
    if previous:  # a resumed run: the engines started before count too
        state.run_info["vllm_startup_s"] = previous.get("vllm_startup_s", [])
        state.run_info["preloads"]["workers"] = (previous.get("preloads") or {}).get("workers", [])
    plan = make_plan(args)
    estimate = estimate_seconds(args, plan, vllm_specs, hf_specs)
    state.run_info["estimate_s"] = {k: round(v) for k, v in estimate.items()}
    print(f"estimated wall time ~{estimate['total'] / 60:.0f} min on a quiet 2-core host ("
          + ", ".join(f"{k} {v / 60:.1f}" for k, v in estimate.items() if k != "total") + " min); "
          f"{len(done)} blocks already done", file=sys.stderr, flush=True)  # fmt: skip
    if preloads["missing"]:
        print(f"\n{'!' * 100}\n{preload_warning(state.run_info)}\n{'!' * 100}\n", file=sys.stderr, flush=True)
    hf = HfEngine(hf_specs, args.target, args.torch_threads)
    prompts = encode_prompts(hf.tokenizer, plan, args.prompt_seed)
    if vllm_specs and (error := too_long(prompts, args.max_new_tokens, args.max_model_len)):
        print(f"error: {error}", file=sys.stderr)
        return 2
    by_key = {p.key: p for p in prompts}
    started = time.perf_counter()
    blocks = schedule(args, hf_specs, vllm_specs)
    for n, (r, mode, c, spec) in enumerate(blocks, 1):
        block_mode, block_c = ("hf", 1) if spec.engine == "hf" else (mode, c)
        key = block_key(spec.name, block_mode, block_c, r)
        if key in state.done:
            continue
        greedy = _round_chunk(plan.pick(prompts, block_c, sampled=False), args.rounds, r)
        sampled = _round_chunk(plan.pick(prompts, block_c, sampled=True), args.rounds, r)
        elapsed = (time.perf_counter() - started) / 60
        print(f"[{n}/{len(blocks)}, {elapsed:.1f} min] {key}: {len(greedy)} greedy + {len(sampled)} sampled prompts",
              file=sys.stderr, flush=True)  # fmt: skip
        if spec.engine == "hf":
            if not hf.warm:
                hf.warmup(WARMUP_TOKEN_IDS)
            new = hf_block(spec, hf, r, greedy, sampled, args)
        else:
            new = vllm_block(spec, configs[spec.name], mode, c, r, greedy, sampled, args, state)
        if new is None:
            continue
        score_nll(hf, new, by_key, args.temperature)
        state.batches += new
        state.done.append(key)
        state.write()  # a killed run keeps the blocks it finished; --resume skips them
    state.run_info["wall_s"], state.run_info["complete"] = time.perf_counter() - started, True
    failures, rows = state.write()
    print(render_markdown(rows, state.run_info, failures, state.skipped))
    print(f"wrote {output_dir / 'results.json'}, results.md and {PLOT}")
    if failures:
        print("LOSSLESS CHECK FAILED:\n  " + "\n  ".join(f["message"] for f in failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

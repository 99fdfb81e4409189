"""Two vLLM methods served at the same time, one core each, so that the host's drift lands on both: a paired A/B.

    G=:speculation_policy=goodput:num_assistant_tokens=8:prompt_lookup_num_tokens=8:datastore_num_tokens=8
    G=$G:online_datastore_num_tokens=8:num_speculative_tokens=8
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving_paired.py --methods "vllm_ar,vllm_dflash$G" \\
        --concurrency 32 --groups unseen --rounds 2 --output-dir runs/paired

Why. On a shared 2-core host a core's speed moves by tens of percent over minutes (results/serving.md), more than
the few percent a change of the plugin makes at 32 running; `serving.py` runs one engine at a time and interleaves
its blocks, so two blocks of one comparison meet different hosts. Here both methods run at once: method A's engine
on one core and B's on the other (`taskset` over the whole worker, vLLM's OpenMP threads bound to that core), each
group's prompts submitted to both together, the cores swapped every round. A slow spell then slows both, and a
core's own speed, or its neighbour's load, lands on each method in one round of two.

How. Per round: a fresh engine per method (A on core `r % 2`, B on the other), each warmed up; then, group by
group, both take the group's prompts at the same moment, queued `--concurrency` running at a time (`max_num_seqs`,
as `serving.py --schedule queue`), greedy, `--max-new-tokens` each. The side that finishes first keeps its core busy
with filler calls (`--filler-prompts` of the group under a cache salt, untimed) until the other finishes, so neither
runs its tail beside an idle core. Every round reads the same prompts (fresh engines: no prefix cache, no `suffix`
tree, no online datastore carried over).

What it is not: each engine has one core, not the two users give it, so a step costs about twice its 2-core time
while the engine's Python work does not; the ratios are of one-core engines. The 2-core speedups are
`serving.py`'s.

Prints and writes (`--output-dir`: `results.json`, `results.md`) per group and round the tokens/s of each method,
its mean time to first token and per output token after it, and B over A; per group, the geometric mean of B over A
over the rounds. Greedy outputs of the two are compared token for token when either is the target alone (`vllm_ar`):
exit 1 when any differs.
"""

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path

from serving import DEFAULT_TARGET, WARMUP_TOKEN_IDS, prepare_vllm
from serving_engines import VllmWorker, card_with_settings, vllm_preload_env
from serving_methods import GROUPS, PromptPlan, encode_prompts, parse_methods, too_long
from serving_records import first_difference, portable, request_latencies


CORES = ("0", "1")  # A's core in even rounds; B's in odd ones


def parse_pair(text: str) -> list:
    """`A,B` -> the two vLLM `MethodSpec`s, in that order (no target alone added: name `vllm_ar` to pair with it)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    specs = [parse_methods(item)[-1] for item in items]  # [-1]: parse_methods prepends the engine's reference
    if len(specs) != 2 or any(s.engine != "vllm" for s in specs):
        raise ValueError(f"--methods takes exactly two vLLM methods, A,B (e.g. vllm_ar,vllm_dflash), got {text!r}")
    if specs[0].name == specs[1].name:
        raise ValueError(f"the two methods must differ (give one `:env.NAME=VALUE` or settings), got {text!r}")
    return specs


def cores_of_round(r: int) -> tuple[str, str]:
    """(A's core, B's core) in round `r`: swapped every round."""
    return CORES if r % 2 == 0 else CORES[::-1]


def side_summary(reply: dict) -> dict:
    """tokens/s, mean time to first token and per output token after it (ms) of one timed call's reply."""
    outputs = reply["outputs"]
    lengths = [len(o["token_ids"]) for o in outputs]
    tokens = sum(lengths)
    ttft, tpot = request_latencies([o.get("first_token_s") for o in outputs], [o.get("finish_s") for o in outputs],
                                   lengths)  # fmt: skip
    return {"seconds": reply["seconds"], "new_tokens": tokens, "tokens_per_s": tokens / reply["seconds"],
            "ttft_ms": 1e3 * sum(ttft) / len(ttft) if ttft else None,
            "tpot_ms": 1e3 * sum(tpot) / len(tpot) if tpot else None}  # fmt: skip


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: list[dict]) -> dict:
    """Per group: B over A in each round, their geometric mean, and the same for the decode (A's time per output
    token over B's)."""
    out = {}
    for group in dict.fromkeys(row["group"] for row in rows):
        ratios = [row["b_over_a"] for row in rows if row["group"] == group]
        decode = [row["a"]["tpot_ms"] / row["b"]["tpot_ms"] for row in rows
                  if row["group"] == group and row["a"]["tpot_ms"] and row["b"]["tpot_ms"]]  # fmt: skip
        out[group] = {"rounds": len(ratios), "b_over_a": ratios, "geomean": geometric_mean(ratios),
                      "decode_geomean": geometric_mean(decode) if decode else None}  # fmt: skip
    return out


def lossless_failures(rows: list[dict], names: tuple[str, str]) -> list[str]:
    """Where A's and B's greedy outputs differ, when one of them is the target alone (else nothing to check)."""
    if "vllm_ar" not in names:
        return []
    failures = []
    for row in rows:
        for key, a, b in zip(row["prompts"], row["a_outputs"], row["b_outputs"]):
            index = first_difference(a, b)
            if index is not None:
                failures.append(f"round {row['round']} {key}: {names[0]} and {names[1]} differ at token {index}")
    return failures


def render(rows: list[dict], summary: dict, names: tuple[str, str], info: dict) -> str:
    a, b = names
    wall = info.get("wall_s", 0) / 60
    lines = [f"# Paired A/B: A = `{a}`, B = `{b}`, {info['concurrency']} running, one core each", "",
             f"{info['new_tokens_per_request']} new tokens a request, greedy; wall {wall:.1f} min.", "",
             "| group | round | A's core | A tok/s | B tok/s | B / A | A TTFT ms | B TTFT ms | A TPOT ms "
             "| B TPOT ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def ms(value):
        return "" if value is None else f"{value:.1f}"

    for row in rows:
        sa, sb = row["a"], row["b"]
        lines.append(f"| {row['group']} | {row['round']} | {row['cores'][0]} | {sa['tokens_per_s']:.2f} | "
                     f"{sb['tokens_per_s']:.2f} | {row['b_over_a']:.3f} | {ms(sa['ttft_ms'])} | {ms(sb['ttft_ms'])} | "
                     f"{ms(sa['tpot_ms'])} | {ms(sb['tpot_ms'])} |")  # fmt: skip
    lines += ["", "| group | rounds | B / A, geometric mean | decode (A TPOT / B TPOT), geometric mean |",
              "|---|---:|---:|---:|"]
    for group, s in summary.items():
        decode = "" if s["decode_geomean"] is None else f"{s['decode_geomean']:.3f}"
        lines.append(f"| {group} | {s['rounds']} | **{s['geomean']:.3f}** | {decode} |")
    failures = info.get("failures") or []
    lines += ["", "Lossless: " + ("; ".join(failures) if failures else
              ("every greedy output equal" if "vllm_ar" in names else "not checked (neither is vllm_ar)"))]
    return "\n".join(lines) + "\n"


class Side(threading.Thread):
    """One method's timed call of a group, then filler calls until `others_done` is set."""

    def __init__(self, worker: VllmWorker, prompts: list, filler: list, args, barrier, done, others_done):
        super().__init__()
        self.worker, self.prompts, self.filler, self.args = worker, prompts, filler, args
        self.barrier, self.done, self.others_done = barrier, done, others_done
        self.reply, self.error, self.fillers = None, None, 0

    def run(self):
        try:
            self.barrier.wait()
            self.reply = self.worker.generate(self.prompts, self.args.max_new_tokens)
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            self.error = error
        finally:
            self.done.set()
        while self.error is None and not self.others_done.is_set():
            self.fillers += 1
            self.worker.generate(self.filler, self.args.max_new_tokens, cache_salt=f"filler-{self.fillers}")


def paired_call(workers: tuple, prompts: list, filler: list, args) -> tuple[dict, dict]:
    """Both workers' timed replies on `prompts`, submitted at the same moment."""
    barrier, done = threading.Barrier(2), (threading.Event(), threading.Event())
    sides = [Side(workers[0], prompts, filler, args, barrier, done[0], done[1]),
             Side(workers[1], prompts, filler, args, barrier, done[1], done[0])]  # fmt: skip
    for side in sides:
        side.start()
    for side in sides:
        side.join()
    for side in sides:
        if side.error is not None:
            raise RuntimeError(f"a paired call failed: {side.error}") from side.error
    return sides[0].reply, sides[1].reply


def run_round(r: int, specs: list, configs: dict, groups: dict, args, preload_env: dict) -> list[dict]:
    cores = cores_of_round(r)
    workers, rows = [], []
    try:
        for spec, core in zip(specs, cores):  # one start at a time: no two compilations racing for one cache
            log = Path(args.output_dir) / "logs" / f"{spec.name}-c{args.concurrency}-round{r}-core{core}.log"
            workers.append(VllmWorker(args.target, configs[spec.name], log, "compiled", core,
                                      preload_env | spec.env, args.max_model_len, args.concurrency, pin=True))
            workers[-1].generate([WARMUP_TOKEN_IDS], 16)
        for group, prompts in groups.items():
            ids = [p.token_ids for p in prompts]
            started = time.perf_counter()
            reply_a, reply_b = paired_call(tuple(workers), ids, ids[: args.filler_prompts], args)
            a, b = side_summary(reply_a), side_summary(reply_b)
            rows.append({"round": r, "group": group, "cores": list(cores), "a": a, "b": b,
                         "b_over_a": b["tokens_per_s"] / a["tokens_per_s"], "wall_s": time.perf_counter() - started,
                         "prompts": [list(p.key) for p in prompts],
                         "a_outputs": [o["token_ids"] for o in reply_a["outputs"]],
                         "b_outputs": [o["token_ids"] for o in reply_b["outputs"]],
                         "a_counters": reply_a["counters"], "b_counters": reply_b["counters"]})  # fmt: skip
            print(f"round {r} {group}: A {a['tokens_per_s']:.2f} tok/s (core {cores[0]}), B {b['tokens_per_s']:.2f} "
                  f"(core {cores[1]}), B/A {rows[-1]['b_over_a']:.3f}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for worker in workers:
            worker.close()
    return rows


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--methods", required=True, help="A,B: two vLLM methods as serving.py names them")
    parser.add_argument("--concurrency", type=int, default=32, help="requests running at once (max_num_seqs)")
    parser.add_argument("--groups", default="unseen", help=f"comma separated, of {','.join(GROUPS)}")
    parser.add_argument("--num-prompts-per-set", type=int, default=8)
    parser.add_argument("--prompt-factor", type=int, default=1, help="each group holds >= this x concurrency prompts")
    parser.add_argument("--rounds", type=int, default=2, help="fresh engines each, cores swapped (even: balanced)")
    parser.add_argument("--filler-prompts", type=int, default=4, help="prompts of an untimed filler call")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--target", default=str(DEFAULT_TARGET))
    parser.add_argument("--prompt-seed", type=int, default=10_000)
    parser.add_argument("--output-dir", default="runs/paired")
    return parser


def parse_args(argv: list[str] | None = None):
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        args.specs = parse_pair(args.methods)
    except ValueError as error:
        parser.error(str(error))
    args.group_list = [g.strip() for g in args.groups.split(",") if g.strip()]
    if not args.group_list or set(args.group_list) - set(GROUPS):
        parser.error(f"--groups takes a comma-separated subset of {','.join(GROUPS)}, got {args.groups!r}")
    if min(args.concurrency, args.num_prompts_per_set, args.rounds, args.filler_prompts, args.max_new_tokens) < 1:
        parser.error("--concurrency, --num-prompts-per-set, --rounds, --filler-prompts and --max-new-tokens must "
                     "be >= 1")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from hf_retrace.data.assets import ensure_default_target

    if args.target == str(DEFAULT_TARGET):
        ensure_default_target(DEFAULT_TARGET)
    output_dir = Path(args.output_dir)
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    for spec in (s for s in args.specs if s.settings):
        spec.card = card_with_settings(spec.card, spec.settings, output_dir / "cards" / spec.name)
    skipped = []
    specs, configs = prepare_vllm(args.specs, args, skipped)
    if len(specs) != 2:
        print(f"error: both methods must run: {'; '.join(skipped)}", file=sys.stderr)
        return 2
    plan = PromptPlan(args.num_prompts_per_set, args.prompt_factor, [args.concurrency], [])
    prompts = encode_prompts(AutoTokenizer.from_pretrained(args.target), plan, args.prompt_seed)
    if error := too_long(prompts, args.max_new_tokens, args.max_model_len):
        print(f"error: {error}", file=sys.stderr)
        return 2
    picked = plan.pick(prompts, args.concurrency, sampled=False)
    groups = {g: [p for p in picked if p.group == g] for g in args.group_list}
    preload_env, preloads = vllm_preload_env()
    names = (specs[0].name, specs[1].name)
    info = {"methods": list(names), "concurrency": args.concurrency, "new_tokens_per_request": args.max_new_tokens,
            "groups": {g: len(ps) for g, ps in groups.items()}, "rounds": args.rounds, "preloads": preloads,
            "speculative_configs": configs, "target": args.target}  # fmt: skip
    started, rows = time.perf_counter(), []
    for r in range(args.rounds):
        rows += run_round(r, specs, configs, groups, args, preload_env)
        info["wall_s"] = time.perf_counter() - started
        summary = summarize(rows)
        info["failures"] = lossless_failures(rows, names)
        record = portable({"info": info, "summary": summary, "rows": rows})  # no machine's paths in a record
        (output_dir / "results.json").write_text(json.dumps(record))
        (output_dir / "results.md").write_text(render(rows, summary, names, info))
    print((output_dir / "results.md").read_text())
    return 1 if info["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving bench: transformers and vLLM, target alone and speculative, at batch 1 and under concurrency, one run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --output-dir runs/serving            # the full bench
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving.py --quick --output-dir runs/serving-dev  # 2 prompts a set

The full bench (8 prompts of each of 5 sets, 2 rounds, concurrency 1 and 8, all methods) takes about half an hour on
a quiet 2-core CPU: ~25 s of generation per method and prompt set at batch 1, and ten vLLM engine start-ups of
~20-40 s each (the dflash card is exported once per run, into `OUTPUT_DIR/exports/`).

Methods (`--methods`, comma separated; default all):

    hf_ar                 transformers, target alone (greedy `generate`)
    hf_drafter[=CARD]     transformers + the drafter CARD with its own policy (default model_cards/smollm2-135m-dflash:
                          prompt lookup and datastore in front, verify 3)
    vllm_ar               vLLM, target alone
    vllm_ngram[=K]        vLLM `ngram` (prompt lookup, n-grams 3..2, K drafts verified; default 3)
    vllm_suffix[=K]       vLLM `suffix` decoding (K drafts at most; default 3)
    vllm_dflash[=CARD]    vLLM `dflash` with the plugin, CARD exported by `hf-retrace export --format vllm`
    vllm_retrace[=CARD]   the same for the ReTrace card (default model_cards/smollm2-135m-retrace)

Every method needs its engine's target-alone method (`hf_ar`, `vllm_ar`), which is added when missing: lossless is
checked against it, per prompt and concurrency (token ids equal), and speedups are over it. A method whose pieces are
missing (the export command, the vLLM plugin, a worker that fails to start) is skipped with a line saying why.

Prompts: two groups, reported apart. `pool_eval`: the eval splits of the pool's families that `hf-retrace bench` reads
(gsm_symbolic, humaneval, open_ended; seeds from 10000). `unseen`: families no training pool used (codeio,
knights_knaves; seeds from 10000). `--num-prompts-per-set` of each, chat template applied once, and the same token
ids go to both engines.

Measurement. transformers runs in this process (fp32, skinny GEMM on target and drafter as `scripts/run.sh` does,
2 torch threads); each vLLM method runs in its own worker process (`benchmarks/serving_vllm_worker.py` in `.venv-vllm`,
fp32, eager, `VLLM_CPU_OMP_THREADS_BIND=0-1`). The prompts are cut into `--rounds` chunks; each round runs every
method on its chunk, in an order rotated by one per round (ABC BCA ...), at every concurrency, so slow drift of a
shared machine lands on all methods alike. An idle vLLM engine costs no CPU here (top: under 2%), but holds ~3.7 GB,
so only one engine lives at a time: each vLLM block (a method, a round's chunk, one concurrency) starts its engine
(start-up and a warmup on a token sequence of no benched prompt excluded from timing) and ends it. A fresh engine
per concurrency matters for `suffix`, whose tree keeps every response: reusing the engine let it meet at
concurrency 8 the responses it had just produced at concurrency 1. transformers is batch-1 only: at concurrency above 1 it is left out (its batch-1 rows stand).
vLLM at concurrency C submits C prompts of one group at once and steps the engine until all are done; tokens/s =
new tokens of all requests / wall time of the batches (a prompt set's row within a batch mixing sets: its requests'
share of the batch's time).

tau is pooled over cycles: committed tokens (bonus included) summed over every verification cycle of every prompt,
divided by the number of cycles, the prefill not counted. transformers: the drafter's `last_generation_stats` (every
verification, lookup cycles included); vLLM: the tokens each engine step commits per request (steps without a draft
count as cycles of 1, as a prompt-lookup cycle with no match does in transformers). `tau_drafted` is vLLM's own
counter view (1 + accepted / drafts, `vllm:spec_decode_num_*` from `LLM.get_metrics()`), over cycles with a draft.

Outputs in `--output-dir`: `results.json` (run info, rows, lossless failures, per-prompt records without token ids)
and `results.md`. Exit code 1 when any greedy output differs from its engine's target alone.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
WORKER = REPO / "benchmarks" / "serving_vllm_worker.py"
DEFAULT_TARGET = Path.home() / ".cache" / "hf_retrace" / "smollm2-135m-instruct"
CARDS = {"dflash": "model_cards/smollm2-135m-dflash", "retrace": "model_cards/smollm2-135m-retrace"}
GROUPS = {"pool_eval": ("gsm_symbolic", "humaneval", "open_ended"), "unseen": ("codeio", "knights_knaves")}
REFERENCES = {"hf": "hf_ar", "vllm": "vllm_ar"}
PROPOSER_SOURCES = ("lookup", "datastore", "draft")  # the hf-retrace plugin's proposer, cycles by source
TAU_NOTE = (
    "tau is pooled over cycles: committed tokens (bonus included) summed over all verification cycles of all prompts, "
    "divided by the number of cycles (prefill not counted)"
)


@dataclass
class MethodSpec:
    """One `--methods` entry: `engine` is `hf` or `vllm`, `kind` one of ar, drafter, ngram, suffix, dflash."""

    name: str
    engine: str
    kind: str
    card: str | None = None
    num_speculative_tokens: int | None = None

    def speculative_config(self, export_dir: str | None = None) -> dict | None:
        """vLLM's `speculative_config` for this method (None: target alone)."""
        k = self.num_speculative_tokens
        if self.kind == "ngram":
            return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
        if self.kind == "suffix":
            return {"method": "suffix", "num_speculative_tokens": k}
        if self.kind == "dflash":
            return {"method": "dflash", "model": export_dir, "num_speculative_tokens": k}
        return None


ALL_METHODS = "hf_ar,hf_drafter,vllm_ar,vllm_ngram,vllm_suffix,vllm_dflash,vllm_retrace"


def parse_methods(text: str) -> list[MethodSpec]:
    """`hf_ar,hf_drafter[=CARD],vllm_ar,vllm_ngram[=K],vllm_suffix[=K],vllm_dflash[=CARD],vllm_retrace[=CARD]`;
    each engine's target-alone method is prepended when that engine is used without it."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, has_value, value = item.partition("=")
        if has_value and not value:
            raise ValueError(f"method {item!r} has an empty value after '='; drop the '=' or give a value")
        if name in ("hf_ar", "vllm_ar") and not has_value:
            specs.append(MethodSpec(name, name.partition("_")[0], "ar"))
        elif name == "hf_drafter":
            specs.append(MethodSpec(name, "hf", "drafter", card=value or CARDS["dflash"]))
        elif name in ("vllm_ngram", "vllm_suffix"):
            if has_value and not (value.isdigit() and int(value) >= 1):
                raise ValueError(f"expected {name}=K with K >= 1 speculative tokens, got {item!r}")
            specs.append(MethodSpec(name, "vllm", name.partition("_")[2], num_speculative_tokens=int(value or 3)))
        elif name in ("vllm_dflash", "vllm_retrace"):
            card = value or CARDS[name.partition("_")[2]]
            specs.append(MethodSpec(name, "vllm", "dflash", card=card, num_speculative_tokens=3))
        else:
            raise ValueError(f"unknown method {item!r}; expected one of {ALL_METHODS} (with =CARD or =K where shown)")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    for engine, reference in reversed(REFERENCES.items()):
        if any(s.engine == engine for s in specs) and reference not in names:
            specs.insert(0, MethodSpec(reference, engine, "ar"))
    return specs


def parse_concurrency(text: str) -> list[int]:
    """`1,8` -> `[1, 8]` (unique, ascending, each >= 1)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated integers like 1,8, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"--concurrency needs integers >= 1, got {text!r}")
    return values


@dataclass
class Prompt:
    group: str
    prompt_set: str
    index: int
    token_ids: list[int]


@dataclass
class Batch:
    """One call of one method on `len(prompts)` prompts submitted at once (batch 1: one prompt)."""

    method: str
    engine: str
    concurrency: int
    round: int
    prompts: list[tuple[str, str, int]]  # (group, prompt set, index) per request
    outputs: list[list[int]]  # new token ids per request
    cycles: list[list[int]]  # committed tokens per verification cycle, per request
    seconds: float
    counters: dict = field(default_factory=dict)  # vLLM spec-decode counter deltas


def chunk_rounds(prompts: list[Prompt], rounds: int) -> list[list[Prompt]]:
    """Cuts the prompts into `rounds` chunks of near-equal size, each mixing every set (prompt k: chunk k % rounds)."""
    rounds = max(1, min(rounds, len(prompts)))
    return [prompts[r::rounds] for r in range(rounds)]


def concurrent_batches(chunk: list[Prompt], concurrency: int) -> list[list[Prompt]]:
    """The chunk's prompts in batches of `concurrency` submitted at once, each batch of one group only, so a group's
    rows time its own requests (a batch's wall time cannot be split among groups)."""
    batches = []
    for group in dict.fromkeys(p.group for p in chunk):
        prompts = [p for p in chunk if p.group == group]
        batches += [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    return batches


def rotated(items: list, k: int) -> list:
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(batches: list[Batch]) -> list[dict]:
    """One failure per (method, concurrency, prompt) whose tokens differ from its engine's target alone at the same
    concurrency; a prompt the reference did not run is a failure too (nothing to check against)."""
    reference = {}
    for b in batches:
        if b.method == REFERENCES[b.engine]:
            for key, tokens in zip(b.prompts, b.outputs):
                reference[(b.engine, b.concurrency, key)] = tokens
    failures = []
    for b in batches:
        if b.method == REFERENCES[b.engine]:
            continue
        for key, tokens in zip(b.prompts, b.outputs):
            expected = reference.get((b.engine, b.concurrency, key))
            index = None if expected is None else first_difference(expected, tokens)
            if expected is None or index is not None:
                failures.append({
                    "method": b.method, "concurrency": b.concurrency, "group": key[0], "prompt_set": key[1],
                    "prompt_index": key[2], "index": index,
                    "expected": None if expected is None or index >= len(expected) else expected[index],
                    "got": None if index is None or index >= len(tokens) else tokens[index],
                    "message": f"{b.method} at concurrency {b.concurrency} on {key[1]}#{key[2]}: "
                    + ("no target-alone output to compare with" if expected is None
                       else f"first differing token at index {index}"),
                })  # fmt: skip
    return failures


def _row(method: str, engine: str, concurrency: int, label: str, batches: list[Batch], failures: list[dict]):
    """One results row over the requests of `batches` in `label` (a group, a prompt set, or `pooled`)."""
    def keep(key):
        return label == "pooled" or label in key[:2]

    cycles, tokens, num_prompts, seconds, counters = [], 0, 0, 0.0, {}
    for b in batches:
        picked = [i for i, key in enumerate(b.prompts) if keep(key)]
        if not picked:
            continue
        num_prompts += len(picked)
        tokens += sum(len(b.outputs[i]) for i in picked)
        cycles += [n for i in picked for n in b.cycles[i]]
        # batches hold one group (`concurrent_batches`); a prompt-set row of a batch that mixes sets gets the share
        # of the batch's wall time (and counters) of its requests
        seconds += b.seconds * len(picked) / len(b.prompts)
        for k, v in b.counters.items():
            counters[k] = counters.get(k, 0) + v * len(picked) / len(b.prompts)
    drafts = counters.get("num_drafts", 0)
    lossless = not any(
        f["method"] == method and f["concurrency"] == concurrency and keep((f["group"], f["prompt_set"]))
        for f in failures
    )
    return {
        "method": method,
        "engine": engine,
        "concurrency": concurrency,
        "prompts": label,
        "num_prompts": num_prompts,
        "tau": sum(cycles) / len(cycles) if cycles else None,
        "tau_drafted": 1 + counters["num_accepted_tokens"] / drafts if drafts else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "speedup": None,
        "vs_hf_ar_batch1": None,
        "num_cycles": len(cycles),
        "new_tokens": tokens,
        "seconds": seconds,
        "spec_decode_counters": counters or None,
        "lossless": None if method == REFERENCES[engine] else lossless,
    }


def summarize(batches: list[Batch], failures: list[dict]) -> list[dict]:
    """Rows per (method, concurrency) x (each group, each prompt set, pooled); `speedup` is over the same engine's
    target alone at the same concurrency on the same prompts, `vs_hf_ar_batch1` over transformers' target alone at
    batch 1 on them."""
    keys = list(dict.fromkeys((b.method, b.engine, b.concurrency) for b in batches))
    labels = list(dict.fromkeys(key[0] for b in batches for key in b.prompts))
    labels += list(dict.fromkeys(key[1] for b in batches for key in b.prompts)) + ["pooled"]
    rows = []
    for method, engine, concurrency in keys:
        subset = [b for b in batches if (b.method, b.concurrency) == (method, concurrency)]
        rows += [_row(method, engine, concurrency, label, subset, failures) for label in labels]
    speed = {(r["method"], r["concurrency"], r["prompts"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        ref = speed.get((REFERENCES[r["engine"]], r["concurrency"], r["prompts"]))
        hf = speed.get(("hf_ar", 1, r["prompts"]))
        if r["tokens_per_s"] is not None:
            r["speedup"] = r["tokens_per_s"] / ref if ref else None
            r["vs_hf_ar_batch1"] = r["tokens_per_s"] / hf if hf else None
    return rows


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _proposer_lines(rows: list[dict]) -> list[str]:
    """Markdown lines: the hf-retrace plugin proposer's cycles / committed tokens by source, pooled rows only."""
    picked = [
        r for r in rows if r["prompts"] == "pooled" and "proposer_cycles_draft" in (r["spec_decode_counters"] or {})
    ]
    if not picked:
        return []
    lines = ["", "## hf-retrace proposer in vLLM: cycles / committed tokens by source (pooled)", "",
             "| method | concurrency | lookup | datastore | draft | tau over these cycles |",
             "|---|---:|---|---|---|---:|"]  # fmt: skip
    for r in picked:
        c = r["spec_decode_counters"]
        cycles = [c.get(f"proposer_cycles_{s}", 0) for s in PROPOSER_SOURCES]
        committed = [c.get(f"proposer_committed_{s}", 0) for s in PROPOSER_SOURCES]
        cells = " | ".join(f"{n:.0f} / {m:.0f}" for n, m in zip(cycles, committed))
        tau = sum(committed) / sum(cycles) if sum(cycles) else None
        lines.append(f"| {r['method']} | {r['concurrency']} | {cells} | {_fmt(tau, '.3f')} |")
    return lines


def render_markdown(rows: list[dict], run_info: dict, failures: list[dict], skipped: list[str]) -> str:
    """The results tables (one per concurrency; groups and pooled rows, prompt sets in results.json) as markdown."""
    lines = [
        "# Serving bench: transformers and vLLM",
        "",
        f"target `{run_info['target']}`, fp32, greedy, max_new_tokens={run_info['max_new_tokens']}, "
        f"{run_info['cpu_count']} CPUs; transformers {run_info['transformers']} ({run_info['torch_threads']} torch "
        f"threads, skinny GEMM), vLLM {run_info.get('vllm') or 'n/a'} (eager, VLLM_CPU_OMP_THREADS_BIND="
        f"{run_info['vllm_threads_bind']}). Prompts: {run_info['prompts_per_set']} a set; `pool_eval` = "
        f"{', '.join(GROUPS['pool_eval'])} (eval splits), `unseen` = {', '.join(GROUPS['unseen'])} (no pool used "
        f"them). {run_info['rounds']} rounds, methods rotated per round; one vLLM engine alive at a time.",
        "",
        f"{TAU_NOTE}. tau drafted = 1 + accepted / drafts from vLLM's spec-decode counters (cycles with a draft). "
        "Speedup = tokens/s over the same engine's target alone at the same concurrency; vs hf_ar = over "
        "transformers' target alone at batch 1. Lossless = token ids equal to the same engine's target alone at the "
        "same concurrency, per prompt.",
    ]
    for concurrency in sorted({r["concurrency"] for r in rows}):
        lines += ["", f"## Concurrency {concurrency}", ""]
        if concurrency > 1:
            lines += ["transformers is batch-1 only, so it is left out here (its batch-1 rows are above).", ""]
        lines += [
            "| method | prompts | n | tau (pooled over cycles) | tau drafted | tokens/s | speedup | vs hf_ar | "
            "cycles | new tokens | lossless |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            if r["concurrency"] != concurrency or r["prompts"] not in (*GROUPS, "pooled"):
                continue
            lossless = {None: "reference", True: "yes", False: "**NO**"}[r["lossless"]]
            lines.append(
                f"| {r['method']} | {r['prompts']} | {r['num_prompts']} | {_fmt(r['tau'], '.3f')} "
                f"| {_fmt(r['tau_drafted'], '.3f')} | {_fmt(r['tokens_per_s'], '.2f')} "
                f"| {_fmt(r['speedup'], '.3f', 'x')} | {_fmt(r['vs_hf_ar_batch1'], '.3f', 'x')} "
                f"| {r['num_cycles']} | {r['new_tokens']} | {lossless} |"
            )
    lines += _proposer_lines(rows)
    if skipped:
        lines += ["", "## Skipped methods", ""] + [f"- {line}" for line in skipped]
    if failures:
        lines += ["", "## LOSSLESS CHECK FAILED", ""] + [f"- {f['message']}" for f in failures]
    return "\n".join(lines) + "\n"


def write_outputs(output_dir: Path, rows, batches, run_info, failures, skipped) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    per_batch = [
        {k: v for k, v in asdict(b).items() if k != "outputs"} | {"new_tokens": [len(o) for o in b.outputs]}
        for b in batches
    ]
    payload = {"run": run_info, "tau_definition": TAU_NOTE, "results": rows, "lossless_failures": failures,
               "skipped": skipped, "batches": per_batch}  # fmt: skip
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (output_dir / "results.md").write_text(render_markdown(rows, run_info, failures, skipped))


# ---- engines (impure) -------------------------------------------------------------------------------------------


class VllmWorker:
    """A `serving_vllm_worker.py` process: one engine, JSON lines in and out, stderr to a log file."""

    def __init__(self, target: str, speculative_config: dict | None, log_path: Path, threads_bind: str):
        stats = log_path.with_suffix(".proposer.json")  # the hf-retrace proposer's counters (plugin methods only)
        stats.unlink(missing_ok=True)
        env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": threads_bind, "HF_HUB_OFFLINE": "1",
                            "HF_RETRACE_VLLM_STATS": str(stats)}  # fmt: skip
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        command = [str(VLLM_PYTHON), str(WORKER), "--target", target]
        if speculative_config is not None:
            command += ["--speculative-config", json.dumps(speculative_config)]
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        text=True, env=env, cwd=REPO)  # fmt: skip
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"vLLM worker exited (code {self.process.returncode}): {last_error(self.log_path)}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM worker: {reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"cmd": "generate", "prompts": prompts,
                                             "max_new_tokens": max_new_tokens}) + "\n")  # fmt: skip
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()


def last_error(log_path: Path) -> str:
    """The last line of a worker's log that names an error (a traceback's final line), else its last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0] or line.startswith("Exception")]
    return (errors or lines or ["(empty log)"])[-1][:300]


def vllm_available() -> str | None:
    """None when `.venv-vllm` can run vLLM, else why not."""
    if not VLLM_PYTHON.is_file():
        return f"{VLLM_PYTHON} not found: run scripts/setup-vllm.sh"
    return None


def plugin_available() -> str | None:
    """None when the hf_retrace vLLM plugin is installed in `.venv-vllm` (entry point `vllm.general_plugins`)."""
    code = ("import importlib.metadata as m; "
            "print(any(e.name == 'hf_retrace' for e in m.entry_points(group='vllm.general_plugins')))")  # fmt: skip
    out = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, cwd=REPO)
    if out.stdout.strip() != "True":
        return "the vLLM plugin (integrations/vllm, entry point vllm.general_plugins:hf_retrace) is not installed"
    return None


def export_card(card: str, output: Path) -> str | None:
    """Exports `card` for vLLM into `output` (`hf-retrace export --format vllm`); None on success, else why not."""
    if not Path(card, "config.json").is_file():
        return f"drafter card {card} has no config.json"
    # --overwrite: `output` is the bench's own folder, and a rerun into the same --output-dir re-exports there
    command = [sys.executable, "-m", "hf_retrace.cli", "export", "--format", "vllm", "--drafter", card,
               "--output", str(output), "--overwrite"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if out.returncode != 0 or not (output / "config.json").is_file():
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        command = f"hf-retrace export --format vllm --drafter {card}"
        return f"`{command}` failed (exit {out.returncode}): " + " | ".join(tail)
    return None


class HfEngine:
    """transformers in this process: the target (skinny GEMM) and the drafter methods, batch 1."""

    def __init__(self, specs: list[MethodSpec], target: str, threads: int):
        import torch

        from hf_retrace.bench.methods import Method
        from hf_retrace.bench.methods import MethodSpec as BenchSpec
        from hf_retrace.bench.run import load_target
        from hf_retrace.skinny_gemm import DEFAULT_TUNE_ROWS, enable_skinny_gemm, enable_skinny_gemm_where_it_pays

        torch.set_num_threads(threads)
        self.torch = torch
        self.target, self.tokenizer = load_target(target, torch.float32, "cpu")
        self.methods = {}
        for spec in specs:
            kind = "drafter" if spec.kind == "drafter" else "ar"
            self.methods[spec.name] = Method(BenchSpec(spec.name, kind, spec.card), torch.float32, "cpu")
        enable_skinny_gemm_where_it_pays(self.target, DEFAULT_TUNE_ROWS, "target")
        for method in self.methods.values():
            if method.drafter is not None:
                enable_skinny_gemm(method.drafter, tune_rows=DEFAULT_TUNE_ROWS)

    def warmup(self, prompt: list[int]) -> None:
        for method in self.methods.values():  # kernels, and the drafter's datastore index
            method.run(self.target, self.torch.tensor([prompt]), {"max_new_tokens": 16, "do_sample": False}, "w", 0)

    def generate(self, name: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int], float]:
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False}
        g = self.methods[name].run(self.target, self.torch.tensor([prompt]), kwargs, "", 0)
        cycles = g.acceptance_lengths if self.methods[name].drafter is not None else g.acceptance_lengths[1:]
        return g.token_ids, cycles, g.seconds  # ar: its first "cycle" is the prefill


def encode_prompts(tokenizer, num_per_set: int, seed: int) -> list[Prompt]:
    from hf_retrace.bench.run import encode_prompt_set

    prompts = []
    for group, sets in GROUPS.items():
        for name in sets:
            for index, ids in enumerate(encode_prompt_set(name, num_per_set, tokenizer, seed)):
                prompts.append(Prompt(group, name, index, ids[0].tolist()))
    return prompts


# untimed warmup request: token ids of no benched prompt, so a method that learns from past requests (vLLM's suffix
# decoding adds every prompt and response to its tree) learns nothing about the prompts it is then timed on
WARMUP_TOKEN_IDS = list(range(1000, 1032))


def run_vllm_block(spec, worker, chunk, concurrencies, max_new_tokens, round_index) -> list[Batch]:
    """`chunk` on a fresh `worker` at each of `concurrencies` (the main loop passes one). One engine per
    concurrency: otherwise suffix decoding, which keeps every response in its tree, would meet at concurrency 8 the
    very responses it produced at concurrency 1 (tau 3.5 instead of 1.4 in a run that reused the engine)."""
    batches = []
    worker.generate([WARMUP_TOKEN_IDS], 16)
    for c in concurrencies:
        for group in concurrent_batches(chunk, c):
            reply = worker.generate([p.token_ids for p in group], max_new_tokens)
            batches.append(Batch(spec.name, "vllm", c, round_index, [(p.group, p.prompt_set, p.index) for p in group],
                                 [o["token_ids"] for o in reply["outputs"]], [o["cycles"] for o in reply["outputs"]],
                                 reply["seconds"], reply["counters"]))  # fmt: skip
    return batches


def _vllm_block(spec, config, chunk, concurrency, round_index, args, output_dir, run_info, skipped) -> list[Batch]:
    """One vLLM engine for `spec` at one concurrency on `chunk`; a worker that fails to start or dies loses that block
    only (the method is skipped there, with a line saying why)."""
    log = output_dir / "logs" / f"{spec.name}-round{round_index}-c{concurrency}.log"
    worker = None
    try:
        worker = VllmWorker(args.target, config, log, args.vllm_threads_bind)
        run_info["vllm"] = worker.info.get("vllm")
        run_info["vllm_startup_s"].append([spec.name, round_index + 1, round(worker.info.get("startup_s", 0.0), 1)])
        return run_vllm_block(spec, worker, chunk, [concurrency], args.max_new_tokens, round_index)
    except RuntimeError as error:
        skipped.append(f"{spec.name} round {round_index + 1} concurrency {concurrency}: {error} (log {log})")
        where = f"round {round_index + 1} at concurrency {concurrency}"
        print(f"skipping {spec.name} in {where}: {error}", file=sys.stderr)
        return []
    finally:
        if worker is not None:
            worker.close()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--methods", default=ALL_METHODS, help=f"comma separated (default: {ALL_METHODS})")
    parser.add_argument("--num-prompts-per-set", type=int, default=8, help="prompts of each of the 5 sets")
    parser.add_argument("--quick", action="store_true", help="development: 2 prompts a set, 1 round")
    parser.add_argument("--concurrency", default="1,8", help="vLLM requests submitted at once; transformers: 1 only")
    parser.add_argument("--rounds", type=int, default=2, help="prompt chunks; methods rotate per chunk")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="a save_pretrained folder (both engines)")
    parser.add_argument("--prompt-seed", type=int, default=10_000, help="evaluation seeds start at 10000")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--output-dir", default="runs/serving")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        specs = parse_methods(args.methods)
        concurrencies = parse_concurrency(args.concurrency)
    except ValueError as error:
        parser.error(str(error))
    if args.quick:
        args.num_prompts_per_set, args.rounds = 2, 1
    if args.num_prompts_per_set < 1:
        parser.error("--num-prompts-per-set must be >= 1")
    if not Path(args.target, "config.json").is_file():
        parser.error(f"--target {args.target} has no config.json (make the default with "
                     "`.venv/bin/python -c 'from hf_retrace.data.assets import load_default_target as l; l()'`)")
    output_dir = Path(args.output_dir)
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    skipped, vllm_specs, configs = [], [], {}
    for spec in (s for s in specs if s.engine == "vllm"):
        why = vllm_available()
        if why is None and spec.kind == "dflash":
            why = plugin_available() or export_card(spec.card, output_dir / "exports" / Path(spec.card).name)
        if why is not None:
            skipped.append(f"{spec.name}: {why}")
            print(f"skipping {spec.name}: {why}", file=sys.stderr)
            continue
        vllm_specs.append(spec)
        configs[spec.name] = spec.speculative_config(str(output_dir / "exports" / Path(spec.card or "").name))
    hf_specs = [s for s in specs if s.engine == "hf"]
    hf = HfEngine(hf_specs, args.target, args.torch_threads)
    prompts = encode_prompts(hf.tokenizer, args.num_prompts_per_set, args.prompt_seed)
    if hf_specs:
        hf.warmup(prompts[0].token_ids)
    methods = hf_specs + vllm_specs
    batches, started = [], time.perf_counter()
    run_info = _run_info(args, methods, configs, concurrencies)
    for r, chunk in enumerate(chunk_rounds(prompts, args.rounds)):
        for spec in rotated(methods, r):
            print(f"round {r + 1}/{args.rounds}: {spec.name} on {len(chunk)} prompts", file=sys.stderr, flush=True)
            if spec.engine == "hf":
                for p in chunk:
                    tokens, cycles, seconds = hf.generate(spec.name, p.token_ids, args.max_new_tokens)
                    batches.append(Batch(spec.name, "hf", 1, r, [(p.group, p.prompt_set, p.index)], [tokens],
                                         [cycles], seconds))  # fmt: skip
                write_results(output_dir, batches, run_info, skipped)
                continue
            for c in concurrencies:  # a fresh engine per concurrency: see `run_vllm_block`
                batches += _vllm_block(spec, configs[spec.name], chunk, c, r, args, output_dir, run_info, skipped)
            write_results(output_dir, batches, run_info, skipped)  # a killed run keeps the blocks it finished
    run_info["wall_s"], run_info["complete"] = time.perf_counter() - started, True
    failures, rows = write_results(output_dir, batches, run_info, skipped)
    print(render_markdown(rows, run_info, failures, skipped))
    print(f"wrote {output_dir / 'results.json'} and results.md")
    if failures:
        print("LOSSLESS CHECK FAILED:\n  " + "\n  ".join(f["message"] for f in failures), file=sys.stderr)
        return 1
    return 0


def write_results(output_dir: Path, batches: list[Batch], run_info: dict, skipped: list[str]):
    """Checks, summarizes and writes `results.json` / `results.md` for the batches so far; (failures, rows)."""
    failures = check_lossless(batches)
    rows = summarize(batches, failures)
    write_outputs(output_dir, rows, batches, run_info, failures, skipped)
    return failures, rows


def _run_info(args, methods, configs, concurrencies) -> dict:
    import torch
    import transformers

    return {
        "target": args.target, "max_new_tokens": args.max_new_tokens, "prompts_per_set": args.num_prompts_per_set,
        "prompt_seed": args.prompt_seed, "groups": GROUPS, "rounds": args.rounds, "concurrency": concurrencies,
        "methods": [asdict(s) for s in methods], "speculative_configs": configs,
        "torch_threads": args.torch_threads, "vllm_threads_bind": args.vllm_threads_bind,
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "vllm": None, "vllm_startup_s": [], "wall_s": None,
        "complete": False,  # until the run ends: a run still going, or killed, leaves partial results
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

"""`hf-retrace bench`: acceptance length, speed and the lossless check of several decoding methods, one process.

Usage:

    hf-retrace bench --target default --num-threads 1 \
        --methods ar,prompt_lookup,dflash=drafters/smollm2-b16,retrace=drafters/smollm2-b16 \
        --prompt-sets gsm_symbolic:20,humaneval:20 --max-new-tokens 256 --output-dir runs/bench

Methods (comma separated; `ar` is added first when missing, it is the reference):

    ar                    target-only decoding
    prompt_lookup[=K]     transformers' prompt lookup decoding, `prompt_lookup_num_tokens=K` (default 10)
    dflash=FOLDER         the drafter in FOLDER run with `retrace_mode="off"` (plain DFlash)
    NAME=FOLDER[:MODE]    the drafter in FOLDER, as saved or with `retrace_mode` MODE (off|overwrite|gated|corrected)

Prompt sets: `NAME[:COUNT]` with NAME a set of `hf_retrace.prompts.load_prompts` (chat prompts, evaluation seeds
`>= 10000`), a `.jsonl` of `{"prompt"}`/`{"messages"}` records, or a `.jsonl` of `{"input_ids": [...]}` records
(token ids used as is; for targets without a tokenizer).

Measurement (DESIGN §4): every method runs on the same prompts in this process, interleaved (for each prompt, every
method in an order rotated by one per prompt) so that machine noise hits all alike, after one warmup generation per
method. tau is pooled over verification cycles: committed tokens (bonus included) summed over all cycles of all
prompts, divided by the number of cycles. For drafters a cycle is a verification of a drafted block (the drafter's
`last_generation_stats`); for `ar` and `prompt_lookup` every target forward is a cycle. Greedy outputs must equal
`ar`'s token for token; any difference fails the run (exit code 1) after the results are written, naming the method,
the prompt, the first differing index and the target's logit gap between the two tokens there. The default dtype is
fp32: in bf16, near-tie logits (a gap of one unit in the last place) can break differently in a block verification
and a one-token decode step, which is numerics, not a lossless bug (seen on SmolLM2-135M).

Outputs in `--output-dir`: `results.json` (`results`: one row per method x prompt set plus `pooled`), `results.md`,
`tau.png`, `acceptance_histograms.png`.
"""

import argparse
import contextlib
import copy
import importlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .configuration_retrace import RETRACE_MODES
from .modeling_retrace import ReTraceDrafterModel
from .plots import plot_acceptance_histograms, plot_tau
from .prompts import EVAL_SEED_OFFSET, load_prompts


TAU_NOTE = (
    "tau is pooled over cycles: committed tokens (bonus included) summed over all verification cycles of all "
    "prompts, divided by the number of cycles"
)
DEFAULT_LOOKUP_TOKENS = 10
REFERENCE = "ar"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class MethodSpec:
    """One `--methods` entry. `kind` is `ar`, `prompt_lookup` or `drafter`; `retrace_mode=None` keeps the saved one."""

    name: str
    kind: str
    folder: str | None = None
    retrace_mode: str | None = None
    num_lookup_tokens: int = DEFAULT_LOOKUP_TOKENS


def parse_methods(text: str) -> list[MethodSpec]:
    """Parses `ar,prompt_lookup[=K],dflash=FOLDER,NAME=FOLDER[:MODE],...`; `ar` is prepended when absent."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, has_value, value = item.partition("=")
        if name == REFERENCE and not has_value:
            specs.append(MethodSpec(name, "ar"))
        elif name == "prompt_lookup":
            specs.append(
                MethodSpec(name, "prompt_lookup", num_lookup_tokens=int(value) if has_value else DEFAULT_LOOKUP_TOKENS)
            )
        elif has_value and value and name not in (REFERENCE, "pooled"):
            folder, mode = split_retrace_mode(value)
            if name == "dflash":
                if mode not in (None, "off"):
                    raise ValueError(
                        f"`dflash` always runs with retrace_mode='off'; name the method otherwise: {item}"
                    )
                mode = "off"
            specs.append(MethodSpec(name, "drafter", folder, mode))
        else:
            raise ValueError(
                f"cannot parse method {item!r}; expected ar, prompt_lookup[=K], dflash=FOLDER or NAME=FOLDER[:MODE]"
            )
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    if REFERENCE not in names:
        specs.insert(0, MethodSpec(REFERENCE, "ar"))
    return specs


def split_retrace_mode(value: str) -> tuple[str, str | None]:
    """`FOLDER:MODE` -> `(FOLDER, MODE)` when MODE is a retrace mode, else `(value, None)` (colons in paths stay)."""
    folder, sep, mode = value.rpartition(":")
    return (folder, mode) if sep and mode in RETRACE_MODES else (value, None)


def parse_prompt_sets(text: str) -> list[tuple[str, int | None]]:
    """`gsm_symbolic:20,humaneval,path.jsonl:10` -> `[("gsm_symbolic", 20), ("humaneval", None), ...]`."""
    sets = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.rpartition(":")
        sets.append((name, int(count)) if sep and count.isdigit() else (item, None))
    return sets


def prompt_set_label(name: str) -> str:
    return Path(name).stem if name.endswith(".jsonl") else name


def _is_token_id_file(name: str) -> bool:
    if not (name.endswith(".jsonl") and Path(name).is_file()):
        return False
    with open(name, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "{}")
    return "input_ids" in json.loads(first)


def encode_prompt_set(name: str, count: int | None, tokenizer, seed: int) -> list[torch.LongTensor]:
    """Prompts of one set as `[1, T]` token-id tensors (chat template with the generation prompt applied)."""
    if _is_token_id_file(name):
        with open(name, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [torch.tensor([record["input_ids"]], dtype=torch.long) for record in records[:count]]
    if tokenizer is None:
        raise ValueError(f"prompt set {name!r} is text but the target has no tokenizer; use a .jsonl of input_ids")
    conversations = load_prompts(name, num_prompts=count, seed=seed)
    return [
        tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        for conv in conversations
    ]


def load_target(target: str, dtype: torch.dtype, device: str):
    """`default` (SmolLM2-135M-Instruct, offline) or a `save_pretrained` folder; the tokenizer is optional there."""
    if target == "default":
        from .assets import load_default_target

        model, tokenizer = load_default_target(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
        has_tokenizer = any((Path(target) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(target) if has_tokenizer else None
    return model.to(device), tokenizer


def load_drafter(folder: str, retrace_mode: str | None, dtype: torch.dtype, device) -> ReTraceDrafterModel:
    """Loads a drafter folder, optionally overriding its `retrace_mode` (same weights)."""
    drafter = ReTraceDrafterModel.from_pretrained(folder, dtype=dtype)
    if retrace_mode is not None and retrace_mode != drafter.config.retrace_mode:
        config = copy.deepcopy(drafter.config)
        config.retrace_mode = retrace_mode
        drafter = ReTraceDrafterModel.from_pretrained(folder, config=config, dtype=dtype)
    return drafter.to(device).eval()


class TargetCycleRecorder:
    """Forward pre-hook on the target: tokens committed by each target forward (one forward = one cycle).

    Committed length before forward k: the prompt length for k = 0; afterwards the last committed token is the first
    input, at position `position_ids[0, 0]`, so the length is that position + 1. Cycle k committed the difference
    to the next forward's length (the final sequence length for the last one). Worked example, prompt of 7, ar:
    forwards start at lengths 7, 8 (position 7), 9 ... so each commits 1.
    """

    def __init__(self, target, prompt_length: int):
        self.prompt_length, self.lengths = prompt_length, []
        self._handle = target.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if not self.lengths:
            self.lengths.append(self.prompt_length)
            return
        position_ids = kwargs.get("position_ids")
        start = int(position_ids[0, 0]) if position_ids is not None else kwargs["cache"].get_seq_length()
        self.lengths.append(start + 1)

    def remove(self) -> None:
        self._handle.remove()

    def committed(self, final_length: int) -> list[int]:
        ends = self.lengths[1:] + [final_length]
        return [end - start for start, end in zip(self.lengths, ends)]


class ConditioningTimer:
    """Wall time ReTrace spends on conditioning while it is entered: reading the verification features, building the
    rejected trajectory, projecting its target features and the drafter's `retrace` submodule (perf_counter, with a
    CUDA sync around each span on GPU, which costs drafter methods a few syncs per cycle there). Wraps the generator's
    helpers for the duration only and restores them on exit; it changes no computation."""

    def __init__(self, drafter: ReTraceDrafterModel):
        self.drafter, self.seconds = drafter, 0.0
        self._generation = importlib.import_module(type(drafter).__module__.rsplit(".", 1)[0] + ".generation_retrace")
        self._trajectory_features = None
        self._restore, self._handles = [], []

    def _sync(self):
        if self.drafter.device.type == "cuda":
            torch.cuda.synchronize(self.drafter.device)

    def _timed(self, fn, keep_trajectory: bool = False):
        def wrapper(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.seconds += time.perf_counter() - start
            if keep_trajectory:
                self._trajectory_features = None if out is None else out.target_features
            return out

        return wrapper

    def _projection(self, project):
        timed = self._timed(project)

        def wrapper(features):  # only the projection of the trajectory's features is conditioning work
            return timed(features) if features is self._trajectory_features else project(features)

        return wrapper

    def _start(self, module, args):
        self._sync()
        self._span_start = time.perf_counter()

    def _stop(self, module, args, output):
        self._sync()
        self.seconds += time.perf_counter() - self._span_start

    def __enter__(self):
        gen, cls = self._generation, self._generation.ReTraceCandidateGenerator
        self._restore = [(gen, "build_rejected_trajectory", gen.build_rejected_trajectory)]
        self._restore.append((cls, "_verification_features", cls.__dict__["_verification_features"]))
        gen.build_rejected_trajectory = self._timed(gen.build_rejected_trajectory, keep_trajectory=True)
        cls._verification_features = self._timed(cls.__dict__["_verification_features"])
        self.drafter.project_context = self._projection(self.drafter.project_context)
        retrace = self.drafter.retrace
        self._handles = [retrace.register_forward_pre_hook(self._start), retrace.register_forward_hook(self._stop)]
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._restore:
            setattr(owner, name, original)
        del self.drafter.project_context
        for handle in self._handles:
            handle.remove()
        self._trajectory_features = None


@dataclass
class Generation:
    """One method on one prompt."""

    method: str
    prompt_set: str
    prompt_index: int
    token_ids: list[int]
    seconds: float
    acceptance_lengths: list[int]
    target_forwards: int
    conditioning_seconds: float = 0.0
    num_conditioned_rounds: int = 0


class Method:
    """A loaded `MethodSpec`: what to pass to `generate`, and how to read its cycles."""

    def __init__(self, spec: MethodSpec, dtype: torch.dtype, device):
        self.spec, self.name = spec, spec.name
        self.drafter = load_drafter(spec.folder, spec.retrace_mode, dtype, device) if spec.kind == "drafter" else None

    @property
    def block_size(self) -> int:
        """Most tokens one cycle can commit."""
        if self.drafter is not None:
            return self.drafter.config.block_size
        return self.spec.num_lookup_tokens + 1 if self.spec.kind == "prompt_lookup" else 1

    @property
    def retrace_mode(self) -> str | None:
        return None if self.drafter is None else self.drafter.config.retrace_mode

    def generate_kwargs(self) -> dict:
        if self.spec.kind == "prompt_lookup":
            return {"prompt_lookup_num_tokens": self.spec.num_lookup_tokens}
        return {"assistant_model": self.drafter} if self.drafter is not None else {}

    def run(self, target, input_ids: torch.LongTensor, generate_kwargs: dict, prompt_set: str, index: int):
        recorder = TargetCycleRecorder(target, input_ids.shape[1])
        timer = ConditioningTimer(self.drafter) if self.drafter is not None else None
        try:
            with timer if timer is not None else contextlib.nullcontext():
                _sync(target.device)
                start = time.perf_counter()
                output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs,
                                         **self.generate_kwargs())  # fmt: skip
                _sync(target.device)
                seconds = time.perf_counter() - start
        finally:
            recorder.remove()
        per_forward = recorder.committed(output.shape[1])
        stats = self.drafter.last_generation_stats if self.drafter is not None else None
        return Generation(
            method=self.name,
            prompt_set=prompt_set,
            prompt_index=index,
            token_ids=output[0, input_ids.shape[1] :].tolist(),
            seconds=seconds,
            acceptance_lengths=list(stats.acceptance_lengths) if stats is not None else per_forward,
            target_forwards=len(per_forward),
            conditioning_seconds=timer.seconds if timer is not None else 0.0,
            num_conditioned_rounds=stats.num_conditioned_rounds if stats is not None else 0,
        )


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_interleaved(target, methods, prompt_sets, generate_kwargs, seed=None, progress=True) -> list[Generation]:
    """Runs every method on every prompt; prompt k runs the methods rotated by k. `seed` (sampling) reseeds torch
    with `seed + k` before each generation so all methods start prompt k from the same RNG state."""
    first = next(ids for _, prompts in prompt_sets for ids in prompts)
    warmup = {**generate_kwargs, "max_new_tokens": min(16, generate_kwargs["max_new_tokens"])}
    for method in methods:
        method.run(target, first.to(target.device), warmup, "warmup", 0)
    total = len(methods) * sum(len(prompts) for _, prompts in prompt_sets)
    generations, k = [], 0
    with tqdm(total=total, desc="bench", unit="gen", disable=not progress) as bar:
        for label, prompts in prompt_sets:
            for index, input_ids in enumerate(prompts):
                for method in methods[k % len(methods) :] + methods[: k % len(methods)]:
                    bar.set_postfix_str(f"{label}#{index} {method.name}")
                    if seed is not None:
                        torch.manual_seed(seed + k)
                    generations.append(method.run(target, input_ids.to(target.device), generate_kwargs, label, index))
                    bar.update()
                k += 1
    return generations


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (a length difference counts), or `None` if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class LosslessFailure:
    """A greedy output that differs from `ar`'s: where, and the first differing generated token."""

    method: str
    prompt_set: str
    prompt_index: int
    index: int
    expected: int | None  # None: that output had already ended
    got: int | None
    logit_gap: float | None = None  # see `add_logit_gaps`

    def __str__(self) -> str:
        want, got = ("<end>" if t is None else t for t in (self.expected, self.got))
        gap = (
            ""
            if self.logit_gap is None
            else f"; target logit gap {REFERENCE} - {self.method} token: {self.logit_gap:.4g}"
        )
        return (
            f"method {self.method!r} on prompt {self.prompt_set}#{self.prompt_index}: first differing generated "
            f"token at index {self.index} ({REFERENCE}={want}, {self.method}={got}{gap})"
        )


def check_lossless(generations: list[Generation]) -> list[LosslessFailure]:
    """One failure per (method, prompt) whose greedy tokens differ from `ar`'s on the same prompt."""
    reference = {(g.prompt_set, g.prompt_index): g.token_ids for g in generations if g.method == REFERENCE}
    failures = []
    for g in generations:
        expected = reference[(g.prompt_set, g.prompt_index)]
        index = first_difference(expected, g.token_ids)
        if g.method != REFERENCE and index is not None:
            want = expected[index] if index < len(expected) else None
            got = g.token_ids[index] if index < len(g.token_ids) else None
            failures.append(LosslessFailure(g.method, g.prompt_set, g.prompt_index, index, want, got))
    return failures


@torch.no_grad()
def add_logit_gaps(target, prompt_sets, generations: list[Generation], failures: list[LosslessFailure]) -> None:
    """Sets `logit_gap` of each failure: the target's logit of `ar`'s token minus that of the method's token at the
    first differing position, from one full forward of the prompt and `ar`'s tokens before it. A gap of one unit in
    the last place (bf16: 0.0625 at |logit| 8..16) is a near-tie that block-vs-single-token numerics can flip; a
    large gap points to a bug."""
    prompts = {(label, i): ids for label, ids_list in prompt_sets for i, ids in enumerate(ids_list)}
    reference = {(g.prompt_set, g.prompt_index): g.token_ids for g in generations if g.method == REFERENCE}
    for failure in failures:
        if failure.expected is None or failure.got is None:
            continue
        key = (failure.prompt_set, failure.prompt_index)
        prefix = torch.tensor([reference[key][: failure.index]], dtype=torch.long)
        input_ids = torch.cat([prompts[key], prefix], dim=1).to(target.device)
        logits = target(input_ids, logits_to_keep=1).logits[0, -1].float()
        failure.logit_gap = (logits[failure.expected] - logits[failure.got]).item()


def summarize(
    generations: list[Generation], methods: list[Method], failures: list[LosslessFailure], greedy: bool
) -> list[dict]:
    """Rows per method x prompt set, then one `pooled` row per method; `speedup` is over `ar` on the same rows.
    `lossless` is `None` when sampling (not checked)."""
    labels = list(dict.fromkeys(g.prompt_set for g in generations))
    rows = []
    for label in labels + ["pooled"]:
        for method in methods:
            subset = [g for g in generations if g.method == method.name and label in ("pooled", g.prompt_set)]
            failed = any(f.method == method.name and label in ("pooled", f.prompt_set) for f in failures)
            rows.append(_row(method, label, subset, not failed if greedy else None))
    reference = {row["prompt_set"]: row["tokens_per_s"] for row in rows if row["method"] == REFERENCE}
    for row in rows:
        ref = reference.get(row["prompt_set"])
        row["speedup"] = row["tokens_per_s"] / ref if ref else None
    return rows


def _row(method: Method, label: str, subset: list[Generation], lossless: bool | None) -> dict:
    cycles = [n for g in subset for n in g.acceptance_lengths]
    histogram = [0] * max([method.block_size] + cycles)
    for n in cycles:
        histogram[n - 1] += 1
    seconds = sum(g.seconds for g in subset)
    new_tokens = sum(len(g.token_ids) for g in subset)
    conditioning = sum(g.conditioning_seconds for g in subset)
    is_drafter = method.drafter is not None
    return {
        "method": method.name,
        "prompt_set": label,
        "num_prompts": len(subset),
        "tau": sum(cycles) / len(cycles) if cycles else None,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "speedup": None,
        "acceptance_histogram": histogram,
        "conditioning_share": conditioning / seconds if is_drafter and seconds > 0 else None,
        "conditioning_ms_per_cycle": 1e3 * conditioning / len(cycles) if is_drafter and cycles else None,
        "cycle_ms": 1e3 * seconds / len(cycles) if cycles else None,
        "num_cycles": len(cycles),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "target_forwards": sum(g.target_forwards for g in subset),
        "num_conditioned_rounds": sum(g.num_conditioned_rounds for g in subset),
        "lossless": lossless,
        "block_size": method.block_size,
        "retrace_mode": method.retrace_mode,
        "drafter": method.spec.folder,
    }


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def render_markdown(rows: list[dict], run_info: dict, failures: list[LosslessFailure]) -> str:
    """The results table (tau pooled over cycles), acceptance histograms and any lossless failures, as markdown."""
    lines = [
        "# hf-retrace bench",
        "",
        (
            f"target `{run_info['target']}` ({run_info['dtype']}, {run_info['device']}, "
            f"{run_info['num_threads']} threads), {run_info['decoding']}, "
            f"max_new_tokens={run_info['max_new_tokens']}, methods interleaved per prompt."
        ),
        "",
        f"{TAU_NOTE}. Speedup = tokens/s over `ar` tokens/s on the same prompts in the same run.",
        "Conditioning share = ReTrace conditioning time / generation time (drafter methods only).",
        "",
        (
            "| method | prompt set | prompts | tau (pooled over cycles) | tokens/s | speedup | conditioning share "
            "| cycles | new tokens | lossless |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lossless = {None: "n/a (sampling)", True: "yes", False: "**NO**"}[r["lossless"]]
        lines.append(
            f"| {r['method']} | {r['prompt_set']} | {r['num_prompts']} | {_fmt(r['tau'], '.3f')} "
            f"| {_fmt(r['tokens_per_s'], '.2f')} | {_fmt(r['speedup'], '.3f', 'x')} "
            f"| {_fmt(_percent(r['conditioning_share']), '.2f', '%')} "
            f"| {r['num_cycles']} | {r['new_tokens']} | {lossless} |"
        )
    lines += ["", "## Acceptance-length histograms (pooled over cycles of all prompts)", ""]
    lines += ["| method | counts of committed tokens per cycle (length:count) |", "|---|---|"]
    for r in rows:
        if r["prompt_set"] == "pooled":
            counts = " ".join(f"{i + 1}:{c}" for i, c in enumerate(r["acceptance_histogram"]))
            lines.append(f"| {r['method']} | {counts} |")
    if failures:
        lines += ["", "## LOSSLESS CHECK FAILED", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def write_outputs(output_dir: Path, rows, generations, run_info, failures) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    per_prompt = [
        {k: v for k, v in asdict(g).items() if k != "token_ids"} | {"new_tokens": len(g.token_ids)}
        for g in generations
    ]
    payload = {
        "run": run_info,
        "tau_definition": TAU_NOTE,
        "results": rows,
        "lossless_failures": [asdict(f) | {"message": str(f)} for f in failures],
        "generations": per_prompt,
    }
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (output_dir / "results.md").write_text(render_markdown(rows, run_info, failures))
    plot_tau(rows, output_dir / "tau.png")
    plot_acceptance_histograms(rows, output_dir / "acceptance_histograms.png")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--target", default="default", help="`default` (SmolLM2-135M-Instruct) or a model folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="fp32: exact lossless check")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", default="ar", help="ar,prompt_lookup[=K],dflash=FOLDER,NAME=FOLDER[:MODE]")
    parser.add_argument("--prompt-sets", default="gsm_symbolic:20", help="NAME[:COUNT],... (see module doc)")
    parser.add_argument("--prompt-seed", type=int, default=EVAL_SEED_OFFSET, help="evaluation seeds start at 10000")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--do-sample", action="store_true", help="sampling: no lossless check, tau and speed only")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42, help="sampling seed (prompt k reseeds with seed + k)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (1 avoids oversubscription)")
    parser.add_argument("--output-dir", default="bench_results")
    parser.add_argument("--no-progress", action="store_true")
    return parser


@contextlib.contextmanager
def torch_threads(num_threads: int | None):
    """Sets torch's CPU thread count for the block (None: leave it), then restores it. On shared machines 1 thread
    avoids oversubscription, which can slow decoding down several times."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    with torch_threads(args.num_threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype]
    target, tokenizer = load_target(args.target, dtype, args.device)
    methods = [Method(spec, dtype, target.device) for spec in parse_methods(args.methods)]
    prompt_sets = [(prompt_set_label(name), encode_prompt_set(name, count, tokenizer, args.prompt_seed))
                   for name, count in parse_prompt_sets(args.prompt_sets)]  # fmt: skip
    generate_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    if args.do_sample:
        generate_kwargs["temperature"] = args.temperature
    seed = args.seed if args.do_sample else None
    generations = run_interleaved(target, methods, prompt_sets, generate_kwargs, seed, not args.no_progress)
    failures = [] if args.do_sample else check_lossless(generations)
    add_logit_gaps(target, prompt_sets, generations, failures)
    rows = summarize(generations, methods, failures, greedy=not args.do_sample)
    run_info = {
        "target": args.target,
        "dtype": args.dtype,
        "device": str(target.device),
        "num_threads": torch.get_num_threads(),
        "decoding": f"sampling (temperature={args.temperature}, seed={args.seed})" if args.do_sample else "greedy",
        "max_new_tokens": args.max_new_tokens,
        "methods": [asdict(m.spec) for m in methods],
        "prompt_sets": args.prompt_sets,
        "prompt_seed": args.prompt_seed,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    output_dir = Path(args.output_dir)
    write_outputs(output_dir, rows, generations, run_info, failures)
    print(render_markdown(rows, run_info, failures))
    print(f"wrote {output_dir / 'results.json'}, results.md, tau.png, acceptance_histograms.png")
    if failures:
        print("LOSSLESS CHECK FAILED:\n  " + "\n  ".join(map(str, failures)), file=sys.stderr)
        print("(a logit gap of about one bf16 unit in the last place is a near-tie that block and single-token "
              "forwards may break differently; rerun with --dtype fp32 to tell numerics from a bug)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

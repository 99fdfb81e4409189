"""Results of `hf-retrace bench`: the lossless check against `ar`, the results rows (tau pooled over cycles, speed,
conditioning share), and the outputs `results.json`, `results.md`, `tau.png`, `acceptance_histograms.png`.

Definitions (tau, speedup, the lossless check): `hf_retrace.bench.run` module docstring.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .methods import REFERENCE, Generation, Method
from .plots import plot_acceptance_histograms, plot_tau
from .stats import render_paired_markdown


TAU_NOTE = (
    "tau is pooled over cycles: committed tokens (bonus included) summed over all verification cycles of all "
    "prompts, divided by the number of cycles"
)


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


def render_markdown(
    rows: list[dict], run_info: dict, failures: list[LosslessFailure], paired: list[dict] | None = None
) -> str:
    """The results table (tau pooled over cycles), the paired tau ratios (if any), acceptance histograms and any
    lossless failures, as markdown."""
    lines = [
        "# hf-retrace bench",
        "",
        (
            f"target `{run_info['target']}` ({run_info['dtype']}, {run_info['device']}, "
            f"{run_info['num_threads']} threads), {run_info['decoding']}, "
            f"max_new_tokens={run_info['max_new_tokens']}, "
            f"draft logits {run_info.get('draft_logits_dtype') or 'as each drafter config says'}, "
            f"{'skinny GEMM' if run_info.get('skinny_gemm') else 'stock'} linears, methods interleaved per prompt."
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
    if paired:
        lines += ["", render_paired_markdown(paired)]
    lines += ["", "## Acceptance-length histograms (pooled over cycles of all prompts)", ""]
    lines += ["| method | counts of committed tokens per cycle (length:count) |", "|---|---|"]
    for r in rows:
        if r["prompt_set"] == "pooled":
            counts = " ".join(f"{i + 1}:{c}" for i, c in enumerate(r["acceptance_histogram"]))
            lines.append(f"| {r['method']} | {counts} |")
    if failures:
        lines += ["", "## LOSSLESS CHECK FAILED", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def write_outputs(output_dir: Path, rows, generations, run_info, failures, paired: list[dict] | None = None) -> None:
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
        "paired_tau": paired or [],
        "generations": per_prompt,
    }
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (output_dir / "results.md").write_text(render_markdown(rows, run_info, failures, paired))
    plot_tau(rows, output_dir / "tau.png")
    plot_acceptance_histograms(rows, output_dir / "acceptance_histograms.png")

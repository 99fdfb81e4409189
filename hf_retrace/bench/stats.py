"""Paired comparison of tau between methods of one bench run: the ratio of pooled tau with a bootstrap interval.

All methods of a bench run decode the same prompts, so a comparison is paired. The unit of resampling is the prompt,
not the cycle: the cycles of one prompt share its text and are correlated, so a per-cycle interval would be too
narrow. Each resample draws the prompts with replacement, recomputes both methods' pooled tau (committed tokens
summed over the drawn prompts' cycles / their number of cycles) and takes the ratio; the 95% interval is the 2.5th
and 97.5th percentiles. A ratio whose interval contains 1 is a difference this run cannot tell from prompt noise.

    python -m hf_retrace.bench.stats results/retrace/phase2/results.json --baseline control
"""

import argparse
import json
import random
from pathlib import Path


def paired_tau_ratio(
    generations: list[dict], method: str, baseline: str, num_resamples: int = 2000, seed: int = 0
) -> dict:
    """tau(method) / tau(baseline) on their common prompts, with a 95% paired-bootstrap interval over prompts.

    Args:
        generations (`list[dict]`): per-prompt records with `method`, `prompt_set`, `prompt_index` and
            `acceptance_lengths` (committed tokens per cycle), as in `results.json["generations"]`.
    Returns:
        `dict` with `method`, `baseline`, `num_prompts`, `tau`, `baseline_tau`, `ratio` and `ci95` (`[low, high]`).
    """
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    ours, theirs = _cycles_by_prompt(generations, method), _cycles_by_prompt(generations, baseline)
    prompts = sorted(ours.keys() & theirs.keys())
    if not prompts:
        raise ValueError(f"methods {method!r} and {baseline!r} share no prompt with cycles; check the method names")
    # per prompt: (tokens, cycles) of each method; pooled tau of a set of prompts = sum tokens / sum cycles
    stats = [(sum(ours[p]), len(ours[p]), sum(theirs[p]), len(theirs[p])) for p in prompts]
    rng = random.Random(seed)
    ratios = sorted(
        _ratio([stats[rng.randrange(len(stats))] for _ in stats]) for _ in range(num_resamples)
    )  # fmt: skip
    low, high = ratios[int(0.025 * num_resamples)], ratios[max(int(0.975 * num_resamples) - 1, 0)]
    tau, baseline_tau = _tau(stats, 0), _tau(stats, 2)
    return {
        "method": method,
        "baseline": baseline,
        "num_prompts": len(prompts),
        "tau": tau,
        "baseline_tau": baseline_tau,
        "ratio": tau / baseline_tau,
        "ci95": [low, high],
    }


def paired_tau_table(generations: list[dict], baseline: str, **kwargs) -> list[dict]:
    """[`paired_tau_ratio`] of every other method of the run against `baseline`, in run order."""
    methods = list(dict.fromkeys(g["method"] for g in generations))
    if baseline not in methods:
        raise ValueError(f"baseline {baseline!r} is not a method of this run; methods: {methods}")
    return [paired_tau_ratio(generations, m, baseline, **kwargs) for m in methods if m != baseline]


def render_paired_markdown(table: list[dict]) -> str:
    """The table as markdown lines (no trailing newline)."""
    if not table:
        return ""
    lines = [
        f"## tau relative to `{table[0]['baseline']}` (paired bootstrap over prompts, 95% interval)",
        "",
        "| method | prompts | tau | baseline tau | ratio | 95% interval |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in table:
        low, high = r["ci95"]
        lines.append(
            f"| {r['method']} | {r['num_prompts']} | {r['tau']:.3f} | {r['baseline_tau']:.3f} "
            f"| {r['ratio']:.3f} | [{low:.3f}, {high:.3f}] |"
        )
    return "\n".join(lines)


def _cycles_by_prompt(generations: list[dict], method: str) -> dict[tuple[str, int], list[int]]:
    return {
        (g["prompt_set"], g["prompt_index"]): g["acceptance_lengths"]
        for g in generations
        if g["method"] == method and g["acceptance_lengths"]
    }


def _tau(stats, offset: int) -> float:
    return sum(s[offset] for s in stats) / sum(s[offset + 1] for s in stats)


def _ratio(stats) -> float:
    return _tau(stats, 0) / _tau(stats, 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_retrace.bench.stats", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a results.json written by `hf-retrace bench`")
    parser.add_argument("--baseline", required=True, help="method name to compare against (e.g. control)")
    parser.add_argument("--num-resamples", type=int, default=2000)
    args = parser.parse_args(argv)
    generations = json.loads(args.results.read_text())["generations"]
    print(render_paired_markdown(paired_tau_table(generations, args.baseline, num_resamples=args.num_resamples)))


if __name__ == "__main__":
    main()

"""Tables of a vLLM step log (`HF_RETRACE_VLLM_STEP_LOG`, docs/cost-aware-speculation.md, "The step log").

    .venv/bin/python benchmarks/diagnostics/step_log_table.py steps.jsonl [--min-decoding 30] [--split | --group K]
    .venv/bin/python benchmarks/diagnostics/step_log_table.py steps.jsonl --prices

Default: the decode steps (no prefill rows) of at least `--min-decoding` requests, grouped by `(verifying,
verified)`: how many, and the engine's part of their time (`target_s` less the proposer's `propose_s`, the drafter
forward within it given back), median and mean. `--split`: the log's prompt groups apart (the serving bench runs
pool_eval, then unseen, on one engine: a group starts at a step that prefills while at most two requests decode),
each with its steps and seconds, and for its
decode steps of at least `--min-decoding` requests the verified rows, accepted tokens and ms a committed token.
`--group K`: the default table over group `K` alone (0: pool_eval, 1: unseen).
`--prices`: what a verified row cost beside what the step-cost model priced it, by how many requests decoded: per
bucket of decode steps, the least-squares slope in verified rows of the measured `target_s` and of the model's
`predicted_s`, both on `[1, requests, verified rows, K]` (the first rows' contexts held apart), so each slope is a
verified row's price at its bucket's load, its context included.
`--arms`: the load fallback's two arms (fallback.py) by quarter-octave load bucket: the decode steps whose plan and
previous plan were both plain or both speculating (the log's `plain`), each arm's steps and ms per committed token
(the whole step, `target_s + drafter_s`, summed over the tokens summed), with a bootstrap 95% interval of plain over
speculating.
"""

import argparse
import gzip
import json
import statistics
from collections import defaultdict

import numpy as np


BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 1024))  # requests decoding in a step


def read(path: str) -> list[dict]:
    """The steps of a log, plain or gzipped (`.gz`, as the records under results/ keep them)."""
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def engine_ms(step: dict) -> float:
    """The engine's part of a step, ms: `target_s` is the whole step less the drafter's forward (`costs.step_costs`),
    so the proposer's `propose_s` is taken out and its drafter forward, inside it, given back."""
    return (step["target_s"] - step["propose_s"] + step["drafter_s"]) * 1e3


def by_rows(steps: list[dict], min_decoding: int) -> None:
    groups = defaultdict(list)
    for s in steps:
        if s["prefill_rows"] == 0 and s["decoding"] >= min_decoding:
            groups[(s["verifying"], s["verified"])].append(engine_ms(s))
    print("| verifying | verified rows | steps | engine ms, median | mean |\n|---:|---:|---:|---:|---:|")
    for (m, v), times in sorted(groups.items()):
        print(f"| {m} | {v} | {len(times)} | {statistics.median(times):.1f} | {statistics.fmean(times):.1f} |")


def split_groups(steps: list[dict]) -> list[list[dict]]:
    starts = [i for i, s in enumerate(steps) if s["prefill_rows"] > 0 and s["decoding"] <= 2]
    starts = [i for j, i in enumerate(starts) if j == 0 or i > starts[j - 1] + 1]  # a group's first prefill step
    bounds = starts + [len(steps)]
    return [steps[a:b] for a, b in zip(bounds, bounds[1:])]


def by_group(steps: list[dict], min_decoding: int) -> None:
    print("| group | steps | seconds | decode steps | requests | verified rows | accepted | ms / committed token |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, group in enumerate(split_groups(steps)):
        seconds = sum(s["target_s"] + s["drafter_s"] for s in group)
        decode = [s for s in group if s["prefill_rows"] == 0 and s["decoding"] >= min_decoding]
        committed = sum(s["committed"] for s in decode)
        accepted = committed - sum(s["decoding"] for s in decode)
        ms = sum(s["target_s"] + s["drafter_s"] for s in decode) * 1e3 / max(committed, 1)
        requests = statistics.fmean(s["decoding"] for s in decode) if decode else 0.0
        verified = sum(s["verified"] for s in decode)
        print(f"| {k} | {len(group)} | {seconds:.1f} | {len(decode)} | {requests:.1f} | {verified} | {accepted} | "
              f"{ms:.2f} |")


def bucket_slopes(steps: list[dict], fields) -> list[tuple[str, list[dict], list[float]]]:
    """Per bucket of `BUCKETS` with at least 10 decode steps that all have `fields`: `(name, steps, slopes)`, a slope
    in ms a verified row per field, from the least squares of `field` on requests, verified rows and the first rows'
    contexts."""
    out = []
    for low, high in BUCKETS:
        chosen = [s for s in steps if s["prefill_rows"] == 0 and low <= s["decoding"] <= high and fields[-1] in s]
        if len(chosen) < 10:
            continue
        columns = np.array([[1.0, s["decoding"], s["verified"], s["context"][0]] for s in chosen])
        times = np.array([[s[field] for field in fields] for s in chosen]) * 1e3  # [steps, fields]
        slopes = np.linalg.lstsq(columns, times, rcond=None)[0][2]
        out.append((f"{low}-{high}" if high > low else str(low), chosen, [float(x) for x in slopes]))
    return out


def verified_row_prices(steps: list[dict]) -> list[dict]:
    """Per bucket of `BUCKETS` with at least 10 decode steps: `steps`, mean verified rows, mean context of a verified
    row (`X / V`), and the slopes in ms a verified row, `measured` (of `target_s`) and `model` (of `predicted_s`)."""
    out = []
    for name, chosen, (measured, model) in bucket_slopes(steps, ("target_s", "predicted_s")):
        verified = sum(s["verified"] for s in chosen)
        out.append({"requests": name, "steps": len(chosen), "verified": verified / len(chosen),
                    "context": sum(s["context"][1] for s in chosen) / max(verified, 1),
                    "measured": measured, "model": model})  # fmt: skip
    return out


def by_price(steps: list[dict], min_decoding: int) -> None:
    print("| requests decoding | steps | verified rows a step | context of a verified row | ms a verified row, "
          "measured | priced by the model |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for row in verified_row_prices(steps):
        print(f"| {row['requests']} | {row['steps']} | {row['verified']:.1f} | {row['context']:.0f} | "
              f"{row['measured']:.2f} | {row['model']:.2f} |")


def arm_samples(steps: list[dict]) -> dict:
    """`{(load bucket, arm): [(ms, committed tokens)]}` of the decode steps whose two plans shared an arm."""
    samples = defaultdict(list)
    for previous, step in zip(steps, steps[1:]):
        if "plain" not in step or step["prefill_rows"] or not step["decoding"] or step["committed"] <= 0:
            continue
        if previous.get("plain") == step["plain"]:
            key = round(4 * np.log2(step["decoding"]))
            arm = "plain" if step["plain"] else "speculate"
            samples[key, arm].append(((step["target_s"] + step["drafter_s"]) * 1e3, step["committed"]))
    return samples


def per_token(pairs: np.ndarray) -> float:
    """Milliseconds summed over tokens summed, of `[n, 2]` `(ms, committed)` rows: a median of each step's ratio
    would misprice a speculating step's spread of 1 to `1 + K` tokens a request (the load fallback's docstring)."""
    return float(pairs[:, 0].sum() / pairs[:, 1].sum())


def by_arm(steps: list[dict], min_decoding: int) -> None:
    samples, rng = arm_samples(steps), np.random.default_rng(0)
    print("| load bucket (requests) | speculating steps | ms a token | plain steps | ms a token | plain / speculating "
          "[95%] |\n|---|---:|---:|---:|---:|---|")  # fmt: skip
    for key in sorted({k for k, _ in samples}):
        spec, plain = np.array(samples.get((key, "speculate"), [])), np.array(samples.get((key, "plain"), []))
        if 2 ** (key / 4) < min_decoding or len(spec) < 2 or len(plain) < 2:
            continue
        boot = [per_token(plain[rng.integers(0, len(plain), len(plain))])
                / per_token(spec[rng.integers(0, len(spec), len(spec))]) for _ in range(2000)]  # fmt: skip
        low, high = np.percentile(boot, [2.5, 97.5])
        requests = f"{2 ** ((key - 0.5) / 4):.1f}-{2 ** ((key + 0.5) / 4):.1f}"
        print(f"| {key} ({requests}) | {len(spec)} | {per_token(spec):.2f} | {len(plain)} | {per_token(plain):.2f} | "
              f"{per_token(plain) / per_token(spec):.3f} [{low:.3f}, {high:.3f}] |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--min-decoding", type=int, default=16, help="decode steps of at least this many requests")
    parser.add_argument("--split", action="store_true", help="the log's prompt groups apart")
    parser.add_argument("--group", type=int, default=None, help="only this prompt group (0: the first)")
    parser.add_argument("--prices", action="store_true", help="a verified row's cost beside the model's price")
    parser.add_argument("--arms", action="store_true", help="plain against speculating steps, by load")
    args = parser.parse_args()
    steps = read(args.log)
    if args.group is not None:
        steps = split_groups(steps)[args.group]
    table = by_arm if args.arms else by_price if args.prices else by_group if args.split else by_rows
    table(steps, args.min_decoding)


if __name__ == "__main__":
    main()

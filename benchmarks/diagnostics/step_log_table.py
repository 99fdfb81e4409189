"""Tables of a vLLM step log (`HF_RETRACE_VLLM_STEP_LOG`, docs/cost-aware-speculation.md, "The step log").

    .venv/bin/python benchmarks/diagnostics/step_log_table.py steps.jsonl [--min-decoding 30] [--split | --group K]

Default: the decode steps (no prefill rows) of at least `--min-decoding` requests, grouped by `(verifying,
verified)`: how many, and the engine's part of their time (`target_s` less the proposer's `propose_s`), median and
mean. `--split`: the log's prompt groups apart (the serving bench runs pool_eval, then unseen, on one engine: a group
starts at a step that prefills while at most two requests decode), each with its steps and seconds, and for its
decode steps of at least `--min-decoding` requests the verified rows, accepted tokens and ms a committed token.
`--group K`: the default table over group `K` alone (0: pool_eval, 1: unseen).
"""

import argparse
import json
import statistics
from collections import defaultdict


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def by_rows(steps: list[dict], min_decoding: int) -> None:
    groups = defaultdict(list)
    for s in steps:
        if s["prefill_rows"] == 0 and s["decoding"] >= min_decoding:
            groups[(s["verifying"], s["verified"])].append((s["target_s"] - s["propose_s"]) * 1e3)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--min-decoding", type=int, default=16, help="decode steps of at least this many requests")
    parser.add_argument("--split", action="store_true", help="the log's prompt groups apart")
    parser.add_argument("--group", type=int, default=None, help="only this prompt group (0: the first)")
    args = parser.parse_args()
    steps = read(args.log)
    if args.group is not None:
        steps = split_groups(steps)[args.group]
    (by_group if args.split else by_rows)(steps, args.min_decoding)


if __name__ == "__main__":
    main()

"""Replays a vLLM step log (`HF_RETRACE_VLLM_STEP_LOG`) through the step-cost model: what this code's model would
have predicted for each step, and a verified row's price by load beside what it cost (docs/cost-aware-speculation.md).

    .venv/bin/python benchmarks/diagnostics/replay_step_log.py steps.jsonl.gz [--profile-ms 40.5 --profile-row-ms 1.2]

The model starts from a batch-1 profile, `t(R) = profile_ms + profile_row_ms * (R - 1)` at R = 1, 2, 3, 4, 6, 8 (the
serving bench's first engine profiles up to its 1 + K rows), then learns from every step in the log's order, as the
plugin does (`observe`, the decode steps kept for the terms' fit; steps slower than 5x the prediction skipped). A log
of several engines (the serving bench: one per concurrency, in order) is cut where the largest batch of a prompt
group changes; each engine starts from the model the previous one left, with its step window and knot counts
fresh, as a cache file carries them.

Printed per bucket of requests decoding, as `step_log_table.py --prices`: the least-squares slope in verified rows of
the measured target time, of the logged prediction (the model that ran) and of the replayed one, and the replayed
prediction's mean absolute error and bias, ms.
"""

import argparse
import sys
from pathlib import Path

import numpy as np


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from step_log_table import bucket_slopes, read, split_groups  # noqa: E402

from hf_retrace.models.cost_model_retrace import CostCurve, StepCostModel  # noqa: E402


PROFILE_ROWS = (1, 2, 3, 4, 6, 8)
IDLE_FACTOR = 5.0  # as the plugin's costs.IDLE_FACTOR: a step this much slower than predicted is idle time


def engines(steps: list[dict]) -> list[list[dict]]:
    """The log cut into engines: runs of prompt groups with the same largest batch."""
    out, current, key = [], [], None
    for group in split_groups(steps):
        largest = max(s["decoding"] for s in group)
        if current and largest != key:
            out.append(current)
            current = []
        current, key = current + group, largest
    return out + [current] if current else out


def replay(steps: list[dict], profile_ms: float, profile_row_ms: float) -> StepCostModel:
    """Sets `replayed_s` on every step of `engines(steps)`; returns the model at the end."""
    profile = [(r, (profile_ms + profile_row_ms * (r - 1)) * 1e-3) for r in PROFILE_ROWS]
    model = StepCostModel.fit(profile, [(16, 0.005)])
    for engine in engines(steps):
        model = StepCostModel(CostCurve(model.target.sizes, model.target.seconds), model.drafter, model.context,
                              model.per_request)  # a new engine: the file's curves and terms, a fresh window
        for s in engine:
            decoding, (first, other) = s["decoding"], s["context"]
            predicted = float(model.step_seconds(s["rows"], 0, first, other, decoding))
            s["replayed_s"] = predicted
            if s["target_s"] > IDLE_FACTOR * predicted:
                continue
            decode_rows = (decoding, s["verified"]) if s["prefill_rows"] == 0 and decoding > 0 else None
            model.observe(s["rows"], 0, s["target_s"], None, first, other, decode_rows, decoding)
    return model


def table(steps: list[dict]) -> None:
    print("| requests decoding | steps | ms a verified row, measured | logged model | replayed | replayed error ms "
          "| bias ms |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for name, chosen, slopes in bucket_slopes(steps, ("target_s", "predicted_s", "replayed_s")):
        errors = np.array([s["replayed_s"] - s["target_s"] for s in chosen]) * 1e3
        print(f"| {name} | {len(chosen)} | {slopes[0]:.2f} | {slopes[1]:.2f} | {slopes[2]:.2f} | "
              f"{np.abs(errors).mean():.1f} | {errors.mean():+.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--profile-ms", type=float, default=40.5, help="the start-up profile's t(1), ms")
    parser.add_argument("--profile-row-ms", type=float, default=1.2, help="its slope, ms a row")
    args = parser.parse_args()
    steps = read(args.log)
    model = replay(steps, args.profile_ms, args.profile_row_ms)
    table(steps)
    knots = ", ".join(f"{int(r)}: {t * 1e3:.1f}" for r, t in zip(model.target.sizes, model.target.seconds))
    print(f"\nat the end: a = {model.context[0] * 1e6:.2f} us, c = {model.context[1] * 1e6:.2f} us a context token, "
          f"e = {model.per_request * 1e3:.2f} ms a request; t(R) ms {knots}")  # fmt: skip


if __name__ == "__main__":
    main()

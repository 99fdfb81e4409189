"""The step-cost model's context terms, fitted offline from an engine's step log (docs/cost-aware-speculation.md).

    .venv-vllm/bin/python -m hf_retrace_vllm.step_fit --log steps.jsonl [--cache COST_FILE [--write]]

Serve with `HF_RETRACE_VLLM_STEP_LOG=steps.jsonl` set (a few hundred steps at the load you expect), then fit. The
decode steps' target time is fitted by least squares as

    b0 + b1 * requests + b2 * verified rows + a * K + c * X

(`K`, `X`: the context tokens of the requests' first rows and of their verified rows). Printed: `a`, `c`, the request
term `e = b1 - b2` (what a request's own row costs beyond a verified row; only where the log's steps vary in
requests) and how much of the steps' spread the fit explains, beside the rows alone. With `--cache` (the engine's
step-cost file, `~/.cache/hf_retrace/cost/vllm-*.json`) and `--write`, the file gets `context = [a, c]` and
`per_request = e`, and each knot of `t(R)` gives back what the terms price of the logged steps near it
(`a * K + c * X + e * n` at their mean, less what the file's terms already took): the knots learned those steps'
times and would otherwise count them twice. The next
engine start with that file plans with the terms.
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .shared.cost_model_retrace import MIN_FIT_STEPS, CostCurve, HostKey, StepCostModel, knots_less_context
from .shared.cost_model_retrace import fit_context_terms as cost_fit


@dataclass(frozen=True)
class ContextFit:
    """`a`, `c` (seconds per context token), the fit's R^2, the R^2 of rows alone, the decode steps used, and `e`
    (seconds a request's row costs beyond a verified row; `None` where the steps' requests hardly vary)."""

    first: float
    other: float
    r2: float
    r2_rows_only: float
    steps: int
    per_request: float | None = None


def read_step_log(path) -> list[dict]:
    """The steps of a `HF_RETRACE_VLLM_STEP_LOG` file, in order."""
    steps = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
            step["rows"], step["context"], step["target_s"]  # noqa: B018 - the fields the fit reads
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number} is not a step-log line ({error}); expected the JSON lines "
                             "HF_RETRACE_VLLM_STEP_LOG writes") from error  # fmt: skip
        steps.append(step)
    return steps


def fit_context_terms(steps: list[dict]) -> ContextFit:
    """Fits `a` and `c` on the decode steps of `steps` (those with no prefill rows), as the engine does online
    (`cost_model_retrace.fit_context_terms`).

    Raises:
        ValueError: fewer than `MIN_FIT_STEPS` decode steps.
    """
    decode = [s for s in steps if not s.get("prefill_rows") and s.get("decoding", 0) > 0]
    if len(decode) < MIN_FIT_STEPS:
        raise ValueError(f"the log has {len(decode)} decode steps, a fit needs {MIN_FIT_STEPS}: log a longer run")
    columns = np.array([[s["decoding"], s["verified"], *s["context"], s["target_s"]] for s in decode], np.float64)
    first, other, per_request, r2, r2_rows = cost_fit(*columns.T)
    return ContextFit(first, other, r2, r2_rows, len(decode), per_request)


def knots_without_context(curve: CostCurve, steps: list[dict], first: float, other: float,
                          per_request: float = 0.0) -> CostCurve:  # fmt: skip
    """`curve` with each knot less `first * K + other * X + per_request * n` at the mean contexts and decoding
    requests of the logged steps it learned from (`cost_model_retrace.knots_less_context`)."""
    contexts = np.array([s["context"] for s in steps], dtype=np.float64).reshape(-1, 2)
    requests = [s.get("decoding", 0) for s in steps]
    return knots_less_context(curve, [s["rows"] for s in steps], contexts[:, 0], contexts[:, 1], first, other,
                              requests, per_request)  # fmt: skip


def write_terms(cache: Path, steps: list[dict], fit: ContextFit) -> StepCostModel:
    """Writes `fit`'s terms into the step-cost file `cache`, its knots less the logged contexts at the change of the
    terms (so writing the same fit twice changes nothing); returns the model."""
    payload = json.loads(Path(cache).read_text())
    key = HostKey(**payload["key"])
    model = StepCostModel.load(cache, key)
    if model is None:
        raise ValueError(f"{cache} is not a step-cost file this code reads")
    # the knots hold the logged steps' contexts beyond the terms the file had when they learned: give back the change
    per_request = model.per_request if fit.per_request is None else fit.per_request
    change = (fit.first - model.context[0], fit.other - model.context[1], per_request - model.per_request)
    target = knots_without_context(model.target, steps, *change)
    fitted = StepCostModel(target, model.drafter, (fit.first, fit.other), per_request)
    fitted.save(cache, key)
    return fitted


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", required=True, help="a HF_RETRACE_VLLM_STEP_LOG file")
    parser.add_argument("--cache", help="the engine's step-cost file, to write the terms into (with --write)")
    parser.add_argument("--write", action="store_true", help="write the fitted terms into --cache")
    args = parser.parse_args(argv)
    steps = read_step_log(args.log)
    fit = fit_context_terms(steps)
    e = "not fitted (the steps' requests hardly vary)" if fit.per_request is None else f"{fit.per_request * 1e3:.2f} ms"
    print(f"{fit.steps} decode steps: a = {fit.first * 1e6:.2f} us, c = {fit.other * 1e6:.2f} us a context token, "
          f"e = {e} a request; R^2 {fit.r2:.3f} (rows alone {fit.r2_rows_only:.3f})")  # fmt: skip
    if args.write and not args.cache:
        parser.error("--write needs --cache")
    if args.write:
        model = write_terms(Path(args.cache), steps, fit)
        knots = ", ".join(f"{int(s)}: {t * 1e3:.1f}" for s, t in zip(model.target.sizes, model.target.seconds))
        print(f"wrote {args.cache}: context {list(model.context)}, per_request {model.per_request}, t(R) ms {knots}")


if __name__ == "__main__":
    main()

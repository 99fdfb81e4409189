"""The report of `benchmarks/serving.py`: `results.md` (tables), `results.json` (rows, run info, per-batch records
without token ids) and `tokens_per_s.png` (tokens/s against concurrency per method, one panel per mode and group).
"""

import json
from dataclasses import asdict
from pathlib import Path

from serving_methods import GROUPS
from serving_records import GREEDY, SAMPLED, TAU_NOTE, portable


PROPOSER_SOURCES = ("lookup", "datastore", "online_datastore", "draft")  # the plugin proposer's cycles by source
PLOT = "tokens_per_s.png"


SCHEDULE_LINES = {  # how a concurrency's prompts reached the engine (`--schedule`); runs before the option: batches
    "queue": "Concurrency C: each group's prompts submitted together, C running at a time (max_num_seqs = C), a "
    "queued request starting when one finishes.",
    "batches": "Concurrency C: closed batches of C prompts, each stepped until its last request finishes.",
}


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _pick(rows, decoding=GREEDY, prompts="pooled"):
    return [r for r in rows if r["decoding"] == decoding and r["prompts"] == prompts]


def preload_warning(run_info: dict) -> str | None:
    """A loud line when a vLLM worker ran without tcmalloc or Intel OpenMP preloaded (None when all had both)."""
    preloads = run_info.get("preloads") or {}
    inactive = sorted({lib for seen in preloads.get("workers", []) for lib, on in seen.items() if not on})
    if not inactive and not preloads.get("missing"):
        return None
    missing = ", ".join(inactive or preloads.get("missing"))
    return (f"WARNING: vLLM ran without {missing} preloaded (LD_PRELOAD from {preloads.get('source')}); vLLM's "
            "CPU guide asks for tcmalloc and Intel OpenMP, and speculative decoding is much slower without them")


def _header(run_info: dict) -> list[str]:
    sampling = run_info.get("sampling") or {}
    lines = [
        "# Serving bench: transformers and vLLM",
        "",
        f"target `{run_info['target']}`, fp32, max_new_tokens={run_info['max_new_tokens']}, "
        f"{run_info['cpu_count']} CPUs; transformers {run_info['transformers']} ({run_info['torch_threads']} torch "
        f"threads, skinny GEMM, batch 1), vLLM {run_info.get('vllm') or 'n/a'} (modes "
        f"{', '.join(run_info.get('modes', []))}; VLLM_CPU_OMP_THREADS_BIND={run_info['vllm_threads_bind']}; "
        f"preloads from {(run_info.get('preloads') or {}).get('source', 'n/a')}). Prompts: at least "
        f"{run_info['prompts_per_set']} a set, and at least {run_info.get('prompt_factor', 1)}x the concurrency per "
        f"group; `pool_eval` = {', '.join(GROUPS['pool_eval'])} (eval splits), `unseen` = "
        f"{', '.join(GROUPS['unseen'])} (no pool used them). {run_info['rounds']} round(s), methods rotated; a fresh "
        "vLLM engine per method, mode and concurrency, one alive at a time. "
        + SCHEDULE_LINES[run_info.get("schedule", "batches")],
        "",
        f"{TAU_NOTE}. tau drafted = 1 + accepted / drafts from vLLM's spec-decode counters (cycles with a draft). "
        "Speedup = tokens/s over the same engine's target alone in the same mode at the same concurrency; vs hf_ar = "
        "over transformers' target alone at batch 1. Lossless = greedy token ids equal to the same engine's target "
        "alone in the same mode at the same concurrency, per prompt.",
    ]
    if sampling:
        lines += ["", f"Sampled: temperature {sampling['temperature']} (no top-k / top-p), seeds from "
                  f"{sampling['seed']} per prompt, at concurrency {sampling['concurrency']}, on prompts none of the "
                  "greedy passes used, after the greedy pass in the same engine. NLL/token: the target's negative "
                  "log-likelihood of the sampled tokens at that temperature (transformers, fp32), pooled over tokens: "
                  "an exact sampler matches the target alone's within noise."]  # fmt: skip
    warning = preload_warning(run_info)
    return lines + ([] if warning is None else ["", f"**{warning}**"])


def _summary_lines(rows: list[dict]) -> list[str]:
    """Greedy tokens/s (speedup) of each method at each concurrency, per vLLM mode (transformers' batch-1 rows in
    each), unseen families apart."""
    greedy = [r for r in rows if r["decoding"] == GREEDY and r["prompts"] in GROUPS]
    lines = []
    modes = [m for m in dict.fromkeys(r["mode"] for r in greedy) if m != "hf"] or ["hf"][: bool(greedy)]
    for mode in modes:
        picked = [r for r in greedy if r["mode"] in (mode, "hf")]
        concurrencies = sorted({r["concurrency"] for r in picked})
        lines += ["", f"## Summary, {mode}: greedy tokens/s (speedup) by concurrency", "",
                  "| method | prompts | " + " | ".join(f"C={c}" for c in concurrencies) + " |",
                  "|---|---|" + "---:|" * len(concurrencies)]  # fmt: skip
        for group in GROUPS:
            for method in dict.fromkeys(r["method"] for r in picked):
                cell = {r["concurrency"]: r for r in picked if (r["method"], r["prompts"]) == (method, group)}
                cells = [
                    f"{_fmt(cell[c]['tokens_per_s'], '.1f')} ({_fmt(cell[c]['speedup'], '.2f', 'x')})"
                    if c in cell else "" for c in concurrencies
                ]  # fmt: skip
                lines.append(f"| {method} | {group} | " + " | ".join(cells) + " |")
    return lines


def _decode_lines(rows: list[dict]) -> list[str]:
    """Greedy prefill and decode apart (vLLM rows that timed them): mean time to first token, mean time per output
    token after it, and the decode's speedup beside the end-to-end one and its ceiling. Long prompts (codeio's ~950
    tokens) make the prefill, which speculation leaves as it is, a large share of a 64-token request: the ceiling is
    the target alone's seconds over its prefill alone (one token a prompt), the speedup a free decode would give."""
    timed = [r for r in rows if r["decoding"] == GREEDY and r["prompts"] in GROUPS and r["tpot_ms"] is not None]
    if not timed:
        return []
    lines = ["", "## Prefill and decode apart (greedy): time to first token, time per output token after it", "",
             "| method | mode | prompts | C | TTFT ms | TPOT ms | decode speedup (TPOT) | end-to-end speedup "
             "| ceiling (prefill alone) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in sorted(timed, key=lambda r: (r["mode"], r["prompts"], r["concurrency"])):
        lines.append(f"| {r['method']} | {r['mode']} | {r['prompts']} | {r['concurrency']} "
                     f"| {_fmt(r['ttft_ms'], '.0f')} | {_fmt(r['tpot_ms'], '.1f')} "
                     f"| {_fmt(r['tpot_speedup'], '.2f', 'x')} | {_fmt(r['speedup'], '.2f', 'x')} "
                     f"| {_fmt(r.get('speedup_ceiling'), '.2f', 'x')} |")  # fmt: skip
    return lines


def _greedy_lines(rows: list[dict]) -> list[str]:
    lines = []
    for mode, concurrency in dict.fromkeys((r["mode"], r["concurrency"]) for r in rows if r["decoding"] == GREEDY):
        if mode == "hf":
            continue
        lines += ["", f"## {mode}, concurrency {concurrency}", "",
                  "| method | prompts | n | tau (pooled over cycles) | tau drafted | tokens/s | speedup | vs hf_ar | "
                  "cycles | new tokens | lossless |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        picked = [r for r in rows if r["decoding"] == GREEDY and r["prompts"] in (*GROUPS, "pooled")]
        hf = [r for r in picked if r["mode"] == "hf"] if concurrency == 1 else []
        for r in hf + [r for r in picked if (r["mode"], r["concurrency"]) == (mode, concurrency)]:
            lossless = {None: "reference", True: "yes", False: "**NO**"}[r["lossless"]]
            lines.append(
                f"| {r['method']} | {r['prompts']} | {r['num_prompts']} | {_fmt(r['tau'], '.3f')} "
                f"| {_fmt(r['tau_drafted'], '.3f')} | {_fmt(r['tokens_per_s'], '.2f')} "
                f"| {_fmt(r['speedup'], '.3f', 'x')} | {_fmt(r['vs_hf_ar_batch1'], '.3f', 'x')} "
                f"| {r['num_cycles']} | {r['new_tokens']} | {lossless} |"
            )
    return lines


def _sampled_lines(rows: list[dict]) -> list[str]:
    sampled = [r for r in rows if r["decoding"] == SAMPLED and r["prompts"] in (*GROUPS, "pooled")]
    if not sampled:
        return []
    greedy = {(r["method"], r["mode"], r["concurrency"], r["prompts"]): r for r in rows if r["decoding"] == GREEDY}
    lines = ["", "## Sampled beside greedy", "",
             "| method | mode | C | prompts | n | greedy tau | greedy tok/s | sampled tau | sampled tok/s | "
             "sampled speedup | NLL/token |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in sampled:
        g = greedy.get((r["method"], r["mode"], r["concurrency"], r["prompts"])) or {}
        lines.append(
            f"| {r['method']} | {r['mode']} | {r['concurrency']} | {r['prompts']} | {r['num_prompts']} "
            f"| {_fmt(g.get('tau'), '.3f')} | {_fmt(g.get('tokens_per_s'), '.2f')} | {_fmt(r['tau'], '.3f')} "
            f"| {_fmt(r['tokens_per_s'], '.2f')} | {_fmt(r['speedup'], '.3f', 'x')} "
            f"| {_fmt(r['nll_per_token'], '.3f')} |"
        )
    return lines


def _timing_lines(rows: list[dict]) -> list[str]:
    """Per pooled greedy vLLM row: the engine's ms per step, the proposer's ms per step by part, the datastore peak."""
    picked = [r for r in _pick(rows) if r["engine"] == "vllm" and r["spec_decode_counters"]]
    if not picked:
        return []
    parts = sorted({k[len("proposer_s_"):] for r in picked for k in r["spec_decode_counters"] if
                    k.startswith("proposer_s_")})  # fmt: skip
    lines = ["", "## Step timing (greedy, pooled)", "",
             "Engine ms/step: wall time in `LLM.llm_engine.step()` per step (the whole step: proposer, verification, "
             "sampling). Proposer parts: the plugin's own timers, ms per proposer step.", "",
             "| method | mode | C | engine steps | engine ms/step | tokens/s | proposer steps | "
             + "".join(f"{p} ms/step | " for p in parts) + "online datastore peak |",
             "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(parts) + "---:|"]  # fmt: skip
    for r in picked:
        c = r["spec_decode_counters"]
        steps, proposer_steps = c.get("engine_steps", 0), c.get("proposer_steps", 0)
        per_step = c.get("engine_step_s", 0) * 1000 / steps if steps else None
        cells = [_fmt(c[f"proposer_s_{p}"] * 1000 / proposer_steps if proposer_steps and f"proposer_s_{p}" in c
                      else None, ".2f") for p in parts]  # fmt: skip
        peak = (r["peaks"] or {}).get("online_datastore_bytes")
        lines.append(
            f"| {r['method']} | {r['mode']} | {r['concurrency']} | {steps:.0f} | {_fmt(per_step, '.2f')} "
            f"| {_fmt(r['tokens_per_s'], '.2f')} | {_fmt(proposer_steps or None, '.0f')} | "
            + "".join(f"{cell} | " for cell in cells) + f"{_fmt(peak and peak / 2**20, '.2f', ' MiB')} |"
        )
    return lines


def _prediction_lines(rows: list[dict]) -> list[str]:
    """Per pooled greedy goodput row: what the cost model and the acceptance estimates predicted per step beside what
    the engine measured (the plugin's `PredictionLedger`)."""
    picked = [r for r in _pick(rows) if (r["spec_decode_counters"] or {}).get("proposer_pred_steps")]
    if not picked:
        return []
    lines = ["", "## Cost-aware policy: predicted beside measured (greedy, pooled)", "",
             "Per step whose batch was the planned one: the target's part `t(R)` (ms), and the proposed tokens "
             "accepted per request (committed tokens less the one each request commits anyway); per drafter forward: the "
             "cost model's `d(S)` of the slots that ran (the whole padded batch; exploring forwards too) beside the "
             "forward's measured time.", "",
             "| method | mode | C | steps | t(R) predicted ms | measured ms | accepted/request predicted | measured "
             "| drafter forwards | d(S) predicted ms | measured ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in picked:
        c = r["spec_decode_counters"]
        steps, forwards = c["proposer_pred_steps"], c.get("proposer_pred_drafter_steps", 0)
        requests = c.get("proposer_pred_requests", 0)

        def per(key, n, scale=1000.0):
            return _fmt(c.get(f"proposer_pred_{key}", 0) * scale / n if n else None, ".2f")

        def accepted(key):
            return _fmt((c.get(f"proposer_pred_{key}", 0) - requests) / requests if requests else None, ".3f")

        lines.append(
            f"| {r['method']} | {r['mode']} | {r['concurrency']} | {steps:.0f} | {per('target_predicted', steps)} "
            f"| {per('target_measured', steps)} | {accepted('tokens_predicted')} | {accepted('tokens_committed')} "
            f"| {_fmt(forwards or None, '.0f')} | {per('drafter_predicted', forwards)} "
            f"| {per('drafter_measured', forwards)} |"
        )
    return lines


def _proposer_lines(rows: list[dict]) -> list[str]:
    """Markdown lines: the hf-retrace plugin proposer's cycles / committed tokens by source, pooled rows only."""
    picked = [r for r in _pick(rows) if "proposer_cycles_draft" in (r["spec_decode_counters"] or {})]
    if not picked:
        return []
    lines = ["", "## hf-retrace proposer in vLLM: cycles / committed tokens by source (greedy, pooled)", "",
             "| method | mode | concurrency | lookup | datastore | online datastore | draft | tau over these cycles |",
             "|---|---|---:|---|---|---|---:|"]  # fmt: skip
    for r in picked:
        c = r["spec_decode_counters"]
        cycles = [c.get(f"proposer_cycles_{s}", 0) for s in PROPOSER_SOURCES]
        committed = [c.get(f"proposer_committed_{s}", 0) for s in PROPOSER_SOURCES]
        cells = " | ".join(f"{n:.0f} / {m:.0f}" for n, m in zip(cycles, committed))
        tau = sum(committed) / sum(cycles) if sum(cycles) else None
        lines.append(f"| {r['method']} | {r['mode']} | {r['concurrency']} | {cells} | {_fmt(tau, '.3f')} |")
    return lines


def render_markdown(rows: list[dict], run_info: dict, failures: list[dict], skipped: list[str]) -> str:
    """The results tables (summary per mode, prefill and decode apart, one table per mode and concurrency with groups
    and pooled rows, sampled beside greedy, step timing, the plugin's sources; prompt sets in results.json) as
    markdown."""
    lines = _header(run_info) + _summary_lines(rows) + _decode_lines(rows) + _greedy_lines(rows) + _sampled_lines(rows)
    lines += _timing_lines(rows) + _prediction_lines(rows) + _proposer_lines(rows)
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- {line}" for line in skipped]
    if failures:
        lines += ["", "## LOSSLESS CHECK FAILED", ""] + [f"- {f['message']}" for f in failures]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> str | None:
    """tokens/s against concurrency per method: one column per vLLM mode, one row per group (greedy solid, sampled
    dashed); transformers' batch-1 rows as points at C=1 in every panel. None on success, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'hf-retrace[eval]')"
    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "hf"]
    if not modes:
        return "no vLLM rows to plot"
    groups = list(GROUPS)
    fig, axes = plt.subplots(len(groups), len(modes), figsize=(6 * len(modes), 4 * len(groups)), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for col, mode in enumerate(modes):
        for row, group in enumerate(groups):
            ax = axes[row][col]
            for method in methods:
                for decoding, style in ((GREEDY, "-o"), (SAMPLED, "--x")):
                    points = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["method"] == method
                                    and r["mode"] in (mode, "hf") and r["decoding"] == decoding
                                    and r["prompts"] == group and r["tokens_per_s"])  # fmt: skip
                    if points:
                        label = method if decoding == GREEDY else f"{method} (sampled)"
                        ax.plot(*zip(*points), style, color=colors[method], label=label, markersize=4)
            ax.set_xscale("log", base=2)
            ax.set_title(f"vLLM {mode}, {group} prompts")
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel("tokens/s")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(output_dir: Path, rows, batches, run_info, failures, skipped) -> None:
    """Writes `results.json` and `results.md`, naming no machine's paths (`serving_records.portable`)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    rows, run_info = portable(rows), portable(run_info)
    per_batch = [
        {k: v for k, v in asdict(b).items() if k != "outputs"} | {"new_tokens": [len(o) for o in b.outputs]}
        for b in batches
    ]
    payload = {"run": run_info, "tau_definition": TAU_NOTE, "results": rows, "lossless_failures": failures,
               "skipped": skipped, "batches": per_batch}  # fmt: skip
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (output_dir / "results.md").write_text(render_markdown(rows, run_info, failures, skipped))

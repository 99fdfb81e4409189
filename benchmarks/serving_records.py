"""Bookkeeping of `benchmarks/serving.py`: the record of every batch, the lossless check, the results rows, and the
store that lets `--resume` skip the blocks a killed run already measured. Pure, stdlib only.
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from serving_methods import REFERENCES


TAU_NOTE = (
    "tau is pooled over cycles: committed tokens (bonus included) summed over all verification cycles of all prompts, "
    "divided by the number of cycles (prefill not counted)"
)
GREEDY, SAMPLED = "greedy", "sampled"


@dataclass
class Batch:
    """One call of one method on `len(prompts)` prompts submitted at once (batch 1: one prompt).

    `mode` is `compiled` or `eager` (vLLM) or `hf`; `decoding` is `greedy` or `sampled`. `nll` (sampled batches): per
    request, the target's negative log-likelihood of the generated tokens at the sampling temperature, summed over
    them. `peaks`: gauges read at the end of the batch (the online datastore's bytes), not deltas. `first_token_s`,
    `finish_s` (vLLM): per request, seconds from submission to its first token and to its last (`None`: not timed).
    `prefill_s` (vLLM's target alone, greedy): seconds the same engine took to prefill the same prompts alone (one
    new token each, no prefix-cache reuse), the part of `seconds` no speculation can shorten.
    """

    method: str
    engine: str
    concurrency: int
    round: int
    prompts: list[tuple[str, str, int]]  # (group, prompt set, index) per request
    outputs: list[list[int]]  # new token ids per request
    cycles: list[list[int]]  # committed tokens per verification cycle, per request
    seconds: float
    counters: dict = field(default_factory=dict)  # vLLM spec-decode / proposer / engine-step counter deltas
    mode: str = "hf"
    decoding: str = GREEDY
    nll: list[float] | None = None
    peaks: dict = field(default_factory=dict)
    first_token_s: list[float | None] | None = None
    finish_s: list[float | None] | None = None
    prefill_s: float | None = None


def request_latencies(first_token_s: list, finish_s: list, lengths: list[int]) -> tuple[list[float], list[float]]:
    """Time to first token and time per output token after it (seconds), of the requests timed (`None`: not timed;
    one output token: no time per token)."""
    ttft, tpot = [], []
    for first, finish, n in zip(first_token_s, finish_s, lengths):
        if first is not None and finish is not None and n > 1:
            ttft.append(first)
            tpot.append((finish - first) / (n - 1))
    return ttft, tpot


def _latencies(b: Batch, picked: list[int]) -> tuple[list[float], list[float]]:
    """[`request_latencies`] of the picked requests of `b`."""
    if b.first_token_s is None or b.finish_s is None:
        return [], []
    return request_latencies([b.first_token_s[i] for i in picked], [b.finish_s[i] for i in picked],
                             [len(b.outputs[i]) for i in picked])  # fmt: skip


def portable(value, repo: Path | None = None):
    """`value` (JSON-able) with this machine's paths written as the records name them: under the repository
    relative to it, under the package's cache (`$HF_RETRACE_CACHE`, else `~/.cache/hf_retrace`) from
    `$HF_RETRACE_CACHE`, under the home folder from `~`."""
    repo = Path(__file__).resolve().parents[1] if repo is None else Path(repo)
    cache = Path(os.environ.get("HF_RETRACE_CACHE") or Path.home() / ".cache" / "hf_retrace")
    text = json.dumps(value)
    for root, name in ((repo, ""), (cache, "$HF_RETRACE_CACHE/"), (Path.home(), "~/")):
        text = text.replace(f"{root}/", name)
    return json.loads(text)


def block_key(method: str, mode: str, concurrency: int, round_index: int) -> str:
    """The id of one block (a fresh engine for one method, mode, concurrency and round) in the resume store."""
    return f"{method}/{mode}/c{concurrency}/r{round_index}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(batches: list[Batch]) -> list[dict]:
    """One failure per greedy (method, mode, concurrency, prompt) whose tokens differ from its engine's target alone
    in the same mode at the same concurrency; a prompt the reference did not run is a failure too (nothing to check
    against). Sampled batches are not compared token by token (their NLL column checks them)."""
    greedy = [b for b in batches if b.decoding == GREEDY]
    reference = {}
    for b in greedy:
        if b.method == REFERENCES[b.engine]:
            for key, tokens in zip(b.prompts, b.outputs):
                reference[(b.engine, b.mode, b.concurrency, tuple(key))] = tokens
    failures = []
    for b in greedy:
        if b.method == REFERENCES[b.engine]:
            continue
        for key, tokens in zip(b.prompts, b.outputs):
            expected = reference.get((b.engine, b.mode, b.concurrency, tuple(key)))
            index = None if expected is None else first_difference(expected, tokens)
            if expected is None or index is not None:
                failures.append({
                    "method": b.method, "mode": b.mode, "concurrency": b.concurrency, "group": key[0],
                    "prompt_set": key[1], "prompt_index": key[2], "index": index,
                    "expected": None if expected is None or index >= len(expected) else expected[index],
                    "got": None if index is None or index >= len(tokens) else tokens[index],
                    "message": f"{b.method} ({b.mode}) at concurrency {b.concurrency} on {key[1]}#{key[2]}: "
                    + ("no target-alone output to compare with" if expected is None
                       else f"first differing token at index {index}"),
                })  # fmt: skip
    return failures


def _row(key: tuple, label: str, batches: list[Batch], failures: list[dict]) -> dict:
    """One results row over the requests of `batches` in `label` (a group, a prompt set, or `pooled`)."""
    method, engine, mode, concurrency, decoding = key

    def keep(prompt_key):
        return label == "pooled" or label in prompt_key[:2]

    cycles, tokens, num_prompts, seconds, counters, nll, peaks = [], 0, 0, 0.0, {}, None, {}
    prefill = 0.0 if batches and all(b.prefill_s is not None for b in batches) else None
    ttft, tpot = [], []
    for b in batches:
        picked = [i for i, k in enumerate(b.prompts) if keep(k)]
        if not picked:
            continue
        num_prompts += len(picked)
        tokens += sum(len(b.outputs[i]) for i in picked)
        cycles += [n for i in picked for n in b.cycles[i]]
        latencies = _latencies(b, picked)
        ttft, tpot = ttft + latencies[0], tpot + latencies[1]
        if b.nll is not None:
            nll = (nll or 0.0) + sum(b.nll[i] for i in picked)
        # batches hold one group (`concurrent_batches`); a prompt-set row of a batch that mixes sets gets the share
        # of the batch's wall time (and counters) of its requests
        share = len(picked) / len(b.prompts)
        seconds += b.seconds * share
        if prefill is not None:
            prefill += b.prefill_s * share
        for k, v in b.counters.items():
            counters[k] = counters.get(k, 0) + v * share
        for k, v in b.peaks.items():
            peaks[k] = max(peaks.get(k, 0), v)
    drafts = counters.get("num_drafts", 0)
    lossless = not any(
        (f["method"], f.get("mode", "hf"), f["concurrency"]) == (method, mode, concurrency)
        and keep((f["group"], f["prompt_set"]))
        for f in failures
    )
    return {
        "method": method, "engine": engine, "mode": mode, "concurrency": concurrency, "decoding": decoding,
        "prompts": label, "num_prompts": num_prompts,
        "tau": sum(cycles) / len(cycles) if cycles else None,
        "tau_drafted": 1 + counters["num_accepted_tokens"] / drafts if drafts else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "speedup": None, "vs_hf_ar_batch1": None,
        # means over requests: time to first token (the prefill, queueing included) and per output token after it
        "ttft_ms": 1e3 * sum(ttft) / len(ttft) if ttft else None,
        "tpot_ms": 1e3 * sum(tpot) / len(tpot) if tpot else None, "tpot_speedup": None,
        "nll_per_token": nll / tokens if nll is not None and tokens else None,
        "num_cycles": len(cycles), "new_tokens": tokens, "seconds": seconds,
        # the target alone's rows: its prompts' prefill alone, and the end-to-end speedup a free decode would give
        "prefill_s": prefill, "speedup_ceiling": seconds / prefill if prefill else None,
        "spec_decode_counters": counters or None, "peaks": peaks or None,
        "lossless": None if method == REFERENCES[engine] or decoding != GREEDY else lossless,
    }  # fmt: skip


def summarize(batches: list[Batch], failures: list[dict]) -> list[dict]:
    """Rows per (method, mode, concurrency, decoding) x (each group, each prompt set, pooled); `speedup` is over the
    same engine's target alone in the same mode at the same concurrency and decoding on the same prompts,
    `vs_hf_ar_batch1` over transformers' target alone at batch 1 (same decoding) on them; `tpot_speedup` is the
    target alone's time per output token over the method's (the decode alone, where both were timed);
    `speedup_ceiling` is the target alone's seconds over its prefill alone: no method's `speedup` can pass it (the
    same tokens, and at least the same prefill), copied to every method's row from its reference's."""
    keys = list(dict.fromkeys((b.method, b.engine, b.mode, b.concurrency, b.decoding) for b in batches))
    labels = list(dict.fromkeys(k[0] for b in batches for k in b.prompts))
    labels += list(dict.fromkeys(k[1] for b in batches for k in b.prompts)) + ["pooled"]
    rows = []
    for key in keys:
        subset = [b for b in batches if (b.method, b.engine, b.mode, b.concurrency, b.decoding) == key]
        rows += [_row(key, label, subset, failures) for label in labels]
    speed = {(r["method"], r["mode"], r["concurrency"], r["decoding"], r["prompts"]): r["tokens_per_s"] for r in rows}
    tpot = {(r["method"], r["mode"], r["concurrency"], r["decoding"], r["prompts"]): r["tpot_ms"] for r in rows}
    ceiling = {(r["method"], r["mode"], r["concurrency"], r["decoding"], r["prompts"]): r["speedup_ceiling"]
               for r in rows}  # fmt: skip
    for r in rows:
        ref_key = (REFERENCES[r["engine"]], r["mode"], r["concurrency"], r["decoding"], r["prompts"])
        if r["tpot_ms"] and tpot.get(ref_key):
            r["tpot_speedup"] = tpot[ref_key] / r["tpot_ms"]  # the decode's speedup, the prefill left out
        ref = speed.get(ref_key)
        hf = speed.get(("hf_ar", "hf", 1, r["decoding"], r["prompts"]))
        r["speedup_ceiling"] = ceiling.get(ref_key)
        if r["tokens_per_s"] is not None:
            r["speedup"] = r["tokens_per_s"] / ref if ref else None
            r["vs_hf_ar_batch1"] = r["tokens_per_s"] / hf if hf else None
    return rows


# ---- the resume store -------------------------------------------------------------------------------------------


STORE = "batches.json"  # every batch with its token ids, the blocks done, and the settings they were measured with


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a run killed mid-write leaves the previous file whole


def save_store(output_dir: Path, settings: dict, done: list[str], batches: list[Batch], run_info: dict) -> None:
    payload = {"settings": settings, "done_blocks": done, "run": run_info, "batches": [asdict(b) for b in batches]}
    _write_atomic(Path(output_dir) / STORE, json.dumps(payload) + "\n")


def load_store(output_dir: Path, settings: dict) -> tuple[list[str], list[Batch], dict]:
    """(blocks done, their batches, the run info so far) of a previous run into `output_dir`; nothing when there is
    none. A store measured with other settings (target, prompts, tokens, sampling) is refused: its rows would not
    compare with the new ones."""
    path = Path(output_dir) / STORE
    if not path.is_file():
        return [], [], {}
    payload = json.loads(path.read_text())
    settings = json.loads(json.dumps(settings))  # tuples read back as lists
    stored = payload["settings"]
    changed = sorted(k for k in set(settings) | set(stored) if settings.get(k) != stored.get(k))
    if changed:
        raise ValueError(
            f"--resume: {path} was measured with other settings ({', '.join(changed)}); rerun with those settings, "
            "or without --resume into a new --output-dir"
        )
    batches = [Batch(**{**b, "prompts": [tuple(k) for k in b["prompts"]]}) for b in payload["batches"]]
    done = set(payload["done_blocks"])
    kept = [b for b in batches if block_key(b.method, b.mode, b.concurrency, b.round) in done]
    return payload["done_blocks"], kept, payload["run"]

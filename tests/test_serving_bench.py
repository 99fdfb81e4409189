"""The pure parts of `benchmarks/serving.py`: method and concurrency parsing, the round schedule, the lossless and tau
bookkeeping, the markdown table. No model, no vLLM."""

import importlib.util
from pathlib import Path

import pytest


_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"
_spec = importlib.util.spec_from_file_location("serving_bench", _PATH)
serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)
Batch = serving.Batch


def test_parse_methods_adds_each_engines_reference_and_reads_values():
    specs = serving.parse_methods("vllm_suffix=8,hf_drafter=cards/x,vllm_dflash")
    assert [s.name for s in specs] == ["hf_ar", "vllm_ar", "vllm_suffix", "hf_drafter", "vllm_dflash"]
    by_name = {s.name: s for s in specs}
    assert by_name["vllm_suffix"].speculative_config() == {"method": "suffix", "num_speculative_tokens": 8}
    assert by_name["hf_drafter"].card == "cards/x"
    assert by_name["vllm_dflash"].card == serving.CARDS["dflash"]
    assert by_name["vllm_dflash"].speculative_config("out/x") == {
        "method": "dflash", "model": "out/x", "num_speculative_tokens": 3
    }
    assert by_name["vllm_ar"].speculative_config() is None
    assert [s.name for s in serving.parse_methods("vllm_ngram")] == ["vllm_ar", "vllm_ngram"]  # no hf_ar needed


@pytest.mark.parametrize(
    "text, match",
    [("vllm_eagle", "unknown method"), ("vllm_ngram=0", "K >= 1"), ("vllm_ngram=x", "K >= 1"),
     ("hf_ar,hf_ar", "unique"), ("hf_drafter=", "empty value")],
)  # fmt: skip
def test_parse_methods_rejects_bad_input(text, match):
    with pytest.raises(ValueError, match=match):
        serving.parse_methods(text)


def test_parse_concurrency():
    assert serving.parse_concurrency("8,1,8") == [1, 8]
    for bad in ("", "0,8", "one"):
        with pytest.raises(ValueError, match="--concurrency"):
            serving.parse_concurrency(bad)


def test_rounds_mix_every_set_and_rotate_methods():
    prompts = [serving.Prompt("g", s, i, [i]) for s in ("a", "b") for i in range(3)]
    chunks = serving.chunk_rounds(prompts, 2)
    assert sorted(p.index + 10 * (p.prompt_set == "b") for c in chunks for p in c) == [0, 1, 2, 10, 11, 12]
    assert all({p.prompt_set for p in c} == {"a", "b"} for c in chunks)
    assert len(serving.chunk_rounds(prompts, 99)) == len(prompts)
    assert serving.rotated(["A", "B", "C"], 1) == ["B", "C", "A"]
    assert serving.rotated(["A", "B", "C"], 3) == ["A", "B", "C"]


def test_concurrent_batches_keep_groups_apart():
    sizes = (("pool_eval", "a", 5), ("unseen", "b", 3))
    chunk = [serving.Prompt(group, name, i, [i]) for group, name, n in sizes for i in range(n)]
    batches = serving.concurrent_batches(chunk, 4)
    assert [[(p.prompt_set, p.index) for p in b] for b in batches] == [
        [("a", 0), ("a", 1), ("a", 2), ("a", 3)], [("a", 4)], [("b", 0), ("b", 1), ("b", 2)]
    ]
    assert len(serving.concurrent_batches(chunk, 1)) == 8


def _batches():
    """vLLM at concurrency 2 on two prompts of two groups, the target alone and a method that differs on one."""
    keys = [("pool_eval", "gsm_symbolic", 0), ("unseen", "codeio", 0)]
    return [
        Batch("vllm_ar", "vllm", 2, 0, keys, [[5, 6, 7], [8, 9]], [[1, 1], [1]], 2.0),
        Batch("vllm_ngram", "vllm", 2, 0, keys, [[5, 6, 7], [8, 4]], [[2], [1]], 1.0,
              {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 1}),
        Batch("hf_ar", "hf", 1, 0, keys[:1], [[5, 6, 7]], [[1, 1]], 4.0),
    ]  # fmt: skip


def test_lossless_is_per_engine_concurrency_and_prompt():
    failures = serving.check_lossless(_batches())
    assert [(f["method"], f["prompt_set"], f["index"], f["expected"], f["got"]) for f in failures] == [
        ("vllm_ngram", "codeio", 1, 9, 4)
    ]
    # a method run at a concurrency its reference did not run at has nothing to compare with: a failure
    orphan = Batch("vllm_ngram", "vllm", 4, 0, [("unseen", "codeio", 0)], [[8, 9]], [[1]], 1.0)
    missing = serving.check_lossless(_batches()[:1] + [orphan])
    assert len(missing) == 1 and "no target-alone output" in missing[0]["message"]


def test_rows_pool_tau_over_cycles_and_split_batch_time():
    batches = _batches()
    rows = serving.summarize(batches, serving.check_lossless(batches))
    row = {(r["method"], r["concurrency"], r["prompts"]): r for r in rows}
    ngram = row[("vllm_ngram", 2, "pooled")]
    assert ngram["tau"] == pytest.approx(3 / 2)  # cycles [2] and [1], pooled: (2 + 1) / 2
    assert ngram["tau_drafted"] == pytest.approx(1 + 1 / 2)
    assert ngram["tokens_per_s"] == pytest.approx(5 / 1.0) and ngram["speedup"] == pytest.approx(5.0 / 2.5)
    assert ngram["lossless"] is False and row[("vllm_ar", 2, "pooled")]["lossless"] is None
    pool = row[("vllm_ngram", 2, "pool_eval")]
    assert pool["lossless"] is True and pool["num_prompts"] == 1
    assert pool["seconds"] == pytest.approx(0.5)  # half the batch's requests: half its wall time
    assert pool["tokens_per_s"] == pytest.approx(6.0) and pool["vs_hf_ar_batch1"] == pytest.approx(6.0 / 0.75)
    assert row[("vllm_ngram", 2, "unseen")]["lossless"] is False
    assert row[("vllm_ngram", 2, "codeio")]["tau"] == 1.0
    assert row[("hf_ar", 1, "unseen")]["num_prompts"] == 0 and row[("hf_ar", 1, "unseen")]["tau"] is None


def test_markdown_tables_per_concurrency():
    batches = _batches()
    failures = serving.check_lossless(batches)
    run_info = {"target": "t", "max_new_tokens": 3, "cpu_count": 2, "transformers": "5", "torch_threads": 2,
                "vllm": "0.32.0", "vllm_threads_bind": "0-1", "prompts_per_set": 1, "rounds": 1}  # fmt: skip
    md = serving.render_markdown(serving.summarize(batches, failures), run_info, failures, ["vllm_dflash: why"])
    assert "## Concurrency 1" in md and "## Concurrency 2" in md
    assert md.index("## Concurrency 1") < md.index("| hf_ar | pool_eval |") < md.index("## Concurrency 2")
    assert "transformers is batch-1 only" in md
    assert "| vllm_ngram | pooled | 2 | 1.500 | 1.500 | 5.00 | 2.000x |" in md
    assert "| vllm_ngram | unseen |" in md and "| **NO** |" in md and "| vllm_ngram | codeio |" not in md
    assert "- vllm_dflash: why" in md and "## LOSSLESS CHECK FAILED" in md


def test_proposer_cycles_by_source_are_split_by_share_and_tabled():
    keys = [("pool_eval", "gsm_symbolic", 0), ("unseen", "codeio", 0)]
    counters = {"proposer_cycles_lookup": 2, "proposer_committed_lookup": 6, "proposer_cycles_datastore": 0,
                "proposer_committed_datastore": 0, "proposer_cycles_draft": 4,
                "proposer_committed_draft": 6}  # fmt: skip
    batches = [
        Batch("vllm_ar", "vllm", 2, 0, keys, [[5, 6], [8, 9]], [[1], [1]], 2.0),
        Batch("vllm_dflash", "vllm", 2, 0, keys, [[5, 6], [8, 9]], [[1], [1]], 1.0, counters),
    ]
    rows = serving.summarize(batches, serving.check_lossless(batches))
    pool = next(r for r in rows if r["method"] == "vllm_dflash" and r["prompts"] == "pool_eval")
    assert pool["spec_decode_counters"]["proposer_cycles_draft"] == pytest.approx(2)  # half of the batch's requests
    lines = serving._proposer_lines(rows)
    assert "| vllm_dflash | 2 | 2 / 6 | 0 / 0 | 4 / 6 | 2.000 |" in lines
    assert serving._proposer_lines(rows[:1]) == []

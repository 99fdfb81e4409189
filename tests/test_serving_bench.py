"""The pure parts of `benchmarks/serving.py` and its helpers: argument parsing, the prompt plan, the schedule, the
lossless and tau bookkeeping, the report tables, the resume store, the preload environment, the proposer stats the
worker reads, and the NLL scoring of sampled continuations (on a tiny random model). No vLLM."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch


_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_BENCH))  # the bench's helpers import one another by module name, as the script does
import serving  # noqa: E402
import serving_engines  # noqa: E402
import serving_methods as methods  # noqa: E402
import serving_records as records  # noqa: E402
import serving_report as report  # noqa: E402
import serving_vllm_worker as worker  # noqa: E402


Batch = records.Batch


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- parsing ----------------------------------------------------------------------------------------------------


def test_default_methods_run_suffix_twice_and_every_reference():
    specs = {s.name: s for s in methods.parse_methods(methods.ALL_METHODS)}
    assert list(specs) == ["hf_ar", "hf_drafter", "vllm_ar", "vllm_suffix", "vllm_suffix8", "vllm_ngram",
                           "vllm_dflash", "vllm_retrace"]  # fmt: skip
    assert specs["vllm_suffix"].speculative_config() == {"method": "suffix"}  # vLLM's own defaults
    assert specs["vllm_suffix8"].speculative_config() == {"method": "suffix", "num_speculative_tokens": 8}
    assert specs["vllm_ngram"].speculative_config()["num_speculative_tokens"] == 3
    assert specs["vllm_retrace"].speculative_config("out/x") == {
        "method": "dflash", "model": "out/x", "num_speculative_tokens": 3
    }
    assert specs["vllm_ar"].speculative_config() is None
    assert [s.name for s in methods.parse_methods("vllm_ngram=5")] == ["vllm_ar", "vllm_ngram5"]


def test_drafter_methods_take_settings_into_a_copy_of_the_card(tmp_path):
    card = tmp_path / "card"
    card.mkdir()
    (card / "generation_config.json").write_text(json.dumps({"num_assistant_tokens": 3}))
    (card / "model.safetensors").write_bytes(b"weights")
    text = "vllm_retrace=" + str(card) + ":speculation_policy=fixed:num_speculative_tokens=8,vllm_retrace"
    fixed, default = methods.parse_methods(text)[1:]
    assert (fixed.name, default.name) == ("vllm_retrace_fixed_8", "vllm_retrace")
    assert fixed.settings == {"speculation_policy": "fixed"} and fixed.num_speculative_tokens == 8
    assert default.settings == {} and default.num_speculative_tokens == 3
    copy = Path(serving_engines.card_with_settings(fixed.card, fixed.settings, tmp_path / "cards" / fixed.name))
    assert json.loads((copy / "generation_config.json").read_text()) == {"num_assistant_tokens": 3,
                                                                         "speculation_policy": "fixed"}  # fmt: skip
    assert (copy / "model.safetensors").read_bytes() == b"weights"
    hf = methods.parse_methods("hf_drafter:online_datastore_num_tokens=8")[1]
    assert hf.name == "hf_drafter_8" and hf.settings == {"online_datastore_num_tokens": 8}


def test_vllm_methods_take_worker_environment_apart_from_the_card_settings():
    on, off = methods.parse_methods("vllm_dflash:speculation_policy=goodput,"
                                    "vllm_dflash:speculation_policy=goodput:env.HF_RETRACE_VLLM_LOAD_FALLBACK=0")[1:]
    assert (on.name, off.name) == ("vllm_dflash_goodput", "vllm_dflash_goodput_0")
    assert on.env == {} and off.env == {"HF_RETRACE_VLLM_LOAD_FALLBACK": "0"}
    assert on.settings == off.settings == {"speculation_policy": "goodput"}  # the same card for both


@pytest.mark.parametrize(
    "text, match",
    [("vllm_eagle", "unknown method"), ("vllm_ngram=0", "K >= 1"), ("vllm_suffix=x", "K >= 1"),
     ("hf_ar,hf_ar", "unique"), ("hf_drafter=", "empty value"), ("vllm_ngram:x=1", "only drafter methods"),
     ("vllm_retrace:policy", "key=value"), ("hf_drafter:env.X=1", "vLLM worker's environment")],
)  # fmt: skip
def test_parse_methods_rejects_bad_input(text, match):
    with pytest.raises(ValueError, match=match):
        methods.parse_methods(text)


def test_parse_concurrency_and_modes():
    assert methods.parse_concurrency("32,1,8,1") == [1, 8, 32]
    for bad in ("", "0,8", "one"):
        with pytest.raises(ValueError, match="--concurrency"):
            methods.parse_concurrency(bad)
    assert methods.parse_modes("eager,compiled,eager") == ["eager", "compiled"]
    for bad in ("", "cuda_graph", "compiled,jit"):
        with pytest.raises(ValueError, match="--modes"):
            methods.parse_modes(bad)


@pytest.fixture
def target(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_parse_args_defaults_and_quick(target):
    args = serving.parse_args(["--target", target])
    assert (args.mode_list, args.concurrencies) == (["compiled"], [1, 4, 8, 16, 32])
    assert args.sampled_concurrencies == [1, 8]
    assert args.schedule == "queue" and serving._settings(args)["schedule"] == "queue"  # a resume checks it
    quick = serving.parse_args(["--target", target, "--quick", "--modes", "compiled,eager"])
    assert (quick.mode_list, quick.concurrencies, quick.sampled_concurrencies) == (["compiled"], [1, 4], [1])
    assert (quick.num_prompts_per_set, quick.max_new_tokens) == (2, 32)
    assert serving.parse_args(["--target", target, "--sampled-concurrency", ""]).sampled_concurrencies == []


@pytest.mark.parametrize(
    "argv",
    [["--modes", "jit"], ["--sampled-concurrency", "2"], ["--temperature", "0"], ["--rounds", "0"],
     ["--max-model-len", "64"], ["--schedule", "fifo"]],
)  # fmt: skip
def test_parse_args_usage_errors(target, argv):
    with pytest.raises(SystemExit) as error:
        serving.parse_args(["--target", target, *argv])
    assert error.value.code == 2


def test_parse_args_makes_the_default_target_once_and_refuses_a_missing_one(tmp_path, monkeypatch, capsys):
    default = tmp_path / "default"
    made = []

    def fake_ensure_default_target(folder):
        if not (folder / "config.json").is_file():
            made.append(True)
            folder.mkdir()
            (folder / "config.json").write_text("{}")
        return folder

    monkeypatch.setattr(serving, "DEFAULT_TARGET", default)
    monkeypatch.setattr(serving, "ensure_default_target", fake_ensure_default_target)
    assert serving.parse_args(["--target", str(default)]).target == str(default)
    assert serving.parse_args(["--target", str(default)]).target == str(default)
    assert made == [True]
    with pytest.raises(SystemExit) as error:
        serving.parse_args(["--target", str(tmp_path / "elsewhere")])
    assert error.value.code == 2
    assert "has no config.json" in capsys.readouterr().err


def test_quick_estimate_is_a_fraction_of_the_full_one(target):
    def estimate(argv):
        args = serving.parse_args(["--target", target, *argv])
        vllm = [s for s in args.specs if s.engine == "vllm"]
        hf = [s for s in args.specs if s.engine == "hf"]
        return serving.estimate_seconds(args, serving.make_plan(args), vllm, hf)

    full, quick = estimate([]), estimate(["--quick"])
    assert full["total"] == pytest.approx(sum(v for k, v in full.items() if k != "total"))
    assert quick["total"] < full["total"] / 3
    assert estimate(["--modes", "compiled,eager"])["startup"] > full["startup"]


# ---- prompts and schedule ---------------------------------------------------------------------------------------


def _prompts(plan):
    groups = methods.GROUPS.items()
    return [methods.Prompt(g, s, i, [i]) for g, sets in groups for s in sets for i in range(plan.total(g))]


def test_prompt_plan_holds_twice_the_concurrency_per_group_and_keeps_sampled_prompts_apart():
    plan = methods.PromptPlan(base=4, factor=2, concurrencies=[1, 8, 32], sampled_concurrencies=[1, 8])
    assert plan.greedy("unseen", 1) == 4 and plan.greedy("unseen", 32) == 32 and plan.greedy("pool_eval", 32) == 22
    prompts = _prompts(plan)
    for c in (1, 8, 32):
        for group in methods.GROUPS:
            assert len([p for p in plan.pick(prompts, c, False) if p.group == group]) >= 2 * c
    greedy = {p.key for c in (1, 8, 32) for p in plan.pick(prompts, c, False)}
    sampled = {p.key for c in (1, 8) for p in plan.pick(prompts, c, True)}
    assert sampled and not greedy & sampled
    assert plan.pick(prompts, 32, True) == []
    assert plan.total("unseen") == 32 + 8


def test_a_prompt_past_max_model_len_is_named_before_any_engine_starts():
    # vLLM refuses such a request and ends the block's engine, after the block's other passes already ran
    prompts = [methods.Prompt("unseen", "codeio", i, [1] * n) for i, n in enumerate([100, 4040, 5034])]
    assert methods.too_long(prompts[:1], 64, 4096) is None
    error = methods.too_long(prompts, 64, 4096)
    assert "codeio[1] (4040 tokens)" in error and "codeio[2] (5034 tokens)" in error
    assert "--max-model-len 5098" in error and "codeio[0]" not in error


def test_rounds_batches_and_rotation():
    prompts = [methods.Prompt("g", s, i, [i]) for s in ("a", "b") for i in range(3)]
    chunks = methods.chunk_rounds(prompts, 2)
    assert all({p.prompt_set for p in c} == {"a", "b"} for c in chunks)
    assert methods.rotated(["A", "B", "C"], 4) == ["B", "C", "A"]
    assert serving._round_chunk(prompts[:1], 2, 1) == [] and serving._round_chunk([], 2, 0) == []
    chunk = [methods.Prompt(g, n, i, [i]) for g, n, k in (("pool_eval", "a", 5), ("unseen", "b", 3)) for i in range(k)]
    assert [[(p.prompt_set, p.index) for p in b] for b in methods.concurrent_batches(chunk, 4)] == [
        [("a", 0), ("a", 1), ("a", 2), ("a", 3)], [("a", 4)], [("b", 0), ("b", 1), ("b", 2)]
    ]
    # queued: one batch a group, the engine running 4 of it at a time
    assert [[(p.prompt_set, p.index) for p in b] for b in methods.concurrent_batches(chunk, 4, queue=True)] == [
        [("a", i) for i in range(5)], [("b", i) for i in range(3)]
    ]


def test_schedule_rotates_methods_and_runs_transformers_once(target):
    args = serving.parse_args(["--target", target, "--modes", "compiled,eager", "--concurrency", "1,4",
                               "--sampled-concurrency", "1"])
    hf = [s for s in args.specs if s.engine == "hf"]
    vllm = [s for s in args.specs if s.engine == "vllm"][:3]
    order = serving.schedule(args, hf, vllm)
    assert len(order) == len(hf) + 2 * 2 * len(vllm)
    assert [s.engine for _, mode, c, s in order if s.engine == "hf"] == ["hf", "hf"]
    firsts = [order[i][3].name for i in range(len(order)) if i == 0 or order[i][1:3] != order[i - 1][1:3]]
    assert len(set(firsts)) > 1  # each (mode, concurrency) starts with another method


# ---- bookkeeping ------------------------------------------------------------------------------------------------


KEYS = [("pool_eval", "gsm_symbolic", 0), ("unseen", "codeio", 0)]


def _batches():
    """vLLM compiled at concurrency 2 on two prompts of two groups: the target alone, a method that differs on one
    greedy prompt, and a sampled pass; transformers at batch 1."""
    return [
        Batch("vllm_ar", "vllm", 2, 0, KEYS, [[5, 6, 7], [8, 9]], [[1, 1], [1]], 2.0, mode="compiled"),
        Batch("vllm_ngram", "vllm", 2, 0, KEYS, [[5, 6, 7], [8, 4]], [[2], [1]], 1.0,
              {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 1}, mode="compiled"),
        Batch("vllm_ar", "vllm", 2, 0, KEYS, [[1, 2], [3, 4]], [[1], [1]], 2.0, mode="compiled",
              decoding="sampled", nll=[1.0, 3.0]),
        Batch("vllm_ngram", "vllm", 2, 0, KEYS, [[7, 7], [7, 7]], [[2], [2]], 1.0, mode="compiled",
              decoding="sampled", nll=[10.0, 14.0]),
        Batch("hf_ar", "hf", 1, 0, KEYS[:1], [[5, 6, 7]], [[1, 1]], 4.0),
    ]  # fmt: skip


def test_lossless_is_per_engine_mode_concurrency_and_prompt_and_greedy_only():
    failures = records.check_lossless(_batches())
    assert [(f["method"], f["mode"], f["prompt_set"], f["index"], f["expected"], f["got"]) for f in failures] == [
        ("vllm_ngram", "compiled", "codeio", 1, 9, 4)
    ]  # the sampled pass's different tokens are no failure
    # the same method in eager has no eager reference to compare with: a failure, not a pass
    eager = Batch("vllm_ngram", "vllm", 2, 0, KEYS[:1], [[5, 6, 7]], [[3]], 1.0, mode="eager")
    missing = records.check_lossless(_batches()[:1] + [eager])
    assert len(missing) == 1 and "no target-alone output" in missing[0]["message"]


def test_rows_per_mode_and_decoding_with_nll_per_token():
    batches = _batches()
    rows = records.summarize(batches, records.check_lossless(batches))
    row = {(r["method"], r["decoding"], r["prompts"]): r for r in rows if r["mode"] in ("compiled", "hf")}
    ngram = row[("vllm_ngram", "greedy", "pooled")]
    assert ngram["tau"] == pytest.approx(3 / 2) and ngram["tau_drafted"] == pytest.approx(1.5)
    assert ngram["speedup"] == pytest.approx(5.0 / 2.5) and ngram["lossless"] is False
    assert row[("vllm_ngram", "greedy", "pool_eval")]["lossless"] is True
    assert row[("vllm_ngram", "greedy", "pool_eval")]["vs_hf_ar_batch1"] == pytest.approx(6.0 / 0.75)
    sampled = row[("vllm_ngram", "sampled", "pooled")]
    assert sampled["nll_per_token"] == pytest.approx(24 / 4) and sampled["lossless"] is None
    assert sampled["speedup"] == pytest.approx(4.0 / 2.0)  # over the target alone's sampled pass
    assert row[("vllm_ar", "sampled", "unseen")]["nll_per_token"] == pytest.approx(3.0 / 2)
    assert row[("vllm_ar", "greedy", "pooled")]["nll_per_token"] is None


def test_counters_split_by_share_and_peaks_kept_whole():
    counters = {"proposer_cycles_draft": 4, "proposer_committed_draft": 6, "proposer_steps": 10,
                "proposer_s_drafter": 0.05, "engine_steps": 10, "engine_step_s": 0.2}  # fmt: skip
    batches = [
        Batch("vllm_ar", "vllm", 2, 0, KEYS, [[5, 6], [8, 9]], [[1], [1]], 2.0, mode="compiled"),
        Batch("vllm_dflash", "vllm", 2, 0, KEYS, [[5, 6], [8, 9]], [[1], [1]], 1.0, counters, mode="compiled",
              peaks={"online_datastore_bytes": 3 * 2**20}),
    ]  # fmt: skip
    rows = records.summarize(batches, records.check_lossless(batches))
    pool = next(r for r in rows if r["method"] == "vllm_dflash" and r["prompts"] == "pool_eval")
    assert pool["spec_decode_counters"]["proposer_cycles_draft"] == pytest.approx(2)  # half the batch's requests
    assert pool["peaks"]["online_datastore_bytes"] == 3 * 2**20  # a gauge is not shared out
    md = report.render_markdown(rows, _run_info(), [], [])
    assert "| vllm_dflash | compiled | 2 | 10 | 20.00 | 4.00 | 10 | 5.00 | 3.00 MiB |" in md  # ms/step, drafter
    assert "| vllm_dflash | compiled | 2 | 0 / 0 | 0 / 0 | 0 / 0 | 4 / 6 | 1.500 |" in md


def test_prefill_and_decode_are_timed_apart_per_request():
    """Time to first token and time per output token after it, per request, and the decode's speedup beside the
    end-to-end one: the same prefill (4 s) for both, a decode twice as fast; the ceiling is the target alone's
    seconds over its prefill alone (6 s of 12)."""
    batches = [
        Batch("vllm_ar", "vllm", 2, 0, KEYS, [[1] * 5, [2] * 3], [[1] * 4, [1] * 2], 12.0, mode="compiled",
              first_token_s=[4.0, 4.0], finish_s=[8.0, 6.0], prefill_s=6.0),
        Batch("vllm_suffix", "vllm", 2, 0, KEYS, [[1] * 5, [2] * 3], [[2, 2], [2]], 9.0, mode="compiled",
              first_token_s=[4.0, 4.0], finish_s=[6.0, None]),  # an untimed request counts in neither mean
    ]  # fmt: skip
    rows = records.summarize(batches, records.check_lossless(batches))
    row = {(r["method"], r["prompts"]): r for r in rows}
    assert row[("vllm_ar", "pooled")]["ttft_ms"] == pytest.approx(4000)
    assert row[("vllm_ar", "pooled")]["tpot_ms"] == pytest.approx(1000)  # 4 s / 4 tokens, 2 s / 2 tokens
    suffix = row[("vllm_suffix", "pool_eval")]
    assert suffix["tpot_ms"] == pytest.approx(500) and suffix["tpot_speedup"] == pytest.approx(2.0)
    assert row[("vllm_suffix", "unseen")]["tpot_ms"] is None
    assert row[("vllm_ar", "pooled")]["prefill_s"] == pytest.approx(6.0)
    assert suffix["speedup_ceiling"] == pytest.approx(2.0) and suffix["prefill_s"] is None  # the reference's, copied
    md = report.render_markdown(rows, _run_info(), [], [])
    assert "| vllm_suffix | compiled | pool_eval | 2 | 4000 | 500.0 | 2.00x | 1.33x | 2.00x |" in md
    assert "closed batches of C prompts" in md  # a run before `--schedule` ran batches


def _run_info(**extra):
    return {"target": "t", "max_new_tokens": 3, "cpu_count": 2, "transformers": "5", "torch_threads": 2,
            "vllm": "0.32.0", "vllm_threads_bind": "0-1", "prompts_per_set": 1, "prompt_factor": 2, "rounds": 1,
            "modes": ["compiled"], "preloads": {"source": "scripts/vllm-env.sh", "missing": [],
                                                "workers": [{"tcmalloc": True, "iomp5": True}]},
            "sampling": {"temperature": 0.8, "seed": 0, "concurrency": [2]}} | extra  # fmt: skip


def test_markdown_summary_sampled_and_failures():
    batches = _batches()
    failures = records.check_lossless(batches)
    md = report.render_markdown(records.summarize(batches, failures), _run_info(), failures, ["vllm_dflash: why"])
    assert "## Summary, compiled: greedy tokens/s (speedup) by concurrency" in md
    assert "| hf_ar | pool_eval | 0.8 (1.00x) |  |" in md  # transformers at batch 1 in each mode's summary
    assert "| vllm_ngram | unseen |  | 4.0 (2.00x) |" in md  # C=1 empty: ngram ran at C=2 only
    assert md.index("| vllm_ngram | pool_eval |") < md.index("| vllm_ngram | unseen |")  # unseen apart
    assert "## compiled, concurrency 2" in md and "| vllm_ngram | pooled | 2 | 1.500 | 1.500 | 5.00 | 2.000x |" in md
    assert "| vllm_ngram | compiled | 2 | pooled | 2 | 1.500 | 5.00 | 2.000 | 4.00 | 2.000x | 6.000 |" in md
    assert "| **NO** |" in md and "- vllm_dflash: why" in md and "## LOSSLESS CHECK FAILED" in md
    assert "WARNING" not in md


def test_markdown_warns_loudly_without_preloads():
    info = _run_info(preloads={"source": "search", "missing": [], "workers": [{"tcmalloc": True, "iomp5": False}]})
    warning = report.preload_warning(info)
    assert "libiomp5" not in warning and "iomp5" in warning
    assert f"**{warning}**" in report.render_markdown([], info, [], [])
    assert report.preload_warning(_run_info()) is None


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    batches = _batches()
    rows = records.summarize(batches, records.check_lossless(batches))
    assert report.plot(rows, tmp_path / "p.png") is None
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert report.plot([r for r in rows if r["engine"] == "hf"], tmp_path / "q.png") == "no vLLM rows to plot"


# ---- the resume store -------------------------------------------------------------------------------------------


def test_resume_store_keeps_finished_blocks_and_refuses_other_settings(tmp_path):
    settings = {"target": "t", "concurrencies": (1, 2), "temperature": 0.8}
    batches = _batches()
    done = [records.block_key("vllm_ar", "compiled", 2, 0), records.block_key("hf_ar", "hf", 1, 0)]
    records.save_store(tmp_path, settings, done, batches, {"vllm_startup_s": [["vllm_ar", "compiled", 2, 9.0]]})
    kept_done, kept, run = records.load_store(tmp_path, settings)
    assert kept_done == done and run["vllm_startup_s"][0][3] == 9.0
    kept_blocks = [(b.method, b.decoding) for b in kept]
    assert kept_blocks == [("vllm_ar", "greedy"), ("vllm_ar", "sampled"), ("hf_ar", "greedy")]
    assert kept[0].prompts == KEYS and kept[1].nll == [1.0, 3.0]  # token ids and scores survive the round trip
    assert records.check_lossless(kept) == []
    with pytest.raises(ValueError, match="temperature"):
        records.load_store(tmp_path, settings | {"temperature": 1.0})
    assert records.load_store(tmp_path / "none", settings) == ([], [], {})


# ---- the engines' pure parts ------------------------------------------------------------------------------------


def test_preloads_from_the_env_file(tmp_path, monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    (tmp_path / "scripts").mkdir()
    env_file = tmp_path / "scripts" / "vllm-env.sh"
    env_file.write_text("export LD_PRELOAD=/x/libtcmalloc_minimal.so.4:/y/libiomp5.so\nexport HF_RETRACE_T=1\n")
    updates, record = serving_engines.vllm_preload_env(tmp_path)
    assert updates == {"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4:/y/libiomp5.so", "HF_RETRACE_T": "1"}
    assert record["source"] == "scripts/vllm-env.sh" and record["missing"] == []
    assert record["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libiomp5.so"  # no machine's folders in the record
    env_file.write_text("echo missing >&2; return 1\n")  # a failing env file: the libraries are searched instead
    (tmp_path / ".venv-vllm" / "lib").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "lib" / "libiomp5.so").write_bytes(b"")
    updates, record = serving_engines.vllm_preload_env(tmp_path)
    assert record["source"].startswith("search") and "failed to source" in record["source"]
    assert updates["LD_PRELOAD"].endswith(str(tmp_path / ".venv-vllm" / "lib" / "libiomp5.so"))
    assert "libiomp5" not in record["missing"]
    assert serving_engines.vllm_preload_env(tmp_path, disabled=True)[1]["missing"] == ["libtcmalloc", "libiomp5"]


def test_worker_reads_the_proposer_timings_and_old_stats_files(tmp_path, monkeypatch):
    stats_module = _load(_BENCH.parent / "integrations" / "vllm" / "hf_retrace_vllm" / "stats.py", "plugin_stats")
    path = tmp_path / "stats.json"
    monkeypatch.setenv(worker.PROPOSER_STATS_ENV, str(path))
    stats = stats_module.ProposerStats()
    stats.record("draft", 3)
    stats.record_step({"policy": 0.001, "drafter": 0.010})
    stats.record_step({"policy": 0.003, "drafter": 0.020})
    stats.record_online_datastore_bytes(300)
    stats.record_online_datastore_bytes(200)
    stats.prediction = {"steps": 2, "requests": 4, "target_predicted": 0.04}
    stats.write()
    flat, gauges = worker.read_proposer_stats()
    assert flat["proposer_cycles_draft"] == 1 and flat["proposer_steps"] == 2
    assert flat["proposer_pred_steps"] == 2 and flat["proposer_pred_target_predicted"] == pytest.approx(0.04)
    assert flat["proposer_s_drafter"] == pytest.approx(0.030) and flat["proposer_s_policy"] == pytest.approx(0.004)
    assert gauges == {"online_datastore_bytes": 300}
    old = {"cycles": {"draft": 1}, "committed": {"draft": 2}, "tau": 2.0}  # written before timings existed
    path.write_text(json.dumps(old))
    assert worker.read_proposer_stats() == ({"proposer_cycles_draft": 1, "proposer_committed_draft": 2}, {})
    monkeypatch.delenv(worker.PROPOSER_STATS_ENV)
    assert worker.read_proposer_stats() == ({}, {})
    assert os.environ.get(worker.PROPOSER_STATS_ENV) is None


def test_stats_file_is_written_when_a_request_ends_and_else_at_most_every_interval(tmp_path, monkeypatch):
    stats_module = _load(_BENCH.parent / "integrations" / "vllm" / "hf_retrace_vllm" / "stats.py", "plugin_stats")
    path = tmp_path / "stats.json"
    monkeypatch.setenv(stats_module.STATS_ENV, str(path))
    clock = [100.0]
    monkeypatch.setattr(stats_module.time, "monotonic", lambda: clock[0])
    stats = stats_module.ProposerStats()
    stats.record("draft", 3)
    stats.write(final=False)  # the first write is never throttled
    assert json.loads(path.read_text())["cycles"]["draft"] == 1
    stats.record("draft", 2)
    clock[0] += stats_module.WRITE_INTERVAL / 2
    stats.write(final=False)  # too soon: the file keeps the first write
    assert json.loads(path.read_text())["cycles"]["draft"] == 1
    stats.write(final=True)  # a request ended: written whatever the interval
    assert json.loads(path.read_text())["cycles"]["draft"] == 2
    stats.record("draft", 2)
    clock[0] += stats_module.WRITE_INTERVAL
    stats.write(final=False)
    written = json.loads(path.read_text())
    assert written["cycles"]["draft"] == 3 and not any(key.startswith("_") for key in written)


def test_prediction_table_sets_the_policy_beside_the_engine():
    ledger = {"steps": 10, "requests": 40, "target_predicted": 0.3, "target_measured": 0.4, "tokens_predicted": 60.0,
              "tokens_committed": 52, "drafter_steps": 2, "drafter_predicted": 0.004, "drafter_measured": 0.02}
    counters = {f"proposer_pred_{k}": v for k, v in ledger.items()}
    row = {"method": "vllm_dflash_goodput", "mode": "compiled", "concurrency": 4, "decoding": "greedy",
           "prompts": "pooled", "spec_decode_counters": counters}
    lines = report._prediction_lines([row, {**row, "method": "vllm_dflash", "spec_decode_counters": {}}])
    # per step 30 vs 40 ms; accepted per request (60 - 40) / 40 = 0.5 predicted, 0.3 measured; d(S) 2 vs 10 ms
    assert lines[-1] == "| vllm_dflash_goodput | compiled | 4 | 10 | 30.00 | 40.00 | 0.500 | 0.300 | 2 | 2.00 | 10.00 |"
    assert sum(line.startswith("| vllm_dflash") for line in lines) == 1  # a fixed-policy row has no prediction


# ---- NLL of sampled continuations -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # a random init is near uniform; sharpen it so that samples and noise differ
        model.lm_head.weight.mul_(40)
    return model


def test_continuation_nll_scores_each_generated_token_at_the_temperature(tiny_target):
    prompt, continuation, t = [3, 17, 5, 9], [40, 2, 77], 0.8
    expected, ids = 0.0, list(prompt)
    for token in continuation:  # one prefix at a time: an independent reading of the same quantity
        with torch.no_grad():
            logits = tiny_target(input_ids=torch.tensor([ids])).logits[0, -1]
        expected -= torch.log_softmax(logits / t, dim=-1)[token].item()
        ids.append(token)
    assert serving_engines.continuation_nll(tiny_target, prompt, continuation, t) == pytest.approx(expected, rel=1e-5)
    assert serving_engines.continuation_nll(tiny_target, prompt, [], t) == 0.0
    assert serving_engines.continuation_nll(tiny_target, prompt, continuation, 1.0) != pytest.approx(expected)


def test_nll_separates_exact_sampling_from_a_corrupted_sampler(tiny_target):
    """The column's purpose: tokens drawn from the target at T score the target's entropy at T; tokens drawn from
    anything else (here: uniformly, as a sampler that accepts wrong drafts drifts) score higher."""
    prompt, t, n = [3, 17, 5, 9], 0.8, 24
    generator = torch.Generator().manual_seed(0)
    exact, corrupted = [], []
    for _ in range(n):
        ids = list(prompt)
        for _ in range(8):
            with torch.no_grad():
                logits = tiny_target(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(torch.multinomial(torch.softmax(logits / t, -1), 1, generator=generator).item())
        exact.append(serving_engines.continuation_nll(tiny_target, prompt, ids[len(prompt):], t) / 8)
        uniform = torch.randint(0, 128, (8,), generator=generator).tolist()
        corrupted.append(serving_engines.continuation_nll(tiny_target, prompt, uniform, t) / 8)
    assert sum(exact) / n < sum(corrupted) / n - 0.05


def test_records_name_no_machine_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    value = {"preload": f"/lib/libtcmalloc.so:{repo}/.venv-vllm/lib/libiomp5.so", "n": 3,
             "target": str(tmp_path / "cache" / "smollm2"), "card": str(Path.home() / "cards" / "x"), "ok": "abc/def"}
    assert records.portable(value, repo) == {
        "preload": "/lib/libtcmalloc.so:.venv-vllm/lib/libiomp5.so", "n": 3,
        "target": "$HF_RETRACE_CACHE/smollm2", "card": "~/cards/x", "ok": "abc/def",
    }  # fmt: skip


def test_the_serving_record_names_no_machine_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path / "cache"))
    info = _run_info() | {"target": str(tmp_path / "cache" / "smollm2-135m-instruct")}
    report.write_outputs(tmp_path / "out", [], [], info, [], [])
    for name in ("results.json", "results.md"):
        text = (tmp_path / "out" / name).read_text()
        assert "$HF_RETRACE_CACHE/smollm2-135m-instruct" in text and str(tmp_path) not in text, name

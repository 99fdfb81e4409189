"""`hf-retrace bench`: parsing, pooled tau against hand-computed stats, outputs written, loud lossless failures."""

import json
import string

import pytest
import torch

from conftest import make_drafter, make_target, random_prompt
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from hf_retrace.bench import methods
from hf_retrace.bench import run as bench
from hf_retrace.bench.methods import MethodSpec, parse_methods
from hf_retrace.bench.run import parse_prompt_sets, torch_threads
from hf_retrace.bench.report import first_difference
from hf_retrace.bench.timing import ConditioningTimer
import hf_retrace.skinny_gemm as skinny_gemm
from hf_retrace.skinny_gemm import DEFAULT_TUNE_ROWS


BLOCK = 4
MAX_NEW = 24
REQUIRED_KEYS = {"method", "prompt_set", "tau", "tokens_per_s", "speedup", "acceptance_histogram",
                 "conditioning_share", "num_cycles", "new_tokens", "lossless"}  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on a shared 2-core machine, two threads oversubscribe and run several times slower."""
    with torch_threads(1):
        yield


def _char_tokenizer() -> PreTrainedTokenizerFast:
    """A 102-token character-level tokenizer with a chat template, small enough for the 128-token tiny target."""
    specials = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_assets")
    target = make_target("qwen3")
    target.save_pretrained(root / "target")
    _char_tokenizer().save_pretrained(root / "target")
    make_drafter(target, block_size=BLOCK, mode="corrected").save_pretrained(root / "drafter")
    with open(root / "ids.jsonl", "w") as f:
        f.writelines(json.dumps({"input_ids": random_prompt(5 + 2 * i, seed=i)[0].tolist()}) + "\n" for i in range(3))
    with open(root / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": text}) + "\n" for text in ("What is 2+3?", "Name a colour."))
    return root


def _methods(root) -> str:
    drafter = root / "drafter"
    return f"ar,prompt_lookup=3,dflash={drafter},retrace={drafter},gated={drafter}:gated"


@pytest.fixture(scope="module")
def bench_run(assets):
    out = assets / "out"
    argv = ["--target", str(assets / "target"), "--dtype", "fp32", "--methods", _methods(assets), "--prompt-sets",
            f"{assets / 'ids.jsonl'}:3,{assets / 'text.jsonl'}", "--max-new-tokens", str(MAX_NEW),
            "--output-dir", str(out), "--no-progress", "--num-threads", "1",
            "--draft-logits-dtype", "bfloat16", "--baseline", "dflash"]  # fmt: skip
    code = bench.main(argv)
    return code, out, json.loads((out / "results.json").read_text())


def test_draft_logits_dtype_override(assets):
    folder = str(assets / "drafter")
    loaded = methods.load_drafter(folder, None, torch.float32, "cpu", "bfloat16")
    assert loaded.generation_config.draft_logits_dtype == "bfloat16"
    loaded = methods.load_drafter(folder, None, torch.float32, "cpu", "target")
    assert loaded.generation_config.draft_logits_dtype is None


def test_parse_methods():
    specs = parse_methods("prompt_lookup=4,dflash=/d,retrace=/d,g=/x:y/d:gated,raw=/x:y")
    assert [s.name for s in specs] == ["ar", "prompt_lookup", "dflash", "retrace", "g", "raw"]  # ar added first
    assert specs[1] == MethodSpec("prompt_lookup", "prompt_lookup", num_lookup_tokens=4)
    assert (specs[2].folder, specs[2].retrace_mode) == ("/d", "off")  # dflash = the folder with retrace off
    assert (specs[3].folder, specs[3].retrace_mode) == ("/d", None)  # as saved
    assert (specs[4].folder, specs[4].retrace_mode) == ("/x:y/d", "gated")
    assert (specs[5].folder, specs[5].retrace_mode) == ("/x:y", None)  # ":y" is no mode: part of the path
    assert parse_methods("prompt_lookup")[1].num_lookup_tokens == methods.DEFAULT_LOOKUP_TOKENS
    lookups = parse_methods("prompt_lookup,pl3=prompt_lookup:3")  # several lookup arms in one run
    assert lookups[1:] == [MethodSpec("prompt_lookup", "prompt_lookup", num_lookup_tokens=10),
                           MethodSpec("pl3", "prompt_lookup", num_lookup_tokens=3)]  # fmt: skip
    with_settings = parse_methods("g=/x:y/d:off:speculation_policy=goodput:num_assistant_tokens=None:t=0.5")[1]
    assert (with_settings.folder, with_settings.retrace_mode) == ("/x:y/d", "off")
    assert with_settings.settings == {"speculation_policy": "goodput", "num_assistant_tokens": None, "t": 0.5}
    assert parse_methods("g=/d:online_datastore_num_tokens=8")[1].settings == {"online_datastore_num_tokens": 8}


@pytest.mark.parametrize(
    "bad", ["dflash=/d:gated", "x=/a,x=/b", "nonsense", "ar=/d", "x=", "pl=prompt_lookup:0", "pl=prompt_lookup:x"]
)
def test_parse_methods_rejects(bad):
    with pytest.raises(ValueError):
        parse_methods(bad)


def test_parse_prompt_sets():
    assert parse_prompt_sets("gsm_symbolic:20, humaneval,/a:b/p.jsonl:3") == [
        ("gsm_symbolic", 20), ("humaneval", None), ("/a:b/p.jsonl", 3)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3], [1], 1),
        ([], [], None),
    ],
)
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


def test_outputs_written(bench_run):
    code, out, payload = bench_run
    assert code == 0
    rows = payload["results"]
    methods = ["ar", "prompt_lookup", "dflash", "retrace", "gated"]
    assert [(r["method"], r["prompt_set"]) for r in rows] == [
        (m, s) for s in ("ids", "text", "pooled") for m in methods
    ]
    for row in rows:
        assert REQUIRED_KEYS <= set(row)
        assert row["lossless"] is True
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    assert payload["run"]["draft_logits_dtype"] == "bfloat16"  # every drafter scored drafts in bf16, still lossless
    assert "pooled over cycles" in (out / "results.md").read_text()
    assert "pooled over cycles" in payload["tau_definition"]
    for name in ("tau.png", "acceptance_histograms.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paired_tau_against_baseline(bench_run):
    _, out, payload = bench_run
    pooled = {r["method"]: r["tau"] for r in payload["results"] if r["prompt_set"] == "pooled"}
    paired = payload["paired_tau"]
    assert [r["method"] for r in paired] == ["ar", "prompt_lookup", "retrace", "gated"]  # all but the baseline
    for r in paired:  # the paired ratio is the ratio of the pooled rows (same prompts), inside its own interval
        assert r["baseline"] == "dflash" and r["num_prompts"] == 3 + 2
        assert r["ratio"] == pytest.approx(pooled[r["method"]] / pooled["dflash"])
        assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1]
    assert "tau relative to `dflash`" in (out / "results.md").read_text()


def test_unknown_baseline_fails_before_running(assets, capsys):
    argv = ["--target", str(assets / "target"), "--methods", _methods(assets), "--baseline", "nope",
            "--prompt-sets", f"{assets / 'ids.jsonl'}:1", "--output-dir", str(assets / "never")]  # fmt: skip
    assert bench.main(argv) == 2  # a usage error: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("hf-retrace bench: error: --baseline 'nope' is not one of --methods")
    assert err.count("\n") == 1
    assert not (assets / "never").exists()


def test_ar_and_prompt_lookup_rows(bench_run):
    rows = {(r["method"], r["prompt_set"]): r for r in bench_run[2]["results"]}
    ar, lookup = rows[("ar", "pooled")], rows[("prompt_lookup", "pooled")]
    assert ar["speedup"] == 1.0 and ar["tau"] == 1.0 and ar["conditioning_share"] is None
    assert ar["acceptance_histogram"] == [ar["new_tokens"]] and ar["new_tokens"] == 5 * MAX_NEW
    # every committed token comes from exactly one target forward
    histogram = lookup["acceptance_histogram"]
    assert len(histogram) == 4 and sum((i + 1) * c for i, c in enumerate(histogram)) == lookup["new_tokens"]


def test_tau_is_pooled_over_cycles(bench_run, assets):
    """Recompute each drafter row from the drafter's own stats, prompt by prompt (greedy, so runs repeat exactly)."""
    target = AutoModelForCausalLM.from_pretrained(assets / "target").eval()
    prompts = {"ids": bench.encode_prompt_set(str(assets / "ids.jsonl"), 3, None, 0)}
    tokenizer = AutoTokenizer.from_pretrained(assets / "target")
    prompts["text"] = bench.encode_prompt_set(str(assets / "text.jsonl"), None, tokenizer, 0)
    rows = {(r["method"], r["prompt_set"]): r for r in bench_run[2]["results"]}
    distinguishes = False  # the data must tell pooling over cycles from averaging per-prompt taus
    for name, mode in (("dflash", "off"), ("retrace", None), ("gated", "gated")):
        drafter = methods.load_drafter(str(assets / "drafter"), mode, torch.float32, "cpu")
        pooled_lengths, per_prompt_tau = [], []
        for label, ids_list in prompts.items():
            lengths = []
            for ids in ids_list:
                target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                                max_new_tokens=MAX_NEW)  # fmt: skip
                lengths += drafter.last_generation_stats.acceptance_lengths
                per_prompt_tau.append(drafter.last_generation_stats.tau)
            row = rows[(name, label)]
            assert row["num_cycles"] == len(lengths)
            assert row["tau"] == pytest.approx(sum(lengths) / len(lengths))
            assert row["acceptance_histogram"] == [lengths.count(n) for n in range(1, BLOCK + 1)]
            pooled_lengths += lengths
        pooled = rows[(name, "pooled")]
        assert pooled["tau"] == pytest.approx(sum(pooled_lengths) / len(pooled_lengths))
        distinguishes |= pooled["tau"] != pytest.approx(sum(per_prompt_tau) / len(per_prompt_tau))
    assert distinguishes
    assert len({rows[(m, "pooled")]["tau"] for m in ("dflash", "gated")}) == 2  # the override took effect


def test_conditioning_share(bench_run):
    rows = {(r["method"], r["prompt_set"]): r for r in bench_run[2]["results"]}
    assert rows[("dflash", "pooled")]["conditioning_share"] == 0.0
    assert rows[("dflash", "pooled")]["num_conditioned_rounds"] == 0
    for name in ("retrace", "gated"):
        row = rows[(name, "pooled")]
        assert row["num_conditioned_rounds"] > 0 and 0.0 < row["conditioning_share"] < 1.0


def test_conditioning_timer_restores_everything(assets):
    from hf_retrace.models import generation_retrace

    target = AutoModelForCausalLM.from_pretrained(assets / "target").eval()
    drafter = methods.load_drafter(str(assets / "drafter"), "corrected", torch.float32, "cpu")
    before = generation_retrace.build_rejected_trajectory
    prompt = random_prompt(6, seed=3)
    expected = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW)
    with ConditioningTimer(drafter) as timer:
        got = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW)
    assert got.tolist() == expected.tolist()  # timing changes nothing
    assert drafter.last_generation_stats.num_conditioned_rounds > 0 and timer.seconds > 0
    assert generation_retrace.build_rejected_trajectory is before and "project_context" not in vars(drafter)
    assert not drafter.retrace._forward_hooks and not drafter.retrace._forward_pre_hooks


def test_lossless_failure_is_loud(assets, monkeypatch, capsys):
    original = methods.Method.run

    def corrupted(self, target, input_ids, generate_kwargs, prompt_set, index):
        generation = original(self, target, input_ids, generate_kwargs, prompt_set, index)
        if self.name == "dflash" and index == 1:
            generation.token_ids[5] = (generation.token_ids[5] + 1) % 128
        return generation

    monkeypatch.setattr(methods.Method, "run", corrupted)
    out = assets / "out_bad"
    argv = ["--target", str(assets / "target"), "--dtype", "fp32", "--methods", f"dflash={assets / 'drafter'}",
            "--prompt-sets", f"{assets / 'ids.jsonl'}:2", "--max-new-tokens", "12", "--output-dir", str(out),
            "--no-progress", "--num-threads", "1"]  # fmt: skip
    assert bench.main(argv) == 1
    err = capsys.readouterr().err
    assert "LOSSLESS CHECK FAILED" in err and "'dflash'" in err and "ids#1" in err and "index 5" in err
    payload = json.loads((out / "results.json").read_text())
    lossless = {(r["method"], r["prompt_set"]): r["lossless"] for r in payload["results"]}
    assert lossless == {
        ("ar", "ids"): True,
        ("dflash", "ids"): False,
        ("ar", "pooled"): True,
        ("dflash", "pooled"): False,
    }
    failure = payload["lossless_failures"][0]
    assert failure["index"] == 5 and failure["logit_gap"] > 0  # ar's token is the target's argmax there
    assert "logit gap" in failure["message"]
    assert "**NO**" in (out / "results.md").read_text()


def test_sampling_mode_skips_the_lossless_check(assets):
    out = assets / "out_sample"
    argv = ["--target", str(assets / "target"), "--dtype", "fp32", "--methods", f"retrace={assets / 'drafter'}",
            "--prompt-sets", f"{assets / 'ids.jsonl'}:2", "--max-new-tokens", "10", "--do-sample", "--temperature",
            "0.7", "--seed", "3", "--output-dir", str(out), "--no-progress", "--num-threads", "1"]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["results"]
    assert all(r["lossless"] is None for r in rows) and all(r["tau"] >= 1.0 for r in rows)
    assert "sampling" in (out / "results.md").read_text()


def test_skinny_gemm_runs_every_method_on_the_same_kernels(assets, monkeypatch, tmp_path):
    """The skinny GEMM is on by default, as in `examples/01_generate.py`: it routes the target's and every drafter's
    linears (so `ar` runs them too), stays lossless, and is recorded in the run info; `--no-skinny-gemm` routes
    none."""
    routed = []

    def enable(model, tune_rows):
        routed.append((type(model).__name__, tune_rows))
        return real_enable(model, tune_rows=tune_rows)

    real_enable = skinny_gemm.enable_skinny_gemm
    monkeypatch.setattr(skinny_gemm, "enable_skinny_gemm", enable)  # the target's, via ..._where_it_pays
    monkeypatch.setattr(bench, "enable_skinny_gemm", enable)  # the drafters'
    argv = ["--target", str(assets / "target"), "--methods", f"ar,dflash={assets / 'drafter'}", "--prompt-sets",
            f"{assets / 'ids.jsonl'}:2", "--max-new-tokens", "12", "--output-dir", str(tmp_path),
            "--no-progress"]  # fmt: skip
    assert bench.main(argv) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert routed == [("Qwen3ForCausalLM", DEFAULT_TUNE_ROWS), ("ReTraceDrafterModel", DEFAULT_TUNE_ROWS)]
    assert payload["run"]["skinny_gemm"] is True and payload["run"]["skinny_gemm_tune_rows"] == DEFAULT_TUNE_ROWS
    assert all(row["lossless"] for row in payload["results"])
    assert "skinny GEMM linears" in (tmp_path / "results.md").read_text()

    routed.clear()
    assert bench.main([*argv, "--no-skinny-gemm"]) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert routed == [] and payload["run"]["skinny_gemm"] is False and payload["run"]["skinny_gemm_tune_rows"] == 0
    assert "stock linears" in (tmp_path / "results.md").read_text()


def test_skinny_gemm_default_matches_the_main_command():
    assert bench.make_parser().parse_args([]).skinny_gemm is True
    assert bench.make_parser().parse_args(["--no-skinny-gemm"]).skinny_gemm is False
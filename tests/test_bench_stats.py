"""Paired tau ratios of `hf_retrace.bench.stats`: exact ratios of pooled tau, intervals bounded by the extreme
resamples, and clear errors for names that are not in the run."""

import json

import pytest

from hf_retrace.bench.stats import main, paired_tau_ratio, paired_tau_table


def _gen(method, index, lengths, prompt_set="s"):
    return {"method": method, "prompt_set": prompt_set, "prompt_index": index, "acceptance_lengths": lengths}


GENERATIONS = [
    _gen("a", 0, [2, 2]), _gen("b", 0, [1, 1, 1, 1]),  # prompt 0: a's tau 2, b's 1 -> ratio 2
    _gen("a", 1, [1]), _gen("b", 1, [1]),  # prompt 1: both 1 -> ratio 1
]  # fmt: skip


def test_ratio_of_pooled_tau():
    r = paired_tau_ratio(GENERATIONS, "a", "b", num_resamples=500)
    assert (r["tau"], r["baseline_tau"]) == (pytest.approx(5 / 3), 1.0)  # tokens 5 over 3 cycles vs 5 over 5
    assert r["ratio"] == pytest.approx(5 / 3) and r["num_prompts"] == 2
    # every resample lies between drawing prompt 1 only (ratio 1) and prompt 0 only (ratio 2)
    low, high = r["ci95"]
    assert 1.0 <= low < r["ratio"] < high <= 2.0


def test_identical_methods_give_ratio_one_with_no_spread():
    gens = GENERATIONS + [_gen("c", 0, [2, 2]), _gen("c", 1, [1])]
    assert paired_tau_ratio(gens, "c", "a") | {"ci95": None} == {
        "method": "c", "baseline": "a", "num_prompts": 2, "tau": 5 / 3, "baseline_tau": 5 / 3, "ratio": 1.0,
        "ci95": None,
    }  # fmt: skip
    assert paired_tau_ratio(gens, "c", "a")["ci95"] == [1.0, 1.0]


def test_only_common_prompts_are_compared():
    gens = GENERATIONS + [_gen("a", 2, [5]), _gen("a", 0, [3], prompt_set="other")]
    assert paired_tau_ratio(gens, "a", "b")["ratio"] == pytest.approx(5 / 3)


def test_table_and_errors(tmp_path, capsys):
    assert [r["method"] for r in paired_tau_table(GENERATIONS, "b")] == ["a"]
    with pytest.raises(ValueError, match="not a method of this run"):
        paired_tau_table(GENERATIONS, "control")
    with pytest.raises(ValueError, match="num_resamples"):
        paired_tau_ratio(GENERATIONS, "a", "b", num_resamples=0)
    with pytest.raises(ValueError, match="share no prompt"):
        paired_tau_ratio(GENERATIONS + [_gen("x", 7, [1])], "x", "b")
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"generations": GENERATIONS}))
    main([str(path), "--baseline", "b", "--num-resamples", "100"])
    assert "| a | 2 | 1.667 | 1.000 | 1.667 |" in capsys.readouterr().out

"""The pure parts of `benchmarks/serving_paired.py` (two vLLM methods at once, one core each): the pair's parsing,
the cores of each round, the per-call summary, the rounds' geometric mean, the lossless check, and the paired call's
filler (with stand-in workers). No vLLM."""

import io
import json
import math
import sys
import time
import types
from pathlib import Path

import pytest


_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_BENCH))  # the bench's helpers import one another by module name, as the script does
import serving_engines  # noqa: E402
import serving_paired as paired  # noqa: E402


G = "vllm_dflash:speculation_policy=goodput"


def test_the_pair_keeps_its_order_and_adds_no_reference():
    a, b = paired.parse_pair(f"vllm_ar,{G}")
    assert (a.name, b.name) == ("vllm_ar", "vllm_dflash_goodput")
    on, off = paired.parse_pair(f"{G},{G}:env.HF_RETRACE_VLLM_LOAD_FALLBACK=0")  # no vllm_ar prepended
    assert (on.name, off.name, off.env) == ("vllm_dflash_goodput", "vllm_dflash_goodput_0",
                                            {"HF_RETRACE_VLLM_LOAD_FALLBACK": "0"})  # fmt: skip


@pytest.mark.parametrize("text, match", [
    (G, "exactly two"), (f"vllm_ar,vllm_suffix,{G}", "exactly two"), ("hf_ar,vllm_ar", "exactly two"),
    (f"{G},{G}", "must differ"),
])  # fmt: skip
def test_the_pair_refuses_anything_but_two_different_vllm_methods(text, match):
    with pytest.raises(ValueError, match=match):
        paired.parse_pair(text)


def test_cores_swap_every_round():
    assert [paired.cores_of_round(r) for r in range(3)] == [("0", "1"), ("1", "0"), ("0", "1")]


def _reply(seconds, outputs):
    return {"seconds": seconds, "counters": {},
            "outputs": [{"token_ids": list(range(n)), "first_token_s": first, "finish_s": finish}
                        for n, first, finish in outputs]}  # fmt: skip


def test_a_call_is_summarised_as_tokens_per_second_and_its_latencies():
    s = paired.side_summary(_reply(4.0, [(5, 1.0, 2.0), (3, 2.0, 3.0)]))
    assert s["tokens_per_s"] == 2.0 and s["new_tokens"] == 8
    assert s["ttft_ms"] == pytest.approx(1500.0)
    assert s["tpot_ms"] == pytest.approx(1e3 * (1.0 / 4 + 1.0 / 2) / 2)


def _row(group, r, ratio, tpot_a=10.0, tpot_b=8.0, a_out=((1, 2),), b_out=((1, 2),)):
    return {"round": r, "group": group, "b_over_a": ratio, "a": {"tpot_ms": tpot_a}, "b": {"tpot_ms": tpot_b},
            "prompts": [["unseen", "codeio", i] for i in range(len(a_out))],
            "a_outputs": [list(o) for o in a_out], "b_outputs": [list(o) for o in b_out]}  # fmt: skip


def test_rounds_combine_by_geometric_mean_per_group():
    summary = paired.summarize([_row("unseen", 0, 1.1), _row("unseen", 1, 0.9), _row("pool_eval", 0, 1.2)])
    assert summary["unseen"]["geomean"] == pytest.approx(math.sqrt(1.1 * 0.9))
    assert summary["unseen"]["b_over_a"] == [1.1, 0.9] and summary["pool_eval"]["rounds"] == 1
    assert summary["unseen"]["decode_geomean"] == pytest.approx(1.25)


def test_outputs_are_checked_only_against_the_target_alone():
    rows = [_row("unseen", 0, 1.0, a_out=((1, 2, 3), (4,)), b_out=((1, 9, 3), (4,)))]
    failures = paired.lossless_failures(rows, ("vllm_ar", "vllm_dflash"))
    assert len(failures) == 1 and "differ at token 1" in failures[0] and "codeio" in failures[0]
    assert paired.lossless_failures(rows, ("vllm_dflash", "vllm_dflash_0")) == []
    assert paired.lossless_failures([_row("unseen", 0, 1.0)], ("vllm_ar", "vllm_dflash")) == []


class FakeWorker:
    """A worker whose timed call takes `seconds`; its filler calls take `filler_seconds`."""

    def __init__(self, seconds, filler_seconds=0.02):
        self.seconds, self.filler_seconds, self.calls = seconds, filler_seconds, []

    def generate(self, prompts, max_new_tokens, cache_salt=None):
        self.calls.append((time.perf_counter(), len(prompts), cache_salt))
        time.sleep(self.filler_seconds if cache_salt else self.seconds)
        return _reply(self.seconds, [(max_new_tokens, 0.1, 0.2)] * len(prompts))


def test_the_faster_side_keeps_its_core_busy_until_the_slower_finishes():
    fast, slow = FakeWorker(0.05), FakeWorker(0.4)
    args = types.SimpleNamespace(max_new_tokens=4)
    a, b = paired.paired_call((fast, slow), [[1]] * 3, [[1]], args)
    assert a["seconds"] == 0.05 and b["seconds"] == 0.4
    assert abs(fast.calls[0][0] - slow.calls[0][0]) < 0.05  # the timed calls start together
    fillers = fast.calls[1:]
    assert len(fillers) >= 5 and all(n == 1 and salt.startswith("filler-") for _, n, salt in fillers)
    assert len({salt for _, _, salt in fillers}) == len(fillers)  # a fresh salt each: no prefix-cache reuse
    assert fillers[-1][0] >= slow.calls[0][0] + 0.4 - 0.1  # until the slow side's call ended (a sleep may overrun)
    assert len(slow.calls) <= 2  # the slow side fills at most one call's worth after it


def test_a_failed_side_is_reported_and_stops_the_other_filling():
    class Broken(FakeWorker):
        def generate(self, prompts, max_new_tokens, cache_salt=None):
            raise RuntimeError("engine died")

    other = FakeWorker(0.01)
    with pytest.raises(RuntimeError, match="engine died"):
        paired.paired_call((Broken(0.0), other), [[1]], [[1]], types.SimpleNamespace(max_new_tokens=2))
    assert len(other.calls) <= 2


def test_a_pinned_worker_runs_under_taskset_on_its_core(tmp_path, monkeypatch):
    seen = {}

    class FakePopen:
        def __init__(self, command, **kwargs):
            seen["command"], seen["env"] = command, kwargs["env"]
            self.stdout = io.StringIO(json.dumps({"ready": True}) + "\n")

    monkeypatch.setattr(serving_engines.subprocess, "Popen", FakePopen)
    worker = serving_engines.VllmWorker("target", None, tmp_path / "w.log", "compiled", "1", {}, pin=True)
    assert seen["command"][:3] == ["taskset", "--cpu-list", "1"] and seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert worker.info == {"ready": True}
    serving_engines.VllmWorker("target", None, tmp_path / "w.log", "compiled", "0-1", {})
    assert seen["command"][0] == str(serving_engines.VLLM_PYTHON)  # unpinned: vLLM binds its threads only
    worker._log.close()

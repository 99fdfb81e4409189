"""The cost-aware policy in transformers' path (`speculation_policy="goodput"`): greedy output is the target's token
for token across several `generate` calls of one drafter, whether rows are cheap (many tokens verified) or dear (plain
target steps); the online datastore learns across calls; the step costs come from the per-host cache, and a cache
file measured for another host is re-measured."""

import json

import pytest
import torch

from conftest import make_drafter, make_target, random_prompt
from hf_retrace import retrace_generate
from hf_retrace.models.cost_model_retrace import StepCostModel, default_cache_path
from hf_retrace.models.speculation_state_retrace import speculation_state, transformers_host_key


BLOCK = 6


@pytest.fixture(autouse=True)
def cost_cache(tmp_path, monkeypatch):
    """Step-cost files go to a fresh folder."""
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _costs(row_ms: float, drafter_ms: float) -> StepCostModel:
    """`t(R) = 10 ms + row_ms * (R - 1)`, `d(B) = drafter_ms`, frozen (no online refresh)."""
    rows = [(r, (10.0 + row_ms * (r - 1)) / 1e3) for r in (1, 2, 4, 8)]
    return StepCostModel.fit(rows, [(BLOCK, drafter_ms / 1e3)], alpha=0.0)


def _goodput_drafter(target, **settings):
    drafter = make_drafter(target, block_size=BLOCK)
    drafter.generation_config.update(speculation_policy="goodput", **settings)
    return drafter


def _greedy(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30, **kwargs)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("costs", ["cheap", "dear"])
def test_goodput_greedy_is_lossless_across_calls(arch, costs):
    target = make_target(arch)
    drafter = _goodput_drafter(target, online_datastore_num_tokens=6, prompt_lookup_num_tokens=4)
    cheap = costs == "cheap"
    speculation_state(drafter).cost_model = _costs(0.05, 0.5) if cheap else _costs(100.0, 100.0)
    widest, empty, forwards, online = 0, 0, 0, 0
    for i in range(6):
        prompt = random_prompt(5 + i % 3, seed=i % 3)  # each prompt twice: the online datastore has seen it
        generate = {"assistant_model": drafter} if i % 2 else {"custom_generate": retrace_generate, "drafter": drafter}
        assert _greedy(target, prompt, **generate).tolist() == _greedy(target, prompt).tolist(), f"call {i}"
        stats = drafter.last_generation_stats
        widest = max([widest, *stats.acceptance_lengths])
        empty, forwards = empty + stats.num_empty_steps, forwards + stats.num_drafter_forwards
        online += stats.num_online_datastore_cycles
    if cheap:  # many tokens per step, from the drafter and from what earlier calls served
        assert widest >= 4 and forwards > 0 and online > 0
    else:  # nothing pays: plain target steps, the drafter never runs
        assert forwards == 0 and widest == 1 and empty > 0
    assert speculation_state(drafter).num_requests == 6


def test_goodput_stops_drafting_blocks_it_never_verifies():
    """Rows cost more than the tiny random drafter's unsure drafts are worth: a drafted block verifies 0 drafts (a
    plain step), and the estimate that decides whether the drafter runs learns it, so it stops running."""
    target = make_target("qwen3")
    drafter = _goodput_drafter(target)
    state = speculation_state(drafter)
    state.cost_model = _costs(6.0, 0.01)
    steps = empty = forwards = 0
    for i in range(6):
        prompt = random_prompt(6, seed=10 + i)
        assert _greedy(target, prompt, assistant_model=drafter).tolist() == _greedy(target, prompt).tolist()
        stats = drafter.last_generation_stats
        steps, empty = steps + len(stats.acceptance_lengths), empty + stats.num_empty_steps
        forwards += stats.num_drafter_forwards
    assert 0 < forwards < steps // 10 and empty > 0
    assert state.estimator.expected_drafter_acceptance(None, 1)[0] < 0.6  # from its prior of 0.7


def test_cost_model_is_profiled_once_cached_and_refreshed(cost_cache):
    target = make_target("qwen3")
    drafter = _goodput_drafter(target)
    prompt = random_prompt(6, seed=1)
    assert _greedy(target, prompt, assistant_model=drafter).tolist() == _greedy(target, prompt).tolist()
    key = transformers_host_key(target, drafter)
    path = default_cache_path(key)
    assert path.is_file() and str(path).startswith(str(cost_cache))
    model = speculation_state(drafter).cost_models[key]
    assert model.num_observed > 0  # refreshed by the steps it timed
    stats = drafter.last_generation_stats
    assert len(stats.predicted_seconds) == len(stats.measured_seconds) == len(stats.acceptance_lengths)
    # a second drafter object (a new process, say) loads the file instead of profiling
    other = _goodput_drafter(target)
    _greedy(target, prompt, assistant_model=other)
    loaded = speculation_state(other).cost_models[key]
    assert loaded.target.sizes.tolist()[:2] == [1.0, 2.0]


def test_skinny_gemm_routing_changes_the_cost_key():
    from hf_retrace.skinny_gemm import disable_skinny_gemm, enable_skinny_gemm

    target = make_target("qwen3")
    drafter = _goodput_drafter(target)
    plain = transformers_host_key(target, drafter)
    enable_skinny_gemm(target)  # another GEMM path: another cost curve, so another cache file
    routed = transformers_host_key(target, drafter)
    assert routed.digest() != plain.digest()
    disable_skinny_gemm(target)
    assert transformers_host_key(target, drafter).digest() == plain.digest()


def test_a_cost_file_from_another_host_is_remeasured(cost_cache):
    target = make_target("qwen3")
    drafter = _goodput_drafter(target)
    key = transformers_host_key(target, drafter)
    path = default_cache_path(key)
    StepCostModel.fit([(1, 100.0), (2, 100.0)], [(BLOCK, 100.0)]).save(path, key)
    payload = json.loads(path.read_text())
    payload["key"]["cpu"] = "another CPU"  # measured elsewhere: 100 s a step would make goodput never speculate
    path.write_text(json.dumps(payload))
    prompt = random_prompt(6, seed=1)
    assert _greedy(target, prompt, assistant_model=drafter).tolist() == _greedy(target, prompt).tolist()
    model = speculation_state(drafter).cost_models[key]
    assert float(model.target_seconds(1)) < 1.0  # re-measured here, not trusted
    assert json.loads(path.read_text())["key"]["cpu"] == key.cpu  # and the file now holds this host's profile


def test_a_cost_file_of_this_key_but_another_speed_is_remeasured(cost_cache):
    """Machines of the same CPU model share the key: a file 1000x too slow for this one (goodput would never
    speculate) is checked against a timed target step and profiled again."""
    target = make_target("qwen3")
    drafter = _goodput_drafter(target)
    key = transformers_host_key(target, drafter)
    path = default_cache_path(key)
    StepCostModel.fit([(1, 100.0), (8, 100.0)], [(BLOCK, 100.0)]).save(path, key)  # the key matches
    prompt = random_prompt(6, seed=1)
    assert _greedy(target, prompt, assistant_model=drafter).tolist() == _greedy(target, prompt).tolist()
    assert float(speculation_state(drafter).cost_models[key].target_seconds(1)) < 1.0
    assert float(StepCostModel.load(path, key).target_seconds(1)) < 1.0  # the file holds this host's profile


def test_a_new_call_finishes_the_previous_request_in_the_online_datastore():
    target = make_target("qwen3")
    drafter = _goodput_drafter(target, online_datastore_num_tokens=6)
    speculation_state(drafter).cost_model = _costs(0.05, 0.5)
    _greedy(target, random_prompt(6, seed=3), assistant_model=drafter)
    store = speculation_state(drafter).online_datastore(32 * 2**20)
    assert store.num_requests == 1 and store.num_responses == 0  # the call's request is open until the next one
    _greedy(target, random_prompt(6, seed=4), assistant_model=drafter)
    assert store.num_requests == 1 and store.num_responses == 1
    assert "speculation_state" not in drafter.state_dict()


@pytest.mark.slow
def test_goodput_sampling_keeps_target_distribution():
    """`tests/test_sampling.py`'s check with goodput choosing the verified drafts from the drafter's confidences,
    some steps verifying none: the sampled tokens keep the target's marginals."""
    from test_sampling import PROMPT, SAMPLES, VOCAB, _exact_marginals, _tv

    target = make_target("qwen3", restricted=False, vocab_size=VOCAB, seed=4)
    with torch.no_grad():  # peaked distributions, so target and drafter clearly differ
        target.get_output_embeddings().weight.mul_(8.0)
    drafter = make_drafter(target, block_size=4, mode="corrected")
    drafter.generation_config.speculation_policy = "goodput"
    speculation_state(drafter).cost_model = StepCostModel.fit([(1, 0.010), (2, 0.013), (4, 0.019)], [(4, 0.001)],
                                                              alpha=0.0)  # fmt: skip
    exact = _exact_marginals(target)
    torch.manual_seed(0)
    counts = torch.zeros(3, VOCAB)  # tokens 2, 3 and 4
    accepted = empty = 0
    for _ in range(SAMPLES):
        out = target.generate(torch.tensor(PROMPT), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                              max_new_tokens=4, assistant_model=drafter, pad_token_id=0)  # fmt: skip
        for k in range(3):
            counts[k, out[0, -3 + k]] += 1
        stats = drafter.last_generation_stats
        accepted += sum(n > 1 for n in stats.acceptance_lengths)
        empty += stats.num_empty_steps
    for k in range(3):
        assert _tv(counts[k] / SAMPLES, exact[k]) < 0.07, f"token {k + 2}"
    assert empty > 0 and accepted > SAMPLES // 10, (empty, accepted)  # plain steps and accepted drafts both ran

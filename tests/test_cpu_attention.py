"""`hf_retrace.cpu_attention`: masked sdpa attention on the key/value heads turns on only where it applies, removes
the K/V copies of multi-row forwards, and keeps greedy speculative decoding lossless."""

import os

import pytest
import transformers.integrations.sdpa_attention as sdpa_attention

from conftest import assert_greedy_matches, make_drafter, make_target, random_prompt
from hf_retrace.cpu_attention import FORCE_GQA_ENV, enable_masked_gqa_sdpa, masked_gqa_skip_reason


@pytest.fixture
def no_switch(monkeypatch):
    """The process without the switch; monkeypatch restores it after the test (the function sets it)."""
    monkeypatch.delenv(FORCE_GQA_ENV, raising=False)


def test_skip_reasons_name_what_does_not_apply(no_switch):
    assert masked_gqa_skip_reason(make_target("qwen3")) is None  # sdpa, 4 query heads over 2 key/value heads
    eager = make_target("qwen3", attn_implementation="eager")
    assert "not sdpa" in masked_gqa_skip_reason(eager)
    assert "as many key/value heads" in masked_gqa_skip_reason(make_target("qwen3", num_key_value_heads=4))
    assert enable_masked_gqa_sdpa(eager) is False
    assert FORCE_GQA_ENV not in os.environ  # a model it does not apply to leaves the process as it was


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(FORCE_GQA_ENV, "0")
    assert enable_masked_gqa_sdpa(make_target("qwen3")) is False


def test_multi_row_forwards_stop_copying_the_key_value_heads(no_switch, monkeypatch):
    target = make_target("qwen3")
    copies, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: copies.append(h.shape) or repeat_kv(h, n))
    prompt = random_prompt(9, seed=0)

    def verify():  # 3 rows after a cached context of 6: a verification forward, which needs a mask
        cache = target(prompt[:, :6], use_cache=True).past_key_values
        target(prompt[:, 6:], cache=cache, use_cache=True)

    verify()
    assert copies  # the masked forward copied the key/value heads
    copies.clear()
    assert enable_masked_gqa_sdpa(target, "target") is True
    verify()
    assert copies == []


def test_greedy_stays_lossless_with_masked_gqa_attention(no_switch):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="corrected")
    expected = [target.generate(random_prompt(5, seed=i), do_sample=False, max_new_tokens=24) for i in range(4)]
    assert enable_masked_gqa_sdpa(target, "target")
    assert_greedy_matches(target, drafter, expected, "masked GQA")

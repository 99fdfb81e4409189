"""Prompt lookup in front of the drafter (`generation_config.prompt_lookup_num_tokens`): cycles whose context ends in
a recurring n-gram verify the tokens that followed it, the others are drafted, and output stays exactly the
target's."""

import numpy as np
import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from conftest import lossless_call_with, make_drafter, make_target, random_prompt
from hf_retrace.bench.replay import target_features
from hf_retrace.models.generation_retrace import ReTraceCandidateGenerator
from hf_retrace.models.lookup_retrace import prompt_lookup, prompt_lookup_match


def _lookup(ids, num_tokens=3, max_size=3, min_size=1):
    return prompt_lookup(np.array(ids), num_tokens, max_size, min_size)


def test_lookup_takes_the_earliest_match_of_the_longest_ngram():
    ids = [5, 6, 7, 8, 5, 6, 9, 5, 6]
    assert _lookup(ids) == [7, 8, 5]  # (9, 5, 6) does not recur; (5, 6) does, first at 0
    assert _lookup(ids, num_tokens=1) == [7]
    assert _lookup([1, 2, 3, 1, 2, 3, 4, 2, 3], max_size=3) == [1, 2, 3]  # (4, 2, 3) fails; (2, 3) first at 1
    assert _lookup([4, 1, 2, 4, 1, 2], num_tokens=5) == [4, 1, 2]  # (4, 1, 2) first at 0; 3 tokens follow it
    assert _lookup([3, 3]) == [3]


def test_lookup_respects_the_minimum_ngram_size():
    ids = [1, 2, 3, 4, 2]
    assert _lookup(ids, min_size=1) == [3, 4, 2]  # only the single token 2 recurs
    assert _lookup(ids, min_size=2) is None
    assert _lookup([7, 8, 9]) is None
    assert _lookup([7]) is None


def test_lookup_matches_transformers_prompt_lookup():
    generator = torch.Generator().manual_seed(0)
    found = 0
    for _ in range(200):
        ids = torch.randint(0, 4, (1, int(torch.randint(2, 12, (1,), generator=generator))), generator=generator)
        reference = PromptLookupCandidateGenerator(num_output_tokens=3, max_matching_ngram_size=2, max_length=100)
        expected, _ = reference.get_candidates(ids)
        got = prompt_lookup(ids[0].numpy(), 3, 2, 1)
        expected = expected[0, ids.shape[1] :].tolist()
        assert (got if got is not None else []) == expected, ids.tolist()
        found += got is not None
    assert found > 100  # most random 4-token sequences have a recurring n-gram, so both branches were compared


def _brute_force_match(ids: list[int], num_tokens: int, max_size: int, min_size: int):
    for n in range(min(max_size, len(ids) - 1), min_size - 1, -1):
        for start in range(len(ids) - n):  # windows ending at len - 2 at the latest: a token follows each
            if ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + num_tokens], n
    return None, 0


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_lookup_matches_whole_tokens_only(dtype):
    """The match searches the tokens' bytes: ids whose bytes line up across two tokens (0, 1, 256, 2^16, 2^24, ...)
    must not match there, at either width."""
    rng = np.random.default_rng(0)
    values = np.array([0, 1, 256, 2**16, 2**24, 2**30 + 5, 49151], dtype=dtype)
    for _ in range(3000):
        ids = rng.choice(values, int(rng.integers(1, 14)))
        max_size = int(rng.integers(1, 5))
        min_size = int(rng.integers(1, max_size + 1))
        expected = _brute_force_match(ids.tolist(), 4, max_size, min_size)
        assert prompt_lookup_match(ids, 4, max_size, min_size) == expected, (ids.tolist(), max_size, min_size)


@pytest.mark.parametrize("bad, message", [
    (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens must be >= 1"),
    (dict(prompt_lookup_min_ngram_size=0), "1 <= prompt_lookup_min_ngram_size"),
    (dict(max_matching_ngram_size=2, prompt_lookup_min_ngram_size=3), "got min 3 and max 2"),
])  # fmt: skip
def test_bad_lookup_settings_are_rejected(bad, message):
    drafter = make_drafter(make_target("qwen3"), block_size=4, mode="off")
    drafter.generation_config.update(**bad)
    with pytest.raises(ValueError, match=message):
        drafter.decoding_settings()


def _record_cycles(monkeypatch):
    """Records `(T, cycle, candidate tokens)` per `get_candidates` call of a verification cycle."""
    cycles, original = [], ReTraceCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidate_ids, logits = original(self, input_ids, *args, **kwargs)
        if self._drafted or self._cycle_source is not None:
            kind = "draft" if self._drafted else {"prompt_lookup": "lookup"}[self._cycle_source]
            cycles.append((input_ids.shape[1], kind, candidate_ids[0, input_ids.shape[1] :].tolist()))
        return candidate_ids, logits

    monkeypatch.setattr(ReTraceCandidateGenerator, "get_candidates", recording)
    return cycles


@pytest.mark.parametrize("mode", ["off", "corrected"])
def test_lookup_before_the_drafter_is_lossless(mode, monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode=mode)
    drafter.generation_config.prompt_lookup_num_tokens = 3
    drafter.generation_config.num_assistant_tokens = 2
    cycles = _record_cycles(monkeypatch)
    lookups = drafted = 0
    for i in range(6):
        prompt = random_prompt(4 + i, seed=i)
        expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30)
        cycles.clear()
        got = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30, assistant_model=drafter)
        assert got.tolist() == expected.tolist(), f"{mode}: output differs on prompt {i}"
        stats = drafter.last_generation_stats
        assert len(stats.acceptance_lengths) == len(cycles) == len(stats.retained_lengths)
        assert stats.num_lookup_cycles == sum(kind == "lookup" for _, kind, _ in cycles)
        assert stats.num_drafter_forwards == sum(kind == "draft" for _, kind, _ in cycles)
        assert all(len(tokens) <= 3 for _, kind, tokens in cycles if kind == "lookup")
        for (_, kind, _), retained in zip(cycles, stats.retained_lengths):
            assert kind == "draft" or retained == 0  # a lookup cycle hands no suffix on
        lookups += stats.num_lookup_cycles
        drafted += stats.num_drafter_forwards
    assert lookups > 5 and drafted > 5, (lookups, drafted)  # both kinds of cycle ran, so the mix was tested


def test_the_drafter_catches_up_on_the_features_of_lookup_cycles(monkeypatch):
    """A drafted cycle after lookup cycles drafts exactly what the drafter drafts from the full context: the target
    features of every committed position, here recomputed by one forward over the final sequence."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="off")
    config = drafter.config
    drafter.generation_config.prompt_lookup_num_tokens = 2
    cycles = _record_cycles(monkeypatch)
    checked_after_lookup = 0
    for i in range(12):
        if checked_after_lookup >= 4:
            break
        prompt = random_prompt(5 + i, seed=10 + i)
        cycles.clear()
        out = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=40, assistant_model=drafter)
        features = target_features(target, out, config.target_layer_ids)  # [1, T, F]
        with torch.no_grad():
            for c, (length, kind, tokens) in enumerate(cycles):
                if kind != "draft":
                    continue
                anchor = length - 1  # the block is [x_anchor, mask ...] at positions anchor .. anchor + B - 1
                slots = torch.full((1, config.block_size), config.mask_token_id)
                slots[0, 0] = out[0, anchor]
                states = drafter(target.get_input_embeddings()(slots), features[:, :anchor]).last_hidden_state
                drafts = target.get_output_embeddings()(states[:, 1:]).argmax(-1)[0].tolist()
                assert tokens == drafts[: len(tokens)], f"prompt {i}, cycle {c}"
                checked_after_lookup += c > 0 and cycles[c - 1][1] == "lookup"
    assert checked_after_lookup >= 4  # drafted cycles right after lookup cycles were compared


def test_generate_kwargs_turn_lookup_on_and_override_the_config():
    drafter, again = lossless_call_with(24, prompt_lookup_num_tokens=2)
    assert drafter.last_generation_stats.num_lookup_cycles > 0
    assert drafter.generation_config.prompt_lookup_num_tokens is None  # generate's setting is for that call only
    again()
    assert drafter.last_generation_stats.num_lookup_cycles == 0
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be >= 1"):
        again(prompt_lookup_num_tokens=0)


def test_sampling_with_lookup_runs_both_kinds_of_cycle():
    """Under sampling, lookup cycles carry no draft logits, so transformers checks them against the target's own
    samples (exact for any candidate); drafted cycles use speculative sampling. The distribution tests of
    `test_sampling.py` cover the drafted path; this checks the mix runs and commits every token once."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="corrected")
    drafter.generation_config.prompt_lookup_num_tokens = 3
    torch.manual_seed(0)
    out = target.generate(random_prompt(6, seed=4), do_sample=True, pad_token_id=0, max_new_tokens=40,
                          assistant_model=drafter)  # fmt: skip
    stats = drafter.last_generation_stats
    assert out.shape[1] == 6 + 40
    assert stats.num_lookup_cycles > 0 and stats.num_drafter_forwards > 0
    assert sum(stats.acceptance_lengths) <= 40 - 1

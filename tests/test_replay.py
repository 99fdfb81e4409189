"""The offline replay of greedy DFlash cycles (`hf_retrace.bench.replay`) reproduces what generation does, cycle for
cycle, so drafters can be scored on the bench's prompts without the decoding loop."""

import pytest
import torch

from conftest import make_drafter, make_target, random_prompt
from hf_retrace.bench.replay import (
    ReplayResult, anchor_acceptance, anchor_scores, lookup_acceptance, replay_cycles,
)  # fmt: skip


@pytest.mark.parametrize(
    "anchor_broadcast, vocab, num_assistant_tokens, threshold",
    [
        (False, None, None, None),
        (True, [5, 6, 7, 9, 11], None, None),
        (False, None, 2, None),
        (False, None, None, 0.5),
    ],
)
def test_replayed_cycles_are_the_generated_ones(anchor_broadcast, vocab, num_assistant_tokens, threshold):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="off", anchor_broadcast=anchor_broadcast)
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    # k < B-1: generation verifies the first k drafts of each full block, which the replay caps acceptance at; a
    # confidence stop verifies the leading confident ones, which the replay reads from the slot confidences
    drafter.generation_config.num_assistant_tokens = num_assistant_tokens
    drafter.generation_config.assistant_confidence_threshold = threshold
    limits = dict(num_assistant_tokens=num_assistant_tokens, assistant_confidence_threshold=threshold)
    replay, generated, lengths_seen = ReplayResult(**limits), [], set()
    expected_lengths = set(range(1, (num_assistant_tokens or 3) + 2))
    widths = []  # tokens of each target forward: the prefill, then one verification per cycle
    target.register_forward_hook(lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]),
                                 with_kwargs=True)  # fmt: skip
    for i in range(16):
        prompt = random_prompt(3 + i % 5, seed=i)
        widths.clear()
        out = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=17 + i, assistant_model=drafter)
        generated.append(drafter.last_generation_stats.acceptance_lengths)
        verified = widths[1 : 1 + len(generated[-1])]
        replay.add(anchor_scores(target, drafter, out, prompt.shape[1]))
        assert replay.cycles[-1] == generated[-1], f"prompt {i}"
        assert replay.verified[-1] == verified, f"prompt {i}"
        lengths_seen.update(generated[-1])
        if i >= 3 and lengths_seen == expected_lengths:
            break
    assert lengths_seen == expected_lengths  # every acceptance length occurred, so the walk was really exercised
    assert replay.tau == pytest.approx(sum(map(sum, generated)) / sum(map(len, generated)))


def test_a_block_cut_short_replays_what_generation_runs():
    """`hf-retrace replay --block-sizes`: a drafter told to run fewer slots than it was trained on (its config's
    `block_size`, which both generation and the replay read) drafts `B-1` tokens a cycle, and the replay still
    reproduces generation's cycles."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=5, mode="off", anchor_broadcast=True)
    drafter.config.block_size = 3  # the anchor term, too, reads its block from the config
    replay, generated = ReplayResult(), []
    for i in range(6):
        prompt = random_prompt(3 + i, seed=100 + i)
        out = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20, assistant_model=drafter)
        alone = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20)
        torch.testing.assert_close(out, alone, rtol=0, atol=0)  # lossless with the shorter block too
        generated.append(drafter.last_generation_stats.acceptance_lengths)
        scores = anchor_scores(target, drafter, out, prompt.shape[1])
        assert {len(slots) for slots in scores.confidence} == {2}  # B-1 = 2 drafts per block, not the trained 4
        replay.add(scores)
        assert replay.cycles[-1] == generated[-1], f"prompt {i}"
    assert max(map(max, generated)) <= 3


@pytest.mark.parametrize("num_assistant_tokens", [None, 2])
def test_replayed_cycles_with_prompt_lookup_are_the_generated_ones(num_assistant_tokens):
    """Prompt lookup in front of the drafter: the walk takes the lookup's candidates where an n-gram recurs and the
    drafter's block elsewhere, which reproduces generation (and its verification widths) cycle for cycle."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="off")
    drafter.generation_config.num_assistant_tokens = num_assistant_tokens
    drafter.generation_config.prompt_lookup_num_tokens = 3
    replay, lookup_cycles = ReplayResult(num_assistant_tokens=num_assistant_tokens), 0
    widths = []
    target.register_forward_hook(lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]),
                                 with_kwargs=True)  # fmt: skip
    for i in range(6):
        prompt = random_prompt(4 + i, seed=20 + i)
        widths.clear()
        out = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30, assistant_model=drafter)
        stats = drafter.last_generation_stats
        lookups = lookup_acceptance(out, prompt.shape[1], 3, 3, 2)
        replay.add(anchor_acceptance(target, drafter, out, prompt.shape[1]), lookups)
        assert replay.cycles[-1] == stats.acceptance_lengths, f"prompt {i}"
        if num_assistant_tokens is not None:  # every cycle's width is known: the lookup's m + 1, or k + 1
            assert replay.verified[-1] == widths[1 : 1 + len(stats.acceptance_lengths)], f"prompt {i}"
        lookup_cycles += stats.num_lookup_cycles
    assert lookup_cycles > 5  # the lookup branch of the walk was exercised


def test_replayed_cycles_with_prompt_and_datastore_lookup_are_the_generated_ones():
    """Datastore lookup behind prompt lookup: the walk takes whichever proposes at each anchor, as generation does."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="off")
    responses = []
    for seed in range(3):  # the target's own responses: on these prompts the datastore proposes whole stretches
        prompt = random_prompt(5, seed=seed)
        responses.append(target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30)[0, 5:].tolist())
    drafter.set_datastore(responses)
    drafter.generation_config.update(datastore_num_tokens=3, datastore_min_ngram_size=2, prompt_lookup_num_tokens=2)
    datastore = drafter.datastore(3, drafter.generation_config.datastore_max_ngram_size, 2)
    replay, datastore_cycles = ReplayResult(), 0
    for seed in range(6):
        prompt = random_prompt(5, seed=seed)
        out = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30, assistant_model=drafter)
        stats = drafter.last_generation_stats
        lookups = lookup_acceptance(out, prompt.shape[1], 2, 3, 2, datastore=datastore)
        replay.add(anchor_acceptance(target, drafter, out, prompt.shape[1]), lookups)
        assert replay.cycles[-1] == stats.acceptance_lengths, f"prompt {seed}"
        datastore_cycles += stats.num_datastore_cycles
    assert datastore_cycles > 5  # the datastore branch was exercised


def test_lookup_acceptance_scores_the_candidates_at_every_anchor():
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 9]])  # prompt [1, 2, 3]; anchors at positions 3 .. 7
    # anchor 3 ([1, 2, 3, 1]): single tokens only, below the minimum of 2; anchor 4 ((1, 2) recurs): [3, 1, 2]
    # against [3, 1, 2]: 3 accepted; anchor 5 ((1, 2, 3) recurs): [1, 2, 3] against [1, 2, 9]: 2; anchor 6
    # ((2, 3, 1) at 1): [2, 3, 1] against [2, 9]: 1; anchor 7 ((3, 1, 2) at 2): [3, 1, 2] against [9]: 0
    assert lookup_acceptance(ids, 3, num_tokens=3) == [None, (3, 3), (3, 2), (3, 1), (3, 0)]


def test_the_walk_weights_cycles_not_anchors():
    # an easy stretch (a = 3) crossed in one cycle, then hard anchors (a = 0) one token at a time
    acceptance = [3, 3, 3, 3, 0, 0, 0, 0, 0]
    assert replay_cycles(acceptance) == [4, 1, 1, 1, 1]  # + the prefill token and one plain step = 10 tokens
    result = ReplayResult()
    result.add(acceptance)
    assert result.tau == pytest.approx(8 / 5)
    assert result.anchor_mean == pytest.approx(1 + 12 / 9)
    assert replay_cycles([5, 5, 5]) == [3]  # the last cycle ends on the last token: its bonus, not a draft
    assert replay_cycles([0, 0, 2]) == [1, 1]  # one token left: a plain target step, not a drafted cycle
    assert replay_cycles(acceptance, num_assistant_tokens=1) == [2, 2, 1, 1, 1, 1]  # a capped at k = 1

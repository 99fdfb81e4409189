"""The reduced draft vocabulary: drafts scored over K rows of the target head, scattered back with -inf, lossless."""

import pytest
import torch

from conftest import SUPPORT, VOCAB, make_drafter, make_target, random_prompt
from hf_retrace import ReTraceDrafterModel
from hf_retrace.trainer.draft_vocab import TrainingDraftHead, coverage, most_frequent_tokens
from hf_retrace.models.draft_head_retrace import DraftLMHead, draft_lm_head


def _greedy(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, pad_token_id=0, **kwargs)


def test_draft_head_scores_only_the_draft_vocabulary():
    target = make_target("llama", restricted=False)
    head = target.get_output_embeddings()
    ids = torch.tensor([2, 5, 9, 40])
    draft_head = draft_lm_head(head, None, ids)
    assert isinstance(draft_head, DraftLMHead) and draft_head.weight.shape == (4, head.weight.shape[1])
    assert draft_lm_head(head, None, ids) is draft_head  # cached per (head, ids)
    states = torch.randn(1, 3, head.weight.shape[1])
    logits = draft_head(states)  # [1, 3, V]
    full = head(states)
    assert logits.shape == full.shape
    torch.testing.assert_close(logits[..., ids], full[..., ids])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[..., outside]).all()
    assert set(draft_head(states).argmax(-1).flatten().tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("vocab", [list(SUPPORT), [SUPPORT[0], SUPPORT[1], 11, 12]])  # all greedy tokens / not c
def test_greedy_is_lossless_with_a_reduced_vocabulary(vocab):
    """The restricted target only emits SUPPORT = (a, b, c). With c outside the draft vocabulary every c is a
    rejection, and output must still equal target-only greedy."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="corrected")
    drafter.set_draft_vocab(vocab)
    assert drafter.config.draft_vocab_size == len(vocab)
    accepted = conditioned = 0
    for i in range(6):
        prompt = random_prompt(3 + i, seed=i)
        expected = _greedy(target, prompt, max_new_tokens=25)
        got = _greedy(target, prompt, max_new_tokens=25, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
        stats = drafter.last_generation_stats
        accepted += sum(n > 1 for n in stats.acceptance_lengths)
        conditioned += stats.num_conditioned_rounds
    assert accepted > 0 and conditioned > 0  # drafts were accepted and ReTrace conditioning ran


def test_draft_vocabulary_is_saved_and_loaded(tmp_path):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.set_draft_vocab([9, 3, 70])
    drafter.save_pretrained(tmp_path)
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size == 3 and loaded.draft_vocab_ids.tolist() == [3, 9, 70]
    full = ReTraceDrafterModel.from_target(target, num_hidden_layers=1)
    assert full.draft_vocab_ids is None and full.config.draft_vocab_size is None
    # the ids only pick rows of the target's head: a trained drafter's vocabulary can be swapped, or dropped
    loaded.set_draft_vocab([5, 9])
    assert loaded.draft_vocab_ids.tolist() == [5, 9] and "draft_vocab_ids" in loaded.state_dict()
    loaded.set_draft_vocab(None)
    loaded.save_pretrained(tmp_path / "full")
    reloaded = ReTraceDrafterModel.from_pretrained(tmp_path / "full")
    assert reloaded.draft_vocab_ids is None and reloaded.config.draft_vocab_size is None
    assert "draft_vocab_ids" not in reloaded.state_dict()
    prompt = random_prompt(5, seed=0)
    expected = _greedy(target, prompt, max_new_tokens=12)
    assert _greedy(target, prompt, max_new_tokens=12, assistant_model=reloaded).tolist() == expected.tolist()


def test_bad_draft_vocabularies_are_rejected():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="distinct"):
        drafter.set_draft_vocab([3, 3])
    with pytest.raises(ValueError, match=r"\[0, vocab_size=128\)"):
        drafter.set_draft_vocab([3, 500])
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        type(drafter.config)(**{**drafter.config.to_dict(), "draft_vocab_size": 0})


def test_most_frequent_tokens_and_coverage():
    sequences = [[5, 5, 5, 7, 9], [7, 7, 2]]
    assert most_frequent_tokens(sequences, 2) == [5, 7]
    assert most_frequent_tokens(sequences, 3) == [2, 5, 7]  # ties (2 and 9 once each) break by the smaller id
    assert coverage(sequences, [5, 7]) == pytest.approx(6 / 8)
    with pytest.raises(ValueError, match="only 4 distinct tokens"):
        most_frequent_tokens(sequences, 5)
    # prompt-only tokens come after every response token, then the smallest unused ids fill what is left
    prompts = [[11, 11, 5, 12], [3]]
    assert most_frequent_tokens(sequences, 5, prompts=prompts) == [2, 5, 7, 9, 11]
    assert most_frequent_tokens(sequences, 8, prompts=prompts, vocab_size=16) == [0, 2, 3, 5, 7, 9, 11, 12]
    assert most_frequent_tokens(sequences, 9, prompts=prompts, vocab_size=16) == [0, 1, 2, 3, 5, 7, 9, 11, 12]
    with pytest.raises(ValueError, match="exceeds the target vocabulary"):
        most_frequent_tokens(sequences, 17, vocab_size=16)


def test_training_head_maps_labels_and_drafts():
    head = torch.nn.Linear(4, 10, bias=False)
    train_head = TrainingDraftHead.from_lm_head(head, torch.tensor([1, 4, 8]))
    assert train_head.weight.shape == (3, 4)
    assert train_head.full_to_draft.tolist() == [-1, 0, -1, -1, 1, -1, -1, -1, 2, -1]
    states = torch.randn(2, 5, 4)
    expected = torch.tensor([1, 4, 8])[(states @ head.weight[[1, 4, 8]].T).argmax(-1)]
    assert torch.equal(train_head.greedy_ids(states, chunk_rows=3), expected)


def test_draft_vocab_command_reranks_a_saved_drafter_on_pools(tmp_path, capsys):
    """`hf-retrace draft-vocab`: the new vocabulary holds the pools' response tokens first (the restricted target
    answers in SUPPORT only), ranked on the first END rows of a `DIR:END` pool, and the drafter loads with it."""
    from hf_retrace.cli import main as cli_main
    from hf_retrace.data.continuous_generation import PromptItem
    from hf_retrace.data.pool import build_pool, read_token_shards

    target = make_target("llama")
    items = [PromptItem(i, "rand", random_prompt(3 + i, seed=i)[0].tolist()) for i in range(4)]
    build_pool(target, items, tmp_path / "pool", None, eos_token_ids={-1}, layer_ids=[0], target_name="tiny",
               batch_size=2, max_new_tokens=6)  # fmt: skip
    drafter = make_drafter(target)
    drafter.set_draft_vocab([60, 61, 62])
    drafter.save_pretrained(tmp_path / "drafter")
    argv = ["draft-vocab", "--drafter", str(tmp_path / "drafter"), "--pool", f"{tmp_path / 'pool'}:3", "--size", "3"]
    assert cli_main(argv + ["--output", str(tmp_path / "out")]) == 0
    assert "cover 100.00% of 3 pool responses (the loaded drafter's 3 tokens: 0.00%)" in capsys.readouterr().out
    reranked = ReTraceDrafterModel.from_pretrained(tmp_path / "out")
    answered = {t for row in read_token_shards(tmp_path / "pool")[:3] for t in row["response_ids"]}
    assert answered <= set(SUPPORT) and answered <= set(reranked.draft_vocab_ids.tolist())
    assert reranked.config.draft_vocab_size == 3
    torch.testing.assert_close(reranked.fc.weight, drafter.fc.weight)  # only the vocabulary changed
    with pytest.raises(ValueError, match="END must be in"):
        cli_main(argv[:4] + [f"{tmp_path / 'pool'}:9", "--size", "3", "--output", str(tmp_path / "bad")])

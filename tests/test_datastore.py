"""Datastore lookup (`config.datastore_num_tokens`, REST): cycles whose context ends in an n-gram of the drafter's
datastore verify a walk of the tokens that most often followed it there, the others are drafted, and output stays
exactly the target's."""

import collections
import random

import pytest
import torch

from conftest import make_drafter, make_target, random_prompt
from hf_retrace import ReTraceDrafterConfig, ReTraceDrafterModel
from hf_retrace.models.datastore_retrace import SEPARATOR, NgramDatastore, _suffix_keys, _window_keys


def _flat(responses):
    return torch.tensor([token for response in responses for token in (*response, SEPARATOR)])


def _reference_next(responses, context, sizes):
    """Brute force: the set of most frequent next tokens of the longest n-gram ending `context`, or None."""
    for n in sizes:
        counts = collections.Counter(r[i] for r in responses for i in range(n, len(r)) if r[i - n : i] == context[-n:])
        if len(context) >= n and counts:
            top = max(counts.values())
            return {token for token, k in counts.items() if k == top}
    return None


def test_datastore_walks_the_most_frequent_next_token_of_the_longest_ngram():
    rng = random.Random(0)
    responses = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    index = NgramDatastore(_flat(responses), num_tokens=3, max_ngram_size=4, min_ngram_size=2)
    lengths = collections.Counter()
    for _ in range(500):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 7))]
        got = index.candidates(torch.tensor(context))
        proposed = [] if got is None else got.tolist()
        for token in proposed:  # every step follows the longest n-gram of the context extended so far
            assert token in _reference_next(responses, context, [4, 3, 2]), (context, proposed)
            context = context + [token]
        if len(proposed) < 3:  # and the walk stops only where no n-gram matches
            assert _reference_next(responses, context, [4, 3, 2]) is None, (context, proposed)
        lengths[len(proposed)] += 1
    assert lengths[0] > 10 and lengths[3] > 250, lengths  # both ends of the walk were checked


def test_suffix_keys_are_the_table_keys():
    """A lookup hashes its query in Python integers, the index its corpus with tensors: the keys must be equal."""
    ids = torch.randint(0, 2**18, (40,), generator=torch.Generator().manual_seed(0))
    sizes = [6, 5, 4, 3, 1]
    table = _window_keys(ids, set(sizes))
    for i in range(len(ids) + 1):
        query = _suffix_keys(ids[:i].tolist(), sizes)
        assert sorted(query) == sorted(n for n in sizes if n <= i)
        for n, key in query.items():
            assert key == int(table[n][i]), (i, n)


def test_datastore_never_spans_two_responses():
    index = NgramDatastore(_flat([[1, 2, 3], [4, 5, 6, 7]]), num_tokens=2, max_ngram_size=2, min_ngram_size=1)
    assert index.candidates(torch.tensor([9, 4])).tolist() == [5, 6]
    assert index.candidates(torch.tensor([5])).tolist() == [6, 7]
    assert index.candidates(torch.tensor([2])).tolist() == [3]  # 3 ends its response: the walk stops there
    assert index.candidates(torch.tensor([3])) is None  # nothing of the next response follows 3
    assert index.candidates(torch.tensor([4, 5]), num_tokens=1).tolist() == [6]
    assert index.candidates(torch.tensor([4]), num_tokens=5).tolist() == [5, 6]  # never past its own num_tokens
    with pytest.raises(ValueError, match="num_tokens >= 1, got 0"):
        index.num_tokens = 0
    tiny = NgramDatastore(_flat([[1, 2]]), num_tokens=3, max_ngram_size=6, min_ngram_size=3)  # shorter than n + 1
    assert tiny.candidates(torch.tensor([1, 2])) is None and tiny.candidates(torch.tensor([1, 2, 1, 2])) is None


@pytest.mark.parametrize("bad, message", [
    (dict(datastore_num_tokens=3), "the drafter has no datastore"),
    (dict(datastore_num_tokens=0, datastore_size=10), "datastore_num_tokens must be >= 1"),
    (dict(datastore_size=0), "datastore_size must be >= 1"),
    (dict(datastore_max_ngram_size=2, datastore_min_ngram_size=3), "got min 3 and max 2"),
])  # fmt: skip
def test_bad_datastore_settings_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        ReTraceDrafterConfig(vocab_size=64, hidden_size=32, num_target_layers=4, mask_token_id=1, **bad)


def test_set_datastore_rejects_tokens_outside_the_vocabulary():
    drafter = make_drafter(make_target("qwen3"), block_size=4, mode="off")
    with pytest.raises(ValueError, match="token-id lists in"):
        drafter.set_datastore([[1, 2, drafter.config.vocab_size]])
    drafter.config.datastore_num_tokens = 2
    with pytest.raises(ValueError, match="the drafter has no datastore"):
        drafter.config.check_datastore(2, 6, 3, drafter.config.datastore_size)


def _greedy_responses(target, seeds, new_tokens=30):
    out = []
    for seed in seeds:
        prompt = random_prompt(5, seed=seed)
        ids = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=new_tokens)
        out.append(ids[0, prompt.shape[1] :].tolist())
    return out


@pytest.mark.parametrize("mode", ["off", "corrected"])
def test_datastore_lookup_is_lossless_and_runs_beside_drafts_and_prompt_lookup(mode):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode=mode)
    # the target's own responses to half of the prompts: on those the datastore predicts whole stretches
    drafter.set_datastore(_greedy_responses(target, range(4)))
    drafter.config.datastore_num_tokens = 3
    drafter.config.datastore_min_ngram_size = 2
    drafter.config.prompt_lookup_num_tokens = 2
    totals = collections.Counter()
    for seed in range(8):
        prompt = random_prompt(5, seed=seed)
        expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30)
        got = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=30, assistant_model=drafter)
        assert got.tolist() == expected.tolist(), f"{mode}: output differs on prompt {seed}"
        stats = drafter.last_generation_stats
        cycles = len(stats.acceptance_lengths)
        assert cycles == stats.num_drafter_forwards + stats.num_lookup_cycles + stats.num_datastore_cycles
        totals.update(datastore=stats.num_datastore_cycles, lookup=stats.num_lookup_cycles,
                      draft=stats.num_drafter_forwards)  # fmt: skip
    assert min(totals.values()) > 3, totals  # all three kinds of cycle ran


def _saved_drafter_with_datastore(folder, num_responses):
    """A tiny drafter with the target's responses to `num_responses` prompts as its datastore, saved to `folder`."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="off")
    drafter.set_datastore(_greedy_responses(target, range(num_responses)))
    drafter.config.datastore_num_tokens = 2
    drafter.save_pretrained(folder)
    return target, drafter


def test_datastore_round_trips_through_save_pretrained(tmp_path):
    target, drafter = _saved_drafter_with_datastore(tmp_path, 3)
    assert (tmp_path / "datastore_retrace.py").is_file()  # the remote-code copy needs it
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.datastore_token_ids, drafter.datastore_token_ids)
    assert loaded.datastore_token_ids.dtype == torch.int32
    prompt = random_prompt(5, seed=1)
    expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20)
    got = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20, assistant_model=loaded)
    assert got.tolist() == expected.tolist()
    assert loaded.last_generation_stats.num_datastore_cycles > 0
    loaded.set_datastore(None)
    assert loaded.config.datastore_size is None and loaded.config.datastore_num_tokens is None


def test_sampling_with_datastore_lookup_commits_every_token_once():
    """Datastore cycles carry no draft logits, so under sampling transformers checks them against the target's own
    samples (exact for any candidate), as for prompt lookup."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="corrected")
    drafter.set_datastore(_greedy_responses(target, range(4)))
    drafter.config.datastore_num_tokens = 3
    drafter.config.datastore_min_ngram_size = 1
    torch.manual_seed(0)
    out = target.generate(random_prompt(5, seed=0), do_sample=True, pad_token_id=0, max_new_tokens=40,
                          assistant_model=drafter)  # fmt: skip
    stats = drafter.last_generation_stats
    assert out.shape[1] == 5 + 40
    assert stats.num_datastore_cycles > 0


def test_datastore_command_stores_pool_responses_with_the_drafter(tmp_path, capsys):
    """`hf-retrace datastore`: the first END rows of a `DIR:END` pool become the drafter's datastore, saved with it."""
    from hf_retrace.cli import main as cli_main
    from hf_retrace.data.continuous_generation import PromptItem
    from hf_retrace.data.pool import build_pool, read_token_shards

    target = make_target("llama")
    items = [PromptItem(i, "rand", random_prompt(3 + i, seed=i)[0].tolist()) for i in range(4)]
    build_pool(target, items, tmp_path / "pool", None, eos_token_ids={-1}, layer_ids=[0], target_name="tiny",
               batch_size=2, max_new_tokens=6)  # fmt: skip
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    argv = ["datastore", "--drafter", str(tmp_path / "drafter"), "--pool", f"{tmp_path / 'pool'}:3"]
    assert cli_main(argv + ["--num-tokens", "2", "--output", str(tmp_path / "out")]) == 0
    assert "datastore of 3 responses, 21 tokens with separators" in capsys.readouterr().out
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path / "out")
    first_rows = read_token_shards(tmp_path / "pool")[:3]
    assert loaded.datastore_token_ids.tolist() == [t for row in first_rows for t in (*row["response_ids"], SEPARATOR)]
    assert loaded.config.datastore_num_tokens == 2 and loaded.config.datastore_min_ngram_size == 3
    with pytest.raises(ValueError, match="END must be in"):
        cli_main(argv[:4] + [f"{tmp_path / 'pool'}:9", "--output", str(tmp_path / "bad")])


def test_a_checkpoint_without_its_datastore_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    target, _ = _saved_drafter_with_datastore(tmp_path, 2)
    weights = load_file(tmp_path / "model.safetensors")
    weights.pop("datastore_token_ids")  # the buffer is then left uninitialised by from_pretrained
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path)
    loaded.datastore_token_ids.fill_(0)  # uninitialised memory is often zeros: in the vocabulary, no separator
    with pytest.raises(ValueError, match="the checkpoint lacks or corrupts it"):
        target.generate(random_prompt(5, seed=0), do_sample=False, pad_token_id=0, max_new_tokens=4,
                        assistant_model=loaded)  # fmt: skip

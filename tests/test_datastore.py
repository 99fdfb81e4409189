"""Datastore lookup (`generation_config.datastore_num_tokens`, REST): cycles whose context ends in an n-gram of the
drafter's datastore verify a walk of the tokens that most often followed it there, the others are drafted, and output
stays exactly the target's; `datastore.safetensors`, the file beside the weights (`docs/formats.md`)."""

import collections
import json
import random

import numpy as np
import pytest
import torch

from conftest import make_drafter, make_target, random_prompt
from safetensors import safe_open
from safetensors.torch import load_file

from hf_retrace import ReTraceDrafterModel
from hf_retrace.models.datastore_file_retrace import DATASTORE_FILE, load_datastore_file, save_datastore_file
from hf_retrace.models import lookup_retrace
from hf_retrace.models.lookup_retrace import SEPARATOR, NgramDatastore, _suffix_keys, _window_keys


def _flat(responses):
    return np.array([token for response in responses for token in (*response, SEPARATOR)])


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
        got = index.candidates(np.array(context))
        proposed = [] if got is None else got
        for token in proposed:  # every step follows the longest n-gram of the context extended so far
            assert token in _reference_next(responses, context, [4, 3, 2]), (context, proposed)
            context = context + [token]
        if len(proposed) < 3:  # and the walk stops only where no n-gram matches
            assert _reference_next(responses, context, [4, 3, 2]) is None, (context, proposed)
        lengths[len(proposed)] += 1
    assert lengths[0] > 10 and lengths[3] > 250, lengths  # both ends of the walk were checked


def test_memoised_walks_match_fresh_ones_and_the_memo_stays_bounded(monkeypatch):
    """A walk step depends on the context's last `max_ngram_size` tokens only, so answers are memoised on them: with
    a memo of 8 contexts (cleared when full), walks asked twice, in any order, equal those of a fresh index."""
    rng = random.Random(1)
    responses = [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(100)]
    contexts = [[rng.randrange(6) for _ in range(rng.randrange(1, 9))] for _ in range(200)]
    monkeypatch.setattr(lookup_retrace, "MEMO_SIZE", 8)
    index = NgramDatastore(_flat(responses), num_tokens=4, max_ngram_size=4, min_ngram_size=2)
    first = [index.candidates(np.array(c)) for c in contexts]
    assert 0 < len(index._memo) <= 8
    again = [index.candidates(np.array(c)) for c in reversed(contexts)][::-1]
    fresh = [NgramDatastore(_flat(responses), 4, 4, 2).candidates(np.array(c)) for c in contexts[:20]]
    assert first == again and first[:20] == fresh
    assert sum(walk is not None and len(walk) == 4 for walk in first) > 50  # the walks were long enough to check


def test_suffix_keys_are_the_table_keys():
    """A lookup hashes its query in Python integers, the index its corpus with arrays: the keys must be equal."""
    ids = np.random.default_rng(0).integers(0, 2**18, 40)
    sizes = [6, 5, 4, 3, 1]
    table = _window_keys(ids, set(sizes))
    for i in range(len(ids) + 1):
        query = _suffix_keys(ids[:i].tolist(), sizes)
        assert sorted(query) == sorted(n for n in sizes if n <= i)
        for n, key in query.items():
            assert key == int(table[n][i]), (i, n)


def test_datastore_never_spans_two_responses():
    index = NgramDatastore(_flat([[1, 2, 3], [4, 5, 6, 7]]), num_tokens=2, max_ngram_size=2, min_ngram_size=1)
    assert index.candidates(np.array([9, 4])) == [5, 6]
    assert index.candidates(np.array([5])) == [6, 7]
    assert index.candidates(np.array([2])) == [3]  # 3 ends its response: the walk stops there
    assert index.candidates(np.array([3])) is None  # nothing of the next response follows 3
    assert index.candidates(np.array([4, 5]), num_tokens=1) == [6]
    assert index.candidates(np.array([4]), num_tokens=5) == [5, 6]  # never past its own num_tokens
    with pytest.raises(ValueError, match="num_tokens >= 1, got 0"):
        index.num_tokens = 0
    tiny = NgramDatastore(_flat([[1, 2]]), num_tokens=3, max_ngram_size=6, min_ngram_size=3)  # shorter than n + 1
    assert tiny.candidates(np.array([1, 2])) is None and tiny.candidates(np.array([1, 2, 1, 2])) is None


@pytest.mark.parametrize("bad, message", [
    (dict(datastore_num_tokens=3), "the drafter has no datastore"),
    (dict(datastore_num_tokens=0), "datastore_num_tokens must be >= 1"),
    (dict(datastore_max_ngram_size=2, datastore_min_ngram_size=3), "got min 3 and max 2"),
])  # fmt: skip
def test_bad_datastore_settings_are_rejected(bad, message):
    drafter = make_drafter(make_target("qwen3"), block_size=4, mode="off")
    if bad.get("datastore_num_tokens") == 0:
        drafter.set_datastore([[1, 2, 3]])
    for key, value in bad.items():
        setattr(drafter.generation_config, key, value)
    with pytest.raises(ValueError, match=message):
        drafter.decoding_settings()


def test_set_datastore_rejects_tokens_outside_the_vocabulary():
    drafter = make_drafter(make_target("qwen3"), block_size=4, mode="off")
    with pytest.raises(ValueError, match="token-id lists in"):
        drafter.set_datastore([[1, 2, drafter.config.vocab_size]])
    drafter.generation_config.datastore_num_tokens = 2
    with pytest.raises(ValueError, match="the drafter has no datastore"):
        drafter.decoding_settings()


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
    drafter.generation_config.datastore_num_tokens = 3
    drafter.generation_config.datastore_min_ngram_size = 2
    drafter.generation_config.prompt_lookup_num_tokens = 2
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
    drafter.generation_config.datastore_num_tokens = 2
    drafter.save_pretrained(folder)
    return target, drafter


def test_datastore_round_trips_through_its_own_file(tmp_path):
    target, drafter = _saved_drafter_with_datastore(tmp_path, 3)
    assert (tmp_path / "lookup_retrace.py").is_file() and (tmp_path / "datastore_file_retrace.py").is_file()
    assert set(load_file(tmp_path / "model.safetensors")) == set(drafter.state_dict())  # weights only
    assert not any("datastore" in key for key in drafter.state_dict())
    with safe_open(tmp_path / DATASTORE_FILE, framework="pt") as f:  # the format docs/formats.md describes
        stored, metadata, keys = f.get_tensor("token_ids"), f.metadata(), list(f.keys())
    assert keys == ["token_ids"] and stored.dtype == torch.uint16  # vocab 128 fits
    assert metadata["format"] == "pt" and metadata["separator"] == "65535" and len(metadata["sha256"]) == 64
    assert torch.equal(torch.where(stored.to(torch.int32) == 65535, SEPARATOR, stored.to(torch.int32)),
                       drafter.datastore_tokens)  # fmt: skip
    assert "datastore_num_tokens" not in json.loads((tmp_path / "config.json").read_text())
    assert json.loads((tmp_path / "generation_config.json").read_text())["datastore_num_tokens"] == 2
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.datastore_tokens, drafter.datastore_tokens)
    assert loaded.datastore_tokens.dtype == torch.int32
    prompt = random_prompt(5, seed=1)
    expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20)
    got = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20, assistant_model=loaded)
    assert got.tolist() == expected.tolist()
    assert loaded.last_generation_stats.num_datastore_cycles > 0
    loaded.set_datastore(None)
    assert loaded.datastore_size is None and loaded.generation_config.datastore_num_tokens is None
    loaded.save_pretrained(tmp_path)  # no datastore any more: the folder's file goes too
    assert not (tmp_path / DATASTORE_FILE).exists()


def test_large_vocabularies_store_int32_with_separator_minus_one(tmp_path):
    ids = torch.tensor([0, 70_000, SEPARATOR, 5, SEPARATOR], dtype=torch.int32)
    save_datastore_file(tmp_path / DATASTORE_FILE, ids, vocab_size=100_000)
    with safe_open(tmp_path / DATASTORE_FILE, framework="pt") as f:
        assert f.get_tensor("token_ids").dtype == torch.int32 and f.metadata()["separator"] == "-1"
    loaded = load_datastore_file(tmp_path / DATASTORE_FILE, 100_000)
    assert loaded.dtype == np.int32 and loaded.tolist() == ids.tolist()


def test_a_corrupt_or_foreign_datastore_file_is_a_clear_error(tmp_path):
    _saved_drafter_with_datastore(tmp_path, 2)
    path = tmp_path / DATASTORE_FILE
    raw = bytearray(path.read_bytes())
    raw[-4] ^= 1  # one flipped bit in the token data
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupt datastore file .*sha256 does not match"):
        ReTraceDrafterModel.from_pretrained(tmp_path)
    path.write_bytes(bytes(raw[:40]))  # truncated
    with pytest.raises(ValueError, match="corrupt datastore file"):
        ReTraceDrafterModel.from_pretrained(tmp_path)
    save_datastore_file(path, torch.tensor([1, 500, SEPARATOR]), vocab_size=1000)  # ids beyond the drafter's 128
    with pytest.raises(ValueError, match=r"corrupt datastore file .*\[0, vocab_size=128\)"):
        ReTraceDrafterModel.from_pretrained(tmp_path)


def test_sampling_with_datastore_lookup_commits_every_token_once():
    """Datastore cycles carry no draft logits, so under sampling transformers checks them against the target's own
    samples (exact for any candidate), as for prompt lookup."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="corrected")
    drafter.set_datastore(_greedy_responses(target, range(4)))
    drafter.generation_config.datastore_num_tokens = 3
    drafter.generation_config.datastore_min_ngram_size = 1
    torch.manual_seed(0)
    out = target.generate(random_prompt(5, seed=0), do_sample=True, pad_token_id=0, max_new_tokens=40,
                          assistant_model=drafter)  # fmt: skip
    stats = drafter.last_generation_stats
    assert out.shape[1] == 5 + 40
    assert stats.num_datastore_cycles > 0


def test_datastore_command_writes_only_the_datastore_and_settings(tmp_path, capsys):
    """`hf-retrace datastore`: the first END rows of a `DIR:END` pool become the drafter's datastore; the weights file
    is copied byte for byte (another folder) or left alone (in place), never rewritten."""
    from hf_retrace.cli import main as cli_main
    from hf_retrace.data.continuous_generation import PromptItem
    from hf_retrace.data.pool import build_pool, read_token_shards

    target = make_target("llama")
    items = [PromptItem(i, "rand", random_prompt(3 + i, seed=i)[0].tolist()) for i in range(4)]
    build_pool(target, items, tmp_path / "pool", None, eos_token_ids={-1}, layer_ids=[0], target_name="tiny",
               batch_size=2, max_new_tokens=6)  # fmt: skip
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    weights = (tmp_path / "drafter" / "model.safetensors").read_bytes()
    argv = ["datastore", "--drafter", str(tmp_path / "drafter"), "--pool", f"{tmp_path / 'pool'}:3"]
    assert cli_main(argv + ["--num-tokens", "2", "--output", str(tmp_path / "out")]) == 0
    assert "datastore of 3 responses, 21 tokens with separators" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == weights
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path / "out")
    first_rows = read_token_shards(tmp_path / "pool")[:3]
    assert loaded.datastore_tokens.tolist() == [t for row in first_rows for t in (*row["response_ids"], SEPARATOR)]
    settings = loaded.generation_config
    assert settings.datastore_num_tokens == 2 and settings.datastore_min_ngram_size == 3
    before = (tmp_path / "drafter" / "model.safetensors").stat().st_mtime_ns
    assert cli_main(argv + ["--num-tokens", "3", "--output", str(tmp_path / "drafter")]) == 0  # in place
    assert (tmp_path / "drafter" / "model.safetensors").stat().st_mtime_ns == before
    assert ReTraceDrafterModel.from_pretrained(tmp_path / "drafter").generation_config.datastore_num_tokens == 3
    capsys.readouterr()  # the loads' progress bars
    assert cli_main(argv[:4] + [f"{tmp_path / 'pool'}:9", "--output", str(tmp_path / "bad")]) == 2  # a usage error
    err = capsys.readouterr().err
    assert err.startswith("hf-retrace datastore: error: --pool ") and "END must be in [1, 4]" in err
    assert err.count("\n") == 1 and not (tmp_path / "bad").exists()

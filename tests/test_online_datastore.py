"""The online datastore: learns from served requests (per request and global), evicts the oldest responses past its
byte budget (whose estimate is checked against tracemalloc), frees finished and aborted requests, never proposes
past `max_tokens`, stays sub-millisecond at the bound, and refuses a file written for another vocabulary."""

import collections
import gc
import random
import time
import tracemalloc

import numpy as np
import pytest

from hf_retrace.models.online_datastore_retrace import OnlineDatastore, vocab_fingerprint


def _serve(store, request_id, prompt, response):
    store.start(request_id, prompt)
    store.add_tokens(request_id, response)
    store.finish(request_id)


def test_a_request_learns_from_its_own_tokens():
    store = OnlineDatastore(min_ngram_size=2, max_ngram_size=4)
    store.start("a", [1, 2, 3, 4, 5, 9])
    found = store.propose("a", [7, 2, 3], max_tokens=3)
    assert found.tokens == [4, 5, 9] and found.match_length == 2
    np.testing.assert_allclose(found.probabilities, [1, 1, 1])
    store.add_tokens("a", [2, 3, 8])  # (2, 3) now continued by 4 once and by 8 once
    assert store.propose("a", [2, 3], max_tokens=3, min_probability=0.6).tokens == []  # 0.5 < 0.6
    assert store.propose("a", [1, 2, 3], max_tokens=1).tokens == [4]  # the 3-gram (1, 2, 3) is unambiguous
    assert store.propose("other", [1, 2, 3], max_tokens=3).tokens == []  # nothing global yet


def test_finished_responses_join_the_global_index_prompts_do_not():
    store = OnlineDatastore()
    _serve(store, "a", [50, 51, 52, 53], [1, 2, 3, 4, 5, 6])
    assert store.num_requests == 0 and store.num_responses == 1
    assert store.propose("b", [9, 2, 3], max_tokens=8).tokens == [4, 5, 6]  # the response ends there
    assert store.propose("b", [50, 51, 52], max_tokens=3).tokens == []  # a's prompt was never global


def test_the_path_probability_floor_sets_the_length():
    store = OnlineDatastore(min_ngram_size=1, max_ngram_size=1)
    for i, tail in enumerate([[2, 3], [2, 3], [2, 4], [5, 6]]):
        _serve(store, i, [], [1] + tail)
    # after 1: 2 three times in four (0.75); after 2: 3 twice in three (0.67); path 0.5
    assert store.propose("q", [1], 5, min_probability=0.5).tokens == [2, 3]
    assert store.propose("q", [1], 5, min_probability=0.6).tokens == [2]
    assert store.propose("q", [1], 5, min_probability=0.8).tokens == []


def _brute_force_walk(own, responses, context, sizes, max_tokens, floor):
    """The walk by counting: the longest n-gram ending the context in the request's own tokens or the responses,
    its most frequent continuation over both (ties: the smallest id), while the path probability stays >= floor."""
    out, probabilities, path = [], [], 1.0
    while len(out) < max_tokens:
        counts = collections.Counter()
        for n in reversed(sizes):
            if n <= len(context):
                counts = collections.Counter(seq[i] for seq in [own, *responses] for i in range(n, len(seq))
                                             if seq[i - n : i] == context[-n:])  # fmt: skip
            if counts:
                break
        if not counts:
            break
        token, count = max(counts.items(), key=lambda item: (item[1], -item[0]))
        if path * count / sum(counts.values()) < floor:
            break
        path *= count / sum(counts.values())
        out.append(token)
        probabilities.append(count / sum(counts.values()))
        context = context + [token]
    return out, probabilities


def test_the_walk_is_the_counts_of_both_indexes_merged():
    """Against counting by hand: a request's own prompt and tokens and the finished responses, merged per n-gram,
    one continuation or several (packed or not), on a 4-token alphabet where n-grams recur and ties happen."""
    rng = random.Random(0)
    store = OnlineDatastore(min_ngram_size=2, max_ngram_size=4)
    responses = []
    for i in range(30):
        prompt, response = [rng.randrange(4) for _ in range(5)], [rng.randrange(4) for _ in range(rng.randrange(2, 9))]
        _serve(store, i, prompt, response)
        responses.append(response)
    walked = 0
    for j in range(200):
        own = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        store.start(("q", j), own)
        found = store.propose(("q", j), own, max_tokens=6, min_probability=0.05)
        tokens, probabilities = _brute_force_walk(own, responses, own, [2, 3, 4], 6, 0.05)
        assert found.tokens == tokens and found.probabilities.tolist() == pytest.approx(probabilities), (own, j)
        walked += len(tokens) > 1
        store.abort(("q", j))
    assert walked > 50


@pytest.mark.parametrize("max_tokens", [0, 1, 3, -2])
def test_never_proposes_past_max_tokens(max_tokens):
    store = OnlineDatastore(min_ngram_size=1, max_ngram_size=2)
    _serve(store, "a", [], [7] * 50)  # a loop: every walk could go on forever
    found = store.propose("b", [7, 7], max_tokens=max_tokens, min_probability=0.0)
    assert len(found.tokens) == max(max_tokens, 0) == found.probabilities.size


def test_fifo_eviction_respects_the_budget():
    rng = np.random.default_rng(0)
    store = OnlineDatastore(max_bytes=200_000)
    responses = [rng.integers(0, 30_000, 100).tolist() for _ in range(60)]
    for i, response in enumerate(responses):
        _serve(store, i, [], response)
        assert store.global_nbytes() <= 200_000
    assert 0 < store.num_responses < 60
    newest, oldest = responses[-1], responses[0]
    assert store.propose("q", newest[10:15], 3).tokens == newest[15:18]  # the newest is kept
    assert store.propose("q", oldest[10:15], 3).tokens == []  # the oldest went first


def test_evicting_everything_leaves_nothing_behind():
    store = OnlineDatastore(max_bytes=10**9)
    _serve(store, "a", [], list(range(100, 400)))
    assert store.global_nbytes() > 0
    store.max_bytes = 0
    _serve(store, "b", [], list(range(500, 520)))
    assert store.num_responses == 0 and all(not table for table in store._global.tables.values())
    assert store._global.object_bytes == 0


def test_finished_and_aborted_requests_are_freed():
    store = OnlineDatastore()
    empty = store.nbytes()
    store.start("a", list(range(1000)))
    store.start("b", list(range(1000)))
    assert store.nbytes() > empty + 2 * 50_000
    store.abort("a")
    store.finish("b")  # an empty response: nothing joins the global index
    assert store.num_requests == 0 and store.nbytes() == empty
    store.abort("never-started")  # a no-op, not an error
    store.finish("never-started")


@pytest.mark.parametrize("vocab_size", [50, 32_000])
def test_the_byte_estimate_is_honest(vocab_size):
    """The estimate is within 25% of what tracemalloc sees the global index allocate (small vocabularies have
    many shared continuations, large ones many distinct n-grams)."""
    rng = np.random.default_rng(1)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = OnlineDatastore(max_bytes=600_000)
    for i in range(16):
        _serve(store, i, rng.integers(0, vocab_size, 20).tolist(), rng.integers(0, vocab_size, 300).tolist())
    gc.collect()
    allocated = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert store.num_responses < 16  # the budget was reached
    assert 0.8 < store.nbytes() / allocated < 1.25, (store.nbytes(), allocated)


def test_lookups_stay_sub_millisecond_at_the_bound():
    rng = np.random.default_rng(2)
    store = OnlineDatastore(max_bytes=4 * 2**20)
    corpus = rng.integers(0, 32_000, 3000).tolist()
    i = 0
    while store.num_responses == i:  # fill until the budget evicts
        start = int(rng.integers(0, 2800))
        _serve(store, i, [], corpus[start : start + 100] + rng.integers(0, 32_000, 50).tolist())
        i += 1
    store.start("q", rng.integers(0, 32_000, 500).tolist())
    cpu = []
    for _ in range(300):
        start = int(rng.integers(0, 2900))
        began = time.thread_time()  # CPU time of this thread: the machine may be shared
        store.propose("q", corpus[start : start + 8], max_tokens=16, min_probability=0.05)
        cpu.append(time.thread_time() - began)
    assert np.median(cpu) < 1e-3, np.median(cpu)


def test_save_load_round_trip_and_vocabulary_check(tmp_path):
    store = OnlineDatastore()
    _serve(store, "a", [], [1, 2, 3, 4, 5])
    _serve(store, "b", [], [6, 7, 8, 9])
    vocab = vocab_fingerprint({"a": 0, "b": 1})
    assert vocab != vocab_fingerprint({"a": 1, "b": 0})
    path = tmp_path / "online.npz"
    store.save(path, vocab)
    loaded = OnlineDatastore.load(path, vocab)
    assert loaded.num_responses == 2 and loaded.global_nbytes() == store.global_nbytes()
    assert loaded.propose("q", [2, 3], 2).tokens == [4, 5]
    with pytest.raises(ValueError, match="another vocabulary|written for vocabulary"):
        OnlineDatastore.load(path, vocab_fingerprint({"x": 0}))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not an online datastore"):
        OnlineDatastore.load(tmp_path / "junk.npz", vocab)


def test_bad_settings_and_tokens_are_refused():
    with pytest.raises(ValueError, match="min_ngram_size"):
        OnlineDatastore(min_ngram_size=4, max_ngram_size=2)
    with pytest.raises(ValueError, match="token ids"):
        OnlineDatastore().start("a", [1, -3])

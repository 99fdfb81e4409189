"""Prompt lookup and the datastore walk propose what the transformers side proposes (hand-checked cases here; the
cards' tau check compares the engines end to end); the policy block and the datastore file are checked."""

import hashlib
import json
import struct
import types

import numpy as np
import pytest

from hf_retrace_vllm.datastore import SEPARATOR, Datastore, load_datastore_file
from hf_retrace_vllm.policy import DraftPolicy, prompt_lookup


def test_prompt_lookup_takes_the_earliest_occurrence_of_the_longest_ngram():
    tokens = np.array([5, 6, 7, 1, 5, 6, 8, 2, 6, 7, 9, 5, 6, 7])
    # the last 3-gram [5, 6, 7] recurs at 0: tokens after it
    assert prompt_lookup(tokens, 3, 3, 2) == [1, 5, 6]
    # n = 2 only: [6, 7] first occurs at 1
    assert prompt_lookup(tokens, 2, 2, 2) == [1, 5]
    # the continuation is cut at the end of the context
    assert prompt_lookup(np.array([1, 2, 3, 1, 2]), 5, 2, 2) == [3, 1, 2]
    assert prompt_lookup(np.array([1, 2, 3, 4]), 3, 3, 2) is None
    assert prompt_lookup(np.array([1, 2, 3, 4, 3]), 3, 3, 1) == [4, 3]  # n = 1 when allowed


def test_datastore_walk_follows_the_most_frequent_continuation_of_the_longest_ngram():
    sep = SEPARATOR
    corpus = np.array([1, 2, 3, 4, sep, 1, 2, 3, 5, sep, 9, 2, 3, 5, sep, 7, 3, 6, sep])
    store = Datastore(corpus, num_tokens=3, max_ngram_size=3, min_ngram_size=2)
    # [1, 2, 3] -> 4 once, 5 once: a tie goes to the smaller token; then [2, 3, 4] ends a response, so the 2-gram
    # [3, 4] has no continuation either and the walk stops
    assert store.walk(np.array([8, 1, 2, 3]), 3) == [4]
    # [9, 2, 3] is not indexed with a continuation beyond 5; [2, 3] -> 5 (twice) beats 4 (once)
    assert store.walk(np.array([0, 2, 3]), 3) == [5]
    assert store.walk(np.array([7, 3]), 3) == [6]
    assert store.walk(np.array([4, 4]), 3) is None
    assert store.walk(np.array([1, 2, 3]), 1) == [4]  # at most num_tokens


def _write_datastore(path, ids, sha=None):
    stored = np.where(ids == SEPARATOR, 65535, ids).astype("<u2")
    data = stored.tobytes()
    meta = {"format": "pt", "separator": "65535", "sha256": sha or hashlib.sha256(data).hexdigest()}
    header = json.dumps({"token_ids": {"dtype": "U16", "shape": [len(ids)], "data_offsets": [0, len(data)]},
                         "__metadata__": meta}).encode()  # fmt: skip
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_datastore_file_roundtrip_and_checksum(tmp_path):
    ids = np.array([3, 4, SEPARATOR, 5, SEPARATOR])
    _write_datastore(tmp_path / "ok.safetensors", ids)
    assert load_datastore_file(tmp_path / "ok.safetensors", 10).tolist() == ids.tolist()
    _write_datastore(tmp_path / "bad.safetensors", ids, sha="0" * 64)
    with pytest.raises(ValueError, match="corrupt datastore file"):
        load_datastore_file(tmp_path / "bad.safetensors", 10)
    with pytest.raises(ValueError, match="corrupt datastore file"):
        load_datastore_file(tmp_path / "ok.safetensors", 5)  # ids beyond the vocabulary


def test_policy_block_is_checked():
    block = {"num_assistant_tokens": 3, "retrace_mode": "corrected", "prompt_lookup_num_tokens": 3}
    policy = DraftPolicy.from_hf_config(types.SimpleNamespace(block_size=16, hf_retrace=block))
    assert (policy.num_assistant_tokens, policy.retrace_mode, policy.datastore_num_tokens) == (3, "corrected", None)
    with pytest.raises(ValueError, match="num_assistant_tokens must be in"):
        DraftPolicy.from_hf_config(types.SimpleNamespace(block_size=4, hf_retrace={"num_assistant_tokens": 4}))
    with pytest.raises(ValueError, match="retrace_mode must be one of"):
        DraftPolicy.from_hf_config(types.SimpleNamespace(block_size=16, hf_retrace={"retrace_mode": "sideways"}))
    with pytest.raises(ValueError, match="no `hf_retrace` block"):
        DraftPolicy.from_hf_config(types.SimpleNamespace(block_size=16))

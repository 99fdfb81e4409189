"""The plugin's drafting policy in vLLM's own venv: its shared files (copies of the transformers side's, checked
byte for byte by the main suite's `tests/test_check_copies.py`, which also runs both engines' proposals side by side
in `tests/test_cross_engine_policy.py`) import and propose here; the policy block and the datastore file are
checked."""

import hashlib
import json
import struct
import types

import numpy as np
import pytest

from hf_retrace_vllm.datastore import SEPARATOR, FolderDatastore, NgramDatastore, load_datastore_file
from hf_retrace_vllm.policy import DraftPolicy, check_token_budget, lookup, policy_sources
from hf_retrace_vllm.shared.lookup_retrace import prompt_lookup


BLOCK = {
    "anchor_broadcast": False, "retrace_mode": "corrected", "num_assistant_tokens": 3,
    "assistant_confidence_threshold": None, "prompt_lookup_num_tokens": 3, "prompt_lookup_max_ngram_size": 3,
    "prompt_lookup_min_ngram_size": 2, "datastore_num_tokens": None, "datastore_max_ngram_size": 6,
    "datastore_min_ngram_size": 3, "datastore_file": None, "speculation_policy": "fixed",
    "online_datastore_num_tokens": None, "online_datastore_max_bytes": 33554432, "source_commit": None,
}  # fmt: skip  (what `hf-retrace export --format vllm` writes)


def _policy(block_size=16, **changes):
    return DraftPolicy.from_hf_config(types.SimpleNamespace(block_size=block_size, hf_retrace={**BLOCK, **changes}))


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
    store = NgramDatastore(corpus, num_tokens=3, max_ngram_size=3, min_ngram_size=2)
    # [1, 2, 3] -> 4 once, 5 once: a tie goes to the smaller token; then [2, 3, 4] ends a response, so the 2-gram
    # [3, 4] has no continuation either and the walk stops
    assert store.candidates(np.array([8, 1, 2, 3]), 3) == [4]
    # [0, 2, 3] is not indexed; [2, 3] -> 5 (twice) beats 4 (once)
    assert store.candidates(np.array([0, 2, 3]), 3) == [5]
    assert store.candidates(np.array([7, 3]), 3) == [6]
    assert store.candidates(np.array([4, 4]), 3) is None
    assert store.candidates(np.array([1, 2, 3]), 1) == [4]  # at most num_tokens


def _write_datastore(path, ids, sha=None, header_length=None):
    stored = np.where(ids == SEPARATOR, 65535, ids).astype("<u2")
    data = stored.tobytes()
    meta = {"format": "pt", "separator": "65535", "sha256": sha or hashlib.sha256(data).hexdigest()}
    header = json.dumps({"token_ids": {"dtype": "U16", "shape": [len(ids)], "data_offsets": [0, len(data)]},
                         "__metadata__": meta}).encode()  # fmt: skip
    path.write_bytes(struct.pack("<Q", header_length or len(header)) + header + data)


def test_datastore_file_is_read_with_every_check(tmp_path):
    ids = np.array([3, 4, SEPARATOR, 5, SEPARATOR])
    _write_datastore(tmp_path / "ok.safetensors", ids)
    assert load_datastore_file(tmp_path / "ok.safetensors", 10).tolist() == ids.tolist()
    _write_datastore(tmp_path / "bad.safetensors", ids, sha="0" * 64)
    with pytest.raises(ValueError, match="corrupt datastore file .*sha256 does not match"):
        load_datastore_file(tmp_path / "bad.safetensors", 10)
    with pytest.raises(ValueError, match="corrupt datastore file"):
        load_datastore_file(tmp_path / "ok.safetensors", 5)  # ids beyond the vocabulary
    _write_datastore(tmp_path / "long.safetensors", ids, header_length=1 << 30)
    with pytest.raises(ValueError, match="header length .* out of range"):
        load_datastore_file(tmp_path / "long.safetensors", 10)
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "extra.safetensors").write_bytes(raw + b"\0\0")  # bytes past the tensor's offsets
    with pytest.raises(ValueError, match="data offsets"):
        load_datastore_file(tmp_path / "extra.safetensors", 10)


def test_policy_block_is_checked():
    policy = _policy()
    assert (policy.num_assistant_tokens, policy.retrace_mode, policy.settings.datastore_num_tokens) == (
        3, "corrected", None)  # fmt: skip
    assert policy.settings.max_matching_ngram_size == 3  # the block's prompt_lookup_max_ngram_size
    with pytest.raises(ValueError, match="num_assistant_tokens must be in"):
        _policy(block_size=4, num_assistant_tokens=4)
    with pytest.raises(ValueError, match="retrace_mode must be one of"):
        _policy(retrace_mode="sideways")
    with pytest.raises(ValueError, match="the drafter has no datastore"):
        _policy(datastore_num_tokens=3)
    with pytest.raises(ValueError, match="needs 1 <= prompt_lookup_min_ngram_size"):
        _policy(prompt_lookup_min_ngram_size=4)
    with pytest.raises(ValueError, match="no `hf_retrace` block"):
        DraftPolicy.from_hf_config(types.SimpleNamespace(block_size=16))
    block = {key: value for key, value in BLOCK.items() if key != "datastore_max_ngram_size"}
    with pytest.raises(ValueError, match=r"lacks \['datastore_max_ngram_size'\]"):  # no silent default
        DraftPolicy.from_hf_config(types.SimpleNamespace(block_size=16, hf_retrace=block))


def test_lookup_asks_prompt_lookup_then_the_datastore_then_the_drafter(tmp_path):
    _write_datastore(tmp_path / "datastore.safetensors", np.array([7, 8, 9, SEPARATOR]))
    policy = _policy(datastore_num_tokens=2, datastore_min_ngram_size=1, datastore_file="datastore.safetensors")
    sources = policy_sources(policy, tmp_path, vocab_size=10)
    assert lookup(sources, np.array([1, 2, 3, 1, 2]), 5) == ([3, 1, 2], "lookup")
    assert lookup(sources, np.array([1, 2, 3, 1, 2]), 1) == ([3], "lookup")  # capped by the room left
    assert lookup(sources, np.array([1, 7]), 5) == ([8, 9], "datastore")
    assert lookup(sources, np.array([1, 2]), 5) == (None, "draft")
    with pytest.raises(ValueError, match="names no datastore_file"):
        FolderDatastore(tmp_path, None, 10).datastore(2, 6, 3)


def test_a_token_budget_below_one_block_per_sequence_is_a_clear_error():
    """Below `max_num_seqs x block_size` a full batch's drafter forward overruns vLLM's buffers (it crashed the
    engine): refused at start-up, saying both fixes."""
    check_token_budget(4096, 256, 16)  # vLLM's CPU defaults fit exactly
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=48 .* 4 x 16 = 64.*at least 64.*at most 3"):
        check_token_budget(48, 4, 16)

"""The datastore walk (REST / suffix decoding's greedy path) over `datastore.safetensors` (FORMAT.md §1), with numpy.

Same proposals as the transformers side's `NgramDatastore`: per n-gram size, the most frequent next token of every
n-gram of the corpus (ties: the smallest token id, at its earliest position); a lookup appends the next token of the
LONGEST indexed n-gram the context ends with, and walks on from the extended context.
"""

import hashlib
import json
import struct
from pathlib import Path

import numpy as np


SEPARATOR = -1  # in memory, between responses: no n-gram or continuation spans two of them
_PRIMES = (2_147_483_647, 2_147_483_629)  # two polynomial hashes below 2^31 make one 62-bit key
_BASE = 2**18  # above every token id, so token * base^j mod p stays below 2^49 in int64
_SHIFT = 2**31
_DTYPES = {"U16": np.uint16, "I32": np.int32}


def load_datastore_file(path, vocab_size: int) -> np.ndarray:
    """`[S]` int64 token ids with `SEPARATOR` between responses, read from a `datastore.safetensors` and verified
    against the sha256 in its metadata."""
    raw = Path(path).read_bytes()
    try:
        (header_len,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + header_len])
        entry, metadata = header["token_ids"], header["__metadata__"]
        start, end = entry["data_offsets"]
        data = raw[8 + header_len + start : 8 + header_len + end]
        dtype = _DTYPES[entry["dtype"]]
        separator = int(metadata["separator"])
    except (struct.error, ValueError, KeyError) as err:
        raise ValueError(f"corrupt datastore file {path}: not a datastore.safetensors ({err!r})") from err
    if hashlib.sha256(data).hexdigest() != metadata.get("sha256"):
        raise ValueError(
            f"corrupt datastore file {path}: its sha256 does not match its metadata; export the folder again"
        )
    ids = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.int64)
    ids[ids == separator] = SEPARATOR
    if ids.size == 0 or ids[-1] != SEPARATOR or ids.min() < SEPARATOR or ids.max() >= vocab_size:
        raise ValueError(f"corrupt datastore file {path}: ids outside [0, {vocab_size}) or no final separator")
    return ids


def _window_keys(ids: np.ndarray, n: int) -> np.ndarray:
    """`[S]`: entry `i` is the key of `ids[i-n : i]` (meaningless for `i < n`); `sum_j ids[i-1-j] * base^j mod p`
    per prime, combined."""
    length = ids.shape[0]
    out = []
    for prime in _PRIMES:
        acc = np.zeros(length, dtype=np.int64)
        power = 1
        for j in range(1, n + 1):
            acc[j:] = (acc[j:] + ids[: length - j] * power) % prime
            power = power * _BASE % prime
        out.append(acc)
    return out[0] * _SHIFT + out[1]


def _suffix_key(tokens: list[int], n: int) -> int:
    """The key of `tokens[-n:]`, in Python integers (one short query)."""
    parts = []
    for prime in _PRIMES:
        acc, power = 0, 1
        for token in reversed(tokens[-n:]):
            acc = (acc + token * power) % prime
            power = power * _BASE % prime
        parts.append(acc)
    return parts[0] * _SHIFT + parts[1]


class Datastore:
    """`(n-gram -> most frequent next token)` tables for `n` in `[min_ngram_size, max_ngram_size]`.

    Args:
        token_ids (`np.ndarray` of shape `(S,)`): responses, `SEPARATOR` between them.
        num_tokens (`int`): the most tokens a walk proposes.
    """

    def __init__(self, token_ids: np.ndarray, num_tokens: int, max_ngram_size: int, min_ngram_size: int):
        self.token_ids = token_ids.astype(np.int64)
        self.num_tokens = num_tokens
        self.ngram_sizes = list(range(max_ngram_size, min_ngram_size - 1, -1))
        clamped = np.maximum(self.token_ids, 0)
        seps = np.concatenate([[0], np.cumsum(self.token_ids == SEPARATOR)])  # separators in ids[:j] = seps[j]
        self.tables = {}
        for n in self.ngram_sizes:
            starts = np.arange(n, max(len(clamped), n))
            starts = starts[seps[starts + 1] == seps[starts - n]]  # ids[i-n : i+1] holds no separator
            keys = _window_keys(clamped, n)[starts]
            self.tables[n] = _most_frequent(keys, self.token_ids[starts], starts)

    def next_token(self, context: list[int]) -> int | None:
        for n in self.ngram_sizes:
            if n > len(context):
                continue
            key = _suffix_key(context, n)
            table_keys, positions = self.tables[n]
            index = int(np.searchsorted(table_keys, key))
            if index == table_keys.shape[0] or int(table_keys[index]) != key:
                continue
            position = int(positions[index])
            if self.token_ids[position - n : position].tolist() == context[-n:]:  # a hash collision proposes nothing
                return int(self.token_ids[position])
        return None

    def walk(self, tokens: np.ndarray, num_tokens: int) -> list[int] | None:
        """Up to `min(num_tokens, self.num_tokens)` tokens walked from the committed `tokens`; `None` if none."""
        context = tokens[-self.ngram_sizes[0] :].tolist()
        proposed: list[int] = []
        for _ in range(min(num_tokens, self.num_tokens)):
            token = self.next_token(context + proposed)
            if token is None:
                break
            proposed.append(token)
        return proposed or None


def _most_frequent(keys: np.ndarray, continuations: np.ndarray, starts: np.ndarray):
    """`(distinct keys [U] sorted, position [U] of each key's most frequent continuation)`; ties go to the smallest
    continuation, and its earliest position."""
    order = np.lexsort((starts, continuations, keys))  # by key, then continuation, then position
    keys, continuations, starts = keys[order], continuations[order], starts[order]
    new_run = np.ones(keys.shape[0], dtype=bool)
    new_run[1:] = (keys[1:] != keys[:-1]) | (continuations[1:] != continuations[:-1])
    run_starts = np.flatnonzero(new_run)
    counts = np.diff(np.append(run_starts, keys.shape[0]))
    run_keys, run_conts, run_positions = keys[run_starts], continuations[run_starts], starts[run_starts]
    order = np.lexsort((run_conts, -counts, run_keys))  # per key: largest count first, then smallest continuation
    run_keys, run_positions = run_keys[order], run_positions[order]
    first = np.ones(run_keys.shape[0], dtype=bool)
    first[1:] = run_keys[1:] != run_keys[:-1]
    return run_keys[first], run_positions[first]

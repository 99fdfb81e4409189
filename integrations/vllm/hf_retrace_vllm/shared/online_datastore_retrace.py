# Copied from hf_retrace/models/online_datastore_retrace.py by utils/check_copies.py --fix; edit the original.
# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports numpy and the standard library only (no torch), so both engines share it unchanged; the vLLM
# plugin vendors it byte-identical.
"""A datastore that learns from what is served, as suffix decoding does (Oliaro et al., 2024; Arctic Inference):
a per-request index of the prompt and the tokens generated so far, and a global index of recent responses, bounded
by a byte budget with first-in-first-out eviction. Each index maps an n-gram (sizes `[min, max]`) to the counts of
the tokens that followed it. See docs/cost-aware-speculation.md.

A proposal walks from the request's last tokens: at each step the longest n-gram found (in the request's index and
the global one together) gives its most frequent continuation with probability count / total; the walk goes on while
the path probability (the product of those) stays above a floor, and never past the caller's `max_tokens`.
"""

import hashlib
import io
import json
import sys
from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np


FORMAT = "hf_retrace-online-datastore"
VERSION = 1
_COUNT_BITS = 32  # a lone continuation is packed in one int: token << 32 | count (token ids below 2^31)
_COUNT_MASK = (1 << _COUNT_BITS) - 1


def _size(obj) -> int:
    """Bytes of one object as allocated: `sys.getsizeof` rounded up to pymalloc's 8-byte blocks."""
    return (sys.getsizeof(obj) + 7) // 8 * 8


_SMALL_INT = _size(1 << 29)  # a token id or a count inside a dict of several continuations


def vocab_fingerprint(vocab) -> str:
    """16 hex digits identifying a vocabulary: `vocab` is `tokenizer.get_vocab()` (token -> id) or any mapping or
    sequence that differs when the tokenizer does."""
    items = sorted(vocab.items()) if hasattr(vocab, "items") else list(vocab)
    return hashlib.sha256(json.dumps(items, default=str).encode()).hexdigest()[:16]


@dataclass
class OnlineProposal:
    """What [`OnlineDatastore.propose`] found.

    Args:
        tokens (`list[int]`): the proposed tokens, at most `max_tokens`.
        probabilities (`np.ndarray` of shape `(len(tokens),)`): each token's count / total at its step.
        match_length (`int`): the n-gram length matched at the first step (0 when nothing matched).
    """

    tokens: list[int]
    probabilities: np.ndarray
    match_length: int


class _NgramIndex:
    """n-gram (as its hash, one table per size) -> next-token counts, with a byte count: the tables' own
    allocations (`sys.getsizeof`, which includes the capacity a dict keeps after deletions) plus the keys and values
    they hold, counted as they come and go."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.tables = {n: {} for n in sizes}
        self.object_bytes = 0

    @property
    def nbytes(self) -> int:
        return self.object_bytes + sum(sys.getsizeof(table) for table in self.tables.values())

    def add(self, tokens, start: int) -> None:
        """Indexes the continuations `tokens[i]` for `i >= start` (each after the n-grams ending at `i - 1`)."""
        longest = self.sizes[-1]
        for i in range(max(start, self.sizes.start), len(tokens)):
            token, window = tokens[i], tuple(tokens[max(i - longest, 0) : i])  # the n-gram of size n is window[-n:]
            for n in self.sizes:
                if n <= i:
                    self._increment(self.tables[n], hash(window[-n:]), token)

    def remove(self, tokens) -> None:
        """Undoes `add(tokens, 0)`."""
        for i in range(self.sizes.start, len(tokens)):
            for n in self.sizes:
                if n <= i:
                    self._decrement(self.tables[n], hash(tuple(tokens[i - n : i])), tokens[i])

    def _increment(self, table: dict, key: int, token: int) -> None:
        value = table.get(key)
        if value is None:
            table[key] = packed = token << _COUNT_BITS | 1
            self.object_bytes += _size(key) + _size(packed)
        elif isinstance(value, dict):
            before = sys.getsizeof(value)
            if token not in value:
                self.object_bytes += 2 * _SMALL_INT
            value[token] = value.get(token, 0) + 1
            self.object_bytes += sys.getsizeof(value) - before
        elif value >> _COUNT_BITS == token:
            table[key] = value + 1
        else:  # a second continuation: unpack into a dict
            table[key] = counts = {value >> _COUNT_BITS: value & _COUNT_MASK, token: 1}
            self.object_bytes += _size(counts) + 4 * _SMALL_INT - _size(value)

    def _decrement(self, table: dict, key: int, token: int) -> None:
        value = table.get(key)
        if isinstance(value, dict):
            if value.get(token, 0) > 1:
                value[token] -= 1
                return
            value.pop(token, None)
            self.object_bytes -= 2 * _SMALL_INT
            if len(value) == 1:  # back to one continuation: pack it again
                ((only, count),) = value.items()
                table[key] = packed = only << _COUNT_BITS | count
                self.object_bytes += _size(packed) - _size(value) - 2 * _SMALL_INT
        elif value is not None and value >> _COUNT_BITS == token:
            if value & _COUNT_MASK > 1:
                table[key] = value - 1
                return
            del table[key]
            self.object_bytes -= _size(key) + _size(value)


@dataclass
class _Request:
    tokens: array  # prompt + generated, int32
    prompt_length: int
    index: _NgramIndex


@dataclass
class OnlineDatastore:
    """Learns n-gram continuations from served requests.

    Args:
        min_ngram_size (`int`, *optional*, defaults to 2), max_ngram_size (`int`, *optional*, defaults to 6): the
            n-gram sizes indexed; a lookup tries the longest first.
        max_bytes (`int`, *optional*, defaults to 32 MiB): the global index's budget; the oldest responses are
            evicted past it. Running requests' own indexes are counted by [`nbytes`] but never evicted (they are
            freed by [`finish`] or [`abort`]).

    Example:
    ```python
    >>> store = OnlineDatastore()
    >>> store.start("a", prompt_tokens=[7, 7]); store.add_tokens("a", [1, 2, 3, 4, 5]); store.finish("a")
    >>> store.propose("b", [9, 2, 3], max_tokens=2).tokens  # "b" has no index yet: the global one answers
    [4, 5]
    ```
    """

    min_ngram_size: int = 2
    max_ngram_size: int = 6
    max_bytes: int = 32 * 2**20
    _requests: dict = field(default_factory=dict, repr=False)
    _responses: deque = field(default_factory=deque, repr=False)

    def __post_init__(self):
        if not 1 <= self.min_ngram_size <= self.max_ngram_size:
            raise ValueError(f"need 1 <= min_ngram_size <= max_ngram_size, got {self.min_ngram_size}, "
                             f"{self.max_ngram_size}")  # fmt: skip
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")
        self._sizes = range(self.min_ngram_size, self.max_ngram_size + 1)
        self._global = _NgramIndex(self._sizes)
        self._response_bytes = 0

    def start(self, request_id, prompt_tokens) -> None:
        """Opens a request's index with its prompt (a request seen first through [`add_tokens`] has none)."""
        tokens = array("i", _checked(prompt_tokens))
        index = _NgramIndex(self._sizes)
        index.add(tokens, 0)
        self._requests[request_id] = _Request(tokens, len(tokens), index)

    def add_tokens(self, request_id, new_tokens) -> None:
        """Appends a request's newly committed tokens to its index."""
        if request_id not in self._requests:
            self.start(request_id, [])
        request = self._requests[request_id]
        start = len(request.tokens)
        request.tokens.extend(_checked(new_tokens))
        request.index.add(request.tokens, start)

    def finish(self, request_id) -> None:
        """Moves a finished request's response (its generated tokens) to the global index and frees its state."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._add_response(request.tokens[request.prompt_length :])

    def abort(self, request_id) -> None:
        """Frees an aborted request's state; nothing of it is kept."""
        self._requests.pop(request_id, None)

    def _add_response(self, tokens: array) -> None:
        if len(tokens) <= self.min_ngram_size:  # no n-gram with a continuation
            return
        self._responses.append(tokens)
        self._global.add(tokens, 0)
        self._response_bytes += _array_bytes(tokens)
        while self._responses and self.global_nbytes() > self.max_bytes:  # FIFO: the oldest response goes first
            oldest = self._responses.popleft()
            self._global.remove(oldest)
            self._response_bytes -= _array_bytes(oldest)

    def global_nbytes(self) -> int:
        """Estimated bytes of the global index and the responses it was built from (bounded by `max_bytes`)."""
        return self._global.nbytes + self._response_bytes

    def nbytes(self) -> int:
        """Estimated bytes of everything held: the global index and every running request's."""
        running = sum(r.index.nbytes + _array_bytes(r.tokens) for r in self._requests.values())
        return self.global_nbytes() + running

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_responses(self) -> int:
        return len(self._responses)

    def _longest(self, request: _Request | None, context: list[int]) -> tuple[int, int, int, int] | None:
        """`(n, token, count, total)`: the longest n-gram ending the context that either index knows, its most
        frequent continuation over both (ties: the smallest token id), that continuation's count and the n-gram's."""
        for n in reversed(self._sizes):
            if n > len(context):
                continue
            key = hash(tuple(context[-n:]))
            mine = request.index.tables[n].get(key) if request is not None else None
            theirs = self._global.tables[n].get(key)
            if mine is None and theirs is None:
                continue
            if type(mine) is not dict and type(theirs) is not dict:  # packed ints: no dict to build
                if mine is None or theirs is None or mine >> _COUNT_BITS == theirs >> _COUNT_BITS:
                    count = ((mine or 0) & _COUNT_MASK) + ((theirs or 0) & _COUNT_MASK)  # a packed value is never 0
                    return n, (theirs if mine is None else mine) >> _COUNT_BITS, count, count
            merged = dict(_unpacked(theirs))
            for token, count in _unpacked(mine).items():
                merged[token] = merged.get(token, 0) + count
            token, count = max(merged.items(), key=lambda item: (item[1], -item[0]))
            return n, token, count, sum(merged.values())
        return None

    def propose(self, request_id, tokens, max_tokens: int, min_probability: float = 0.1) -> OnlineProposal:
        """Walks the most frequent continuations of `tokens` (the request's committed tokens; only the last
        `max_ngram_size` are read) while the path probability stays at or above `min_probability`.

        Returns:
            [`OnlineProposal`] with at most `max(max_tokens, 0)` tokens.
        """
        request = self._requests.get(request_id)
        context = [int(t) for t in tokens[-self.max_ngram_size :]]
        out, probabilities, match_length, path = [], [], 0, 1.0
        while len(out) < max_tokens:
            found = self._longest(request, context)
            if found is None:
                break
            n, token, count, total = found
            probability = count / total
            if path * probability < min_probability:
                break
            path *= probability
            match_length = match_length or n
            out.append(token)
            probabilities.append(probability)
            context = (context + [token])[-self.max_ngram_size :]
        return OnlineProposal(out, np.array(probabilities, dtype=np.float64), match_length)

    def save(self, path, vocab_id: str) -> None:
        """Writes the global responses (the index is rebuilt on load) with the vocabulary fingerprint `vocab_id`
        ([`vocab_fingerprint`]); running requests are not saved."""
        lengths = np.array([len(r) for r in self._responses], dtype=np.int64)
        tokens = np.concatenate([np.asarray(r, dtype=np.int32) for r in self._responses] or [np.zeros(0, np.int32)])
        meta = {"format": FORMAT, "version": VERSION, "vocab_id": str(vocab_id)}
        buffer = io.BytesIO()
        np.savez(buffer, tokens=tokens, lengths=lengths, meta=np.array(json.dumps(meta)))
        with open(path, "wb") as f:
            f.write(buffer.getvalue())

    @classmethod
    def load(cls, path, vocab_id: str, **settings) -> "OnlineDatastore":
        """A datastore (with `settings`) holding the responses saved at `path`, oldest evicted first if over budget.

        Raises:
            ValueError: the file is not an online datastore, or was written for another vocabulary or tokenizer.
        """
        try:
            with np.load(path, allow_pickle=False) as data:
                meta, tokens, lengths = json.loads(str(data["meta"])), data["tokens"], data["lengths"]
        except (OSError, KeyError, ValueError) as error:
            raise ValueError(f"{path} is not an online datastore file ({error})") from error
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path} is not an online datastore file of version {VERSION}: {meta}")
        if meta.get("vocab_id") != str(vocab_id):
            raise ValueError(f"{path} was written for vocabulary {meta.get('vocab_id')!r}, but this tokenizer is "
                             f"{vocab_id!r}: its token ids mean other tokens here; delete it or name another file")
        if lengths.sum() != tokens.size:
            raise ValueError(f"{path} is corrupt: lengths sum to {lengths.sum()} for {tokens.size} tokens")
        store = cls(**settings)
        for chunk in np.split(tokens, np.cumsum(lengths)[:-1]) if lengths.size else []:
            store._add_response(array("i", chunk.tolist()))
        return store


def _unpacked(value) -> dict[int, int]:
    """A table's value as `{token: count}`: a dict as it is, a packed int unpacked, `None` empty."""
    if value is None:
        return {}
    return value if isinstance(value, dict) else {value >> _COUNT_BITS: value & _COUNT_MASK}


def _checked(tokens) -> list[int]:
    tokens = [int(t) for t in tokens]
    if tokens and (min(tokens) < 0 or max(tokens) >= 2**31):
        raise ValueError(f"token ids must be in [0, 2^31), got {min(tokens)}..{max(tokens)}")
    return tokens


def _array_bytes(tokens: array) -> int:
    return _size(tokens)

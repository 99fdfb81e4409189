# Copied from hf_retrace/models/lookup_retrace.py by utils/check_copies.py --fix; edit the original.
# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Shared policy file: imports numpy, the standard library and `.datastore_file_retrace` only. It is a Hub file and the
# vLLM plugin's copy (`integrations/vllm/hf_retrace_vllm/shared/`, kept identical by `utils/check_copies.py`).
"""The two lookups in front of the drafter, on the committed tokens as a numpy array: prompt lookup (Saxena, 2023)
and datastore lookup (REST, He et al., 2024; suffix decoding's greedy path, Oliaro et al., 2024), the continuation
that most often followed the context in a fixed corpus of the target's own responses."""

import numpy as np

from .datastore_file_retrace import SEPARATOR  # between responses: no n-gram or continuation spans two responses


def prompt_lookup(
    tokens: np.ndarray, num_tokens: int, max_ngram_size: int, min_ngram_size: int = 1
) -> list[int] | None:
    """The tokens that followed the earliest earlier occurrence of the context's last n-gram, trying
    `n = max_ngram_size` down to `min_ngram_size`.

    The match rule is transformers' `PromptLookupCandidateGenerator`'s (longest n-gram first, earliest occurrence;
    `tests/test_prompt_lookup.py` compares the two), but that class is not reused, for three reasons. It always goes
    down to `n = 1`, and behind a drafter a one-token match proposes worse drafts than the drafter (a minimum is vLLM's
    `prompt_lookup_min`). It crops candidates at EOS and runs the logits processors once per candidate on made-up
    logits; here the target's verification does both. And it is a whole candidate generator (`max_length`, the
    `(ids, None)` protocol), where a source needs one function of the committed tokens.

    Args:
        tokens (`np.ndarray` of shape `(T,)`): the committed tokens, prompt and output.
        num_tokens (`int`): most candidates returned.
        max_ngram_size (`int`), min_ngram_size (`int`): n-gram sizes tried, longest first.
    Returns:
        `list[int]` of `1..num_tokens` tokens, or `None` when no n-gram recurs.
    """
    return prompt_lookup_match(tokens, num_tokens, max_ngram_size, min_ngram_size)[0]


def prompt_lookup_match(
    tokens: np.ndarray, num_tokens: int, max_ngram_size: int, min_ngram_size: int = 1
) -> tuple[list[int] | None, int]:
    """[`prompt_lookup`]'s proposal and the size `n` of the n-gram it matched (`(None, 0)` when none recurs)."""
    # An n-gram's earliest earlier occurrence is the first aligned match of its bytes in the bytes of the tokens
    # before the last one (windows end at T-2 at the latest: a token follows each): one C-speed substring search per
    # size, where filtering the candidate ends with numpy costs a dozen calls. Compared as int32 (every vocabulary's
    # ids are below 2^31): half the bytes of int64 and no runs of zero bytes for the search to stumble over.
    tokens = np.asarray(tokens)
    packed = tokens.astype(np.int32) if tokens.dtype.itemsize > 4 else np.ascontiguousarray(tokens)
    length, itemsize = packed.shape[0], packed.itemsize
    data = packed[:-1].tobytes()
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        pattern = packed[length - n :].tobytes()
        at = data.find(pattern)
        while at >= 0 and at % itemsize:  # a match across two tokens' bytes: search on
            at = data.find(pattern, at + 1)
        if at >= 0:  # the earliest occurrence; its continuation starts after its end
            start = at // itemsize + n
            return tokens[start : start + num_tokens].tolist(), n
    return None, 0


# two polynomial hashes modulo primes below 2^31, combined into one 62-bit key: every product stays below 2^49 for
# token ids below 2^18, so the arithmetic never overflows int64 (a 1.5M-entry table collides with probability ~1e-7,
# and a lookup checks the stored n-gram anyway)
_PRIMES = (2_147_483_647, 2_147_483_629)
_BASE = 2**18  # above every token id
_SHIFT = 2**31  # key = hash_0 * _SHIFT + hash_1


def _window_keys(token_ids: np.ndarray, sizes: set[int]) -> dict[int, np.ndarray]:
    """`{n: [S + 1]}`: entry `i` is the key of `token_ids[i-n : i]` (meaningless for `i < n`), for every size in
    `sizes` in one pass: per prime, `sum_j token_{i-1-j} * base^j mod prime` (the key of size `n` adds the token `n`
    back, weighted `base^(n-1)`, to the key of size `n-1`); token ids must be in `[0, 2^18)`."""
    ids = np.asarray(token_ids, dtype=np.int64)
    length = ids.shape[0]
    parts = [np.zeros(length + 1, dtype=np.int64) for _ in _PRIMES]
    powers = [1] * len(_PRIMES)
    out = {}
    for n in range(1, max(sizes) + 1):
        for k, prime in enumerate(_PRIMES):
            if n <= length:  # no window of size n otherwise
                parts[k][n:] = (parts[k][n:] + ids[: length + 1 - n] * powers[k]) % prime
            powers[k] = powers[k] * _BASE % prime
        if n in sizes:
            out[n] = parts[0] * _SHIFT + parts[1]
    return out


def _suffix_keys(tokens: list[int], sizes: list[int]) -> dict[int, int]:
    """`{n: key of tokens[-n:]}` for the sizes `n <= len(tokens)`: [`_window_keys`]'s sums in Python integers, for one
    short query (a lookup walks a few steps; array ops per step would cost far more than these few multiplications).
    `test_suffix_keys_are_the_table_keys` checks the two agree."""
    parts, powers, out = [0] * len(_PRIMES), [1] * len(_PRIMES), {}
    for n, token in enumerate(reversed(tokens[-max(sizes) :]), start=1):
        for k, prime in enumerate(_PRIMES):
            parts[k] = (parts[k] + token * powers[k]) % prime
            powers[k] = powers[k] * _BASE % prime
        if n in sizes:
            out[n] = parts[0] * _SHIFT + parts[1]
    return out


MEMO_SIZE = 2**14  # contexts an `NgramDatastore` remembers the next token of (~4 MB at most)


class NgramDatastore:
    """Index of `(n-gram -> most frequent next token)` over a fixed token corpus, for n in
    `[min_ngram_size, max_ngram_size]`; built once (a few sorts: seconds for 4 sizes of 1.75M tokens on one core).

    A lookup walks it: the next token of the longest indexed n-gram the context ends with, appended, and again from
    the longer context, up to `num_tokens` tokens (suffix decoding's greedy path). Each step re-matches the longest
    n-gram of the extended context, so a proposal is not tied to one occurrence of the first n-gram; replayed on the
    evaluation prompts, this accepts more than proposing each n-gram's most frequent `num_tokens`-gram.

    Args:
        token_ids (`np.ndarray` of shape `(S,)`): responses concatenated, [`SEPARATOR`] between them.
        num_tokens (`int`): `m`, the most tokens a lookup proposes (the index does not depend on it).
        max_ngram_size (`int`), min_ngram_size (`int`): n-gram sizes indexed; a lookup tries the longest first.
    """

    def __init__(self, token_ids: np.ndarray, num_tokens: int, max_ngram_size: int, min_ngram_size: int):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(
                "datastore lookup needs 1 <= min_ngram_size <= max_ngram_size, got "
                f"{min_ngram_size} and {max_ngram_size}"
            )
        self.num_tokens = num_tokens
        self.token_ids = np.asarray(token_ids).astype(np.int64)
        self.ngram_sizes = list(range(max_ngram_size, min_ngram_size - 1, -1))
        self.tables = self._build()
        # `_next` of a context depends on its last `max_ngram_size` tokens only, and the index never changes: walks
        # of consecutive steps of a request (and of requests that share text) ask the same contexts again
        self._memo: dict[tuple, tuple[int | None, int]] = {}

    @property
    def num_tokens(self) -> int:
        """The most tokens a lookup proposes; settable, since the index does not depend on it."""
        return self._num_tokens

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"datastore lookup needs num_tokens >= 1, got {value}")
        self._num_tokens = value

    def _build(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """`{n: (keys [U], positions [U])}`: the sorted distinct n-gram keys, and for each a position `i` where its
        most frequent next token `ids[i]` follows it (ties: the smallest id, at its earliest). Entry `i` is the
        n-gram `ids[i-n : i]` followed by `ids[i]`, kept when none of the `n + 1` tokens is a separator."""
        ids = self.token_ids
        length = ids.shape[0]
        keys = _window_keys(np.maximum(ids, 0), set(self.ngram_sizes))
        seps = np.concatenate([[0], np.cumsum(ids == SEPARATOR)])  # separators in ids[:j] = seps[j]
        tables = {}
        for n in self.ngram_sizes:
            starts = np.arange(n, max(length, n))
            starts = starts[seps[starts + 1] == seps[starts - n]]  # ids[i-n : i+1] holds no separator
            tables[n] = _most_frequent(keys[n][starts], ids[starts], starts)
        return tables

    def next_token(self, context: list[int]) -> int | None:
        """The most frequent next token of the longest indexed n-gram that `context` (token ids) ends with."""
        return self._next(context)[0]

    def _next(self, context: list[int]) -> tuple[int | None, int]:
        """`(next_token(context), n)`: with the size of the n-gram matched (`(None, 0)` when none is), memoised on
        the context's last `max_ngram_size` tokens (at most `MEMO_SIZE` of them, then the memo starts over)."""
        key = tuple(context[-self.ngram_sizes[0] :])
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            found = self._memo[key] = self._lookup(context)
        return found

    def _lookup(self, context: list[int]) -> tuple[int | None, int]:
        keys = _suffix_keys(context, self.ngram_sizes)  # only the sizes the context is long enough for
        for n in self.ngram_sizes:
            if n not in keys:
                continue
            table_keys, positions = self.tables[n]
            index = int(table_keys.searchsorted(keys[n]))  # the method: np.searchsorted's wrapper costs as much
            if index == table_keys.shape[0] or int(table_keys[index]) != keys[n]:
                continue
            position = int(positions[index])
            if self.token_ids[position - n : position].tolist() == context[-n:]:  # a hash collision proposes nothing
                return int(self.token_ids[position]), n
        return None, 0

    def candidates(self, tokens: np.ndarray, num_tokens: int | None = None) -> list[int] | None:
        """The walk from the committed tokens: each step appends the next token of the longest indexed n-gram the
        context (committed tokens, then the tokens proposed so far) ends with; it stops after `num_tokens` tokens or
        where no indexed n-gram matches.

        Args:
            tokens (`np.ndarray` of shape `(T,)`): the committed tokens.
            num_tokens (`int`, *optional*): most candidates returned (at most `self.num_tokens`, the default).
        Returns:
            `list[int]` of `1..num_tokens` tokens; `None` when no indexed n-gram ends the context.
        """
        return self.candidates_with_match(tokens, num_tokens)[0]

    def candidates_with_match(self, tokens: np.ndarray, num_tokens: int | None = None) -> tuple[list[int] | None, int]:
        """[`candidates`] and the size of the n-gram its first step matched (`(None, 0)` when none is)."""
        context = np.asarray(tokens)[-self.ngram_sizes[0] :].tolist()
        proposed, first_match = [], 0
        for _ in range(self.num_tokens if num_tokens is None else min(num_tokens, self.num_tokens)):
            token, n = self._next(context + proposed)
            if token is None:
                break
            proposed.append(token)
            first_match = first_match or n
        return proposed or None, first_match


def _most_frequent(keys: np.ndarray, continuations: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(distinct keys [U] sorted, start [U] of each key's most frequent continuation)` from `[R]` entries; ties go to
    the smallest continuation, at its earliest start."""
    order = np.lexsort((starts, continuations, keys))  # by key, then continuation, then start
    keys, continuations, starts = keys[order], continuations[order], starts[order]
    new_run = np.ones(keys.shape[0], dtype=bool)
    new_run[1:] = (keys[1:] != keys[:-1]) | (continuations[1:] != continuations[:-1])
    run_starts = np.flatnonzero(new_run)
    run_counts = np.diff(np.append(run_starts, keys.shape[0]))
    run_keys, run_continuations, run_positions = keys[run_starts], continuations[run_starts], starts[run_starts]
    order = np.lexsort((run_continuations, -run_counts, run_keys))  # per key: largest count, then smallest token
    run_keys, run_positions = run_keys[order], run_positions[order]
    first = np.ones(run_keys.shape[0], dtype=bool)
    first[1:] = run_keys[1:] != run_keys[:-1]
    return run_keys[first], run_positions[first]


__all__ = ["NgramDatastore", "SEPARATOR", "prompt_lookup", "prompt_lookup_match"]

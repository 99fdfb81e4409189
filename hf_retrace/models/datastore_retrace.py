# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch and `.datastore_file_retrace` only, so `trust_remote_code=True` loads it.
"""Datastore lookup (REST, He et al., 2024; suffix decoding, Oliaro et al., 2024, in vLLM and Arctic Inference): the
continuation that most often followed the context in a fixed corpus of the target's own responses."""

import torch

from .datastore_file_retrace import SEPARATOR  # between responses: no n-gram or continuation spans two responses


# two polynomial hashes modulo primes below 2^31, combined into one 62-bit key: every product stays below 2^49 for
# token ids below 2^18, so the arithmetic never overflows int64 (a 1.5M-entry table collides with probability ~1e-7,
# and a lookup checks the stored n-gram anyway)
_PRIMES = (2_147_483_647, 2_147_483_629)
_BASE = 2**18  # above every token id
_SHIFT = 2**31  # key = hash_0 * _SHIFT + hash_1


def _window_keys(token_ids: torch.LongTensor, sizes: set[int]) -> dict[int, torch.LongTensor]:
    """`{n: [S + 1]}`: entry `i` is the key of `token_ids[i-n : i]` (meaningless for `i < n`), for every size in
    `sizes` in one pass: per prime, `sum_j token_{i-1-j} * base^j mod prime` (the key of size `n` adds the token `n`
    back, weighted `base^(n-1)`, to the key of size `n-1`); token ids must be below the base, 2^18."""
    length = token_ids.shape[0]
    parts = [torch.zeros(length + 1, dtype=torch.long) for _ in _PRIMES]
    powers = [1] * len(_PRIMES)
    out = {}
    for n in range(1, max(sizes) + 1):
        for k, prime in enumerate(_PRIMES):
            if n <= length:  # no window of size n otherwise
                parts[k][n:] = (parts[k][n:] + token_ids[: length + 1 - n] * powers[k]) % prime
            powers[k] = powers[k] * _BASE % prime
        if n in sizes:
            out[n] = parts[0] * _SHIFT + parts[1]
    return out


def _suffix_keys(tokens: list[int], sizes: list[int]) -> dict[int, int]:
    """`{n: key of tokens[-n:]}` for the sizes `n <= len(tokens)`: [`_window_keys`]'s sums in Python integers, for one
    short query (a lookup walks a few steps; ~60 tiny tensor ops per step would cost ~0.5 ms, this ~5 us).
    `test_suffix_keys_are_the_table_keys` checks the two agree."""
    parts, powers, out = [0] * len(_PRIMES), [1] * len(_PRIMES), {}
    for n, token in enumerate(reversed(tokens[-max(sizes) :]), start=1):
        for k, prime in enumerate(_PRIMES):
            parts[k] = (parts[k] + token * powers[k]) % prime
            powers[k] = powers[k] * _BASE % prime
        if n in sizes:
            out[n] = parts[0] * _SHIFT + parts[1]
    return out


class NgramDatastore:
    """Index of `(n-gram -> most frequent next token)` over a fixed token corpus, for n in
    `[min_ngram_size, max_ngram_size]`; built once (a few sorts: ~3 s for 4 sizes of 1.75M tokens on one core).

    A lookup walks it: the next token of the longest indexed n-gram the context ends with, appended, and again from
    the longer context, up to `num_tokens` tokens (suffix decoding's greedy path). Each step re-matches the longest
    n-gram of the extended context, so a proposal is not tied to one occurrence of the first n-gram; replayed on the
    evaluation prompts, this accepts more than proposing each n-gram's most frequent `num_tokens`-gram.

    Args:
        token_ids (`torch.Tensor` of shape `(S,)`): responses concatenated, [`SEPARATOR`] between them.
        num_tokens (`int`): `m`, the most tokens a lookup proposes (the index does not depend on it).
        max_ngram_size (`int`), min_ngram_size (`int`): n-gram sizes indexed; a lookup tries the longest first.
    """

    def __init__(self, token_ids: torch.Tensor, num_tokens: int, max_ngram_size: int, min_ngram_size: int):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(
                "datastore lookup needs 1 <= min_ngram_size <= max_ngram_size, got "
                f"{min_ngram_size} and {max_ngram_size}"
            )
        self.num_tokens = num_tokens
        self.token_ids = token_ids.to(torch.long).cpu()
        self.ngram_sizes = list(range(max_ngram_size, min_ngram_size - 1, -1))
        self.tables = self._build()

    @property
    def num_tokens(self) -> int:
        """The most tokens a lookup proposes; settable, since the index does not depend on it."""
        return self._num_tokens

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"datastore lookup needs num_tokens >= 1, got {value}")
        self._num_tokens = value

    def _build(self) -> dict[int, tuple[torch.LongTensor, torch.LongTensor]]:
        """`{n: (keys [U], positions [U])}`: the sorted distinct n-gram keys, and for each a position `i` where its
        most frequent next token `ids[i]` follows it (ties: the smallest id, at its earliest). Entry `i` is the
        n-gram `ids[i-n : i]` followed by `ids[i]`, kept when none of the `n + 1` tokens is a separator."""
        ids = self.token_ids
        length = ids.shape[0]
        keys = _window_keys(ids.clamp(min=0), set(self.ngram_sizes))
        # separators in ids[:j] = seps[j]; entry i is valid when ids[i-n : i+1] holds none
        seps = torch.nn.functional.pad((ids == SEPARATOR).long().cumsum(0), (1, 0))
        tables = {}
        for n in self.ngram_sizes:
            starts = torch.arange(n, max(length, n))
            starts = starts[seps[starts + 1] == seps[starts - n]]
            tables[n] = _most_frequent(keys[n][starts], ids[starts], starts)
        return tables

    def next_token(self, context: list[int]) -> int | None:
        """The most frequent next token of the longest indexed n-gram that `context` (token ids) ends with."""
        keys = _suffix_keys(context, self.ngram_sizes)  # only the sizes the context is long enough for
        for n in self.ngram_sizes:
            if n not in keys:
                continue
            table_keys, positions = self.tables[n]
            index = int(torch.searchsorted(table_keys, keys[n]))
            if index == table_keys.shape[0] or int(table_keys[index]) != keys[n]:
                continue
            position = int(positions[index])
            if self.token_ids[position - n : position].tolist() == context[-n:]:  # a hash collision proposes nothing
                return int(self.token_ids[position])
        return None

    def candidates(self, input_ids: torch.LongTensor, num_tokens: int | None = None) -> torch.LongTensor | None:
        """The walk from the committed tokens: each step appends the next token of the longest indexed n-gram the
        context (committed tokens, then the tokens proposed so far) ends with; it stops after `num_tokens` tokens or
        where no indexed n-gram matches.

        Args:
            input_ids (`torch.LongTensor` of shape `(T,)`): the committed tokens.
            num_tokens (`int`, *optional*): most candidates returned (at most `self.num_tokens`, the default).
        Returns:
            `torch.LongTensor` of shape `(m,)`, `1 <= m <= num_tokens`; `None` when no indexed n-gram ends the context.
        """
        context = input_ids[-self.ngram_sizes[0] :].tolist()
        proposed = []
        for _ in range(self.num_tokens if num_tokens is None else min(num_tokens, self.num_tokens)):
            token = self.next_token(context + proposed)
            if token is None:
                break
            proposed.append(token)
        return torch.tensor(proposed, dtype=torch.long, device=input_ids.device) if proposed else None


def _most_frequent(
    keys: torch.LongTensor, continuations: torch.LongTensor, starts: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(distinct keys [U] sorted, start [U] of each key's most frequent continuation)` from `[R]` entries."""
    # lexicographic (key, continuation) order by two stable sorts, then runs of equal pairs
    order = torch.sort(continuations, stable=True).indices
    order = order[torch.sort(keys[order], stable=True).indices]
    keys, continuations, starts = keys[order], continuations[order], starts[order]
    new_run = torch.ones_like(keys, dtype=torch.bool)
    new_run[1:] = (keys[1:] != keys[:-1]) | (continuations[1:] != continuations[:-1])
    run_starts = new_run.nonzero().squeeze(1)
    run_counts = torch.diff(run_starts, append=torch.tensor([keys.shape[0]]))
    run_keys, run_positions = keys[run_starts], starts[run_starts]
    # per key, the run with the largest count: sort runs by count (descending, stable), then by key (stable)
    order = torch.sort(run_counts, descending=True, stable=True).indices
    order = order[torch.sort(run_keys[order], stable=True).indices]
    run_keys, run_positions = run_keys[order], run_positions[order]
    first = torch.ones_like(run_keys, dtype=torch.bool)
    first[1:] = run_keys[1:] != run_keys[:-1]
    return run_keys[first], run_positions[first]


__all__ = ["NgramDatastore", "SEPARATOR"]

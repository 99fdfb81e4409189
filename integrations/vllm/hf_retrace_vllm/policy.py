"""The drafting policy of an exported hf-retrace folder (FORMAT.md §2, the `hf_retrace` block of `config.json`):
which source proposes a cycle's tokens (prompt lookup, then the datastore, then the drafter) and how many.

Same semantics as the transformers side (`hf_retrace/models/generation_retrace.py`, `datastore_retrace.py`), written
here with numpy because this package never imports the transformers-side code.
"""

from dataclasses import dataclass

import numpy as np


RETRACE_MODES = ("off", "overwrite", "gated", "corrected")


@dataclass(frozen=True)
class DraftPolicy:
    """The `hf_retrace` block of an exported folder, checked.

    Attributes:
        block_size (`int`): `B`, the drafter's trained block (anchor + `B-1` mask slots); the drafter always runs it.
        num_assistant_tokens (`int`): drafts of a block that are verified (`k`, `1 <= k <= B-1`).
        confidence_threshold (`float` or `None`): verify only the leading drafts whose top-1 draft probability is at
            least this.
        anchor_broadcast (`bool`), retrace_mode (`str`): the drafter's anchor term and ReTrace conditioning mode.
        prompt_lookup_num_tokens (`int` or `None`): prompt lookup's most tokens (`None` = off), with n-grams
            `prompt_lookup_max_ngram_size` down to `prompt_lookup_min_ngram_size`.
        datastore_num_tokens (`int` or `None`): the datastore walk's most tokens (`None` = off), with n-grams
            `datastore_max_ngram_size` down to `datastore_min_ngram_size`, over `datastore_file`.
    """

    block_size: int
    num_assistant_tokens: int
    confidence_threshold: float | None
    anchor_broadcast: bool
    retrace_mode: str
    prompt_lookup_num_tokens: int | None
    prompt_lookup_max_ngram_size: int
    prompt_lookup_min_ngram_size: int
    datastore_num_tokens: int | None
    datastore_max_ngram_size: int
    datastore_min_ngram_size: int
    datastore_file: str | None

    @classmethod
    def from_hf_config(cls, hf_config) -> "DraftPolicy":
        """Reads and checks `hf_config.hf_retrace` (a dict); raises `ValueError` saying what is wrong."""
        block = getattr(hf_config, "hf_retrace", None)
        if not isinstance(block, dict):
            raise ValueError(
                "this drafter folder has no `hf_retrace` block in its config.json; write it with "
                "`hf-retrace export --format vllm --drafter DIR --output OUT`"
            )
        block_size = int(getattr(hf_config, "block_size", 0) or 0)
        if block_size < 2:
            raise ValueError(f"config.json needs block_size >= 2 (the drafter's trained block), got {block_size}")
        get = block.get
        policy = cls(
            block_size=block_size,
            num_assistant_tokens=int(get("num_assistant_tokens") or block_size - 1),
            confidence_threshold=get("assistant_confidence_threshold"),
            anchor_broadcast=bool(get("anchor_broadcast", False)),
            retrace_mode=get("retrace_mode", "off"),
            prompt_lookup_num_tokens=get("prompt_lookup_num_tokens"),
            prompt_lookup_max_ngram_size=int(get("prompt_lookup_max_ngram_size") or 3),
            prompt_lookup_min_ngram_size=int(get("prompt_lookup_min_ngram_size") or 2),
            datastore_num_tokens=get("datastore_num_tokens"),
            datastore_max_ngram_size=int(get("datastore_max_ngram_size") or 6),
            datastore_min_ngram_size=int(get("datastore_min_ngram_size") or 3),
            datastore_file=get("datastore_file"),
        )
        policy.check()
        return policy

    def check(self) -> None:
        if self.retrace_mode not in RETRACE_MODES:
            raise ValueError(f"hf_retrace.retrace_mode must be one of {RETRACE_MODES}, got {self.retrace_mode!r}")
        if not 1 <= self.num_assistant_tokens <= self.block_size - 1:
            raise ValueError(
                f"hf_retrace.num_assistant_tokens must be in [1, block_size - 1 = {self.block_size - 1}], got "
                f"{self.num_assistant_tokens}"
            )
        t = self.confidence_threshold
        if t is not None and not 0.0 < t <= 1.0:
            raise ValueError(f"hf_retrace.assistant_confidence_threshold must be in (0, 1] or null, got {t}")
        for name in ("prompt_lookup", "datastore"):
            num = getattr(self, f"{name}_num_tokens")
            lo, hi = getattr(self, f"{name}_min_ngram_size"), getattr(self, f"{name}_max_ngram_size")
            if num is not None and (num < 1 or not 1 <= lo <= hi):
                raise ValueError(
                    f"hf_retrace.{name}: needs num_tokens >= 1 and 1 <= min_ngram_size <= max_ngram_size, got "
                    f"{num}, {lo}, {hi}"
                )
        if self.datastore_num_tokens is not None and not self.datastore_file:
            raise ValueError("hf_retrace.datastore_num_tokens is set but datastore_file is null: re-export the folder")


def prompt_lookup(tokens: np.ndarray, num_tokens: int, max_ngram_size: int, min_ngram_size: int) -> list[int] | None:
    """The tokens that followed the EARLIEST earlier occurrence of the context's last n-gram, for `n` from
    `max_ngram_size` down to `min_ngram_size` (the transformers side's `prompt_lookup_candidates`).

    Args:
        tokens (`np.ndarray` of shape `(T,)`): the committed tokens, prompt and output.
        num_tokens (`int`): most tokens returned.
    Returns:
        `list[int]` of `1..num_tokens` tokens, or `None` when no n-gram recurs.
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        # windows of tokens[:-1]: every n-gram start i <= T-1-n, i.e. all but the last n-gram itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [T - n, n]
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:  # window i ends at i+n-1 <= T-2, so at least one token follows it
            start = int(matches[0]) + n
            return tokens[start : start + num_tokens].tolist()
    return None

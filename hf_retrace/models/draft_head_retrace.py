# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch only, so `trust_remote_code=True` loads it.
"""The draft head: the target's lm head as the drafter scores its drafts with it (`draft_logits_dtype`, reduced draft
vocabulary). Verification always uses the target's own head."""

import weakref

import torch
from torch import nn


class DraftLMHead(nn.Module):
    """A copy of the target's lm head that scores drafts only: cast to `draft_logits_dtype` (a decoding setting)
    and/or restricted to the `K` rows of the reduced draft vocabulary (`draft_vocab_ids`).

    Logits come back in the target head's dtype over the FULL vocabulary (`-inf` outside the draft vocabulary), so
    the candidate sampler and the speculative-sampling acceptance test read the very same draft distribution `q`,
    which is 0 outside the draft vocabulary and positive on every drafted token (any such `q` keeps speculative
    sampling exact; the residual `max(p - q, 0)` spans the full vocabulary).
    """

    def __init__(self, lm_head: nn.Linear, dtype: torch.dtype, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.out_dtype = lm_head.weight.dtype
        self.vocab_size = lm_head.weight.shape[0]
        weight, bias = lm_head.weight.detach(), getattr(lm_head, "bias", None)
        if vocab_ids is not None:
            vocab_ids = vocab_ids.to(weight.device)
            weight, bias = weight[vocab_ids], None if bias is None else bias.detach()[vocab_ids]
        self.register_buffer("vocab_ids", vocab_ids, persistent=False)  # [K] or None
        # The weight is kept as `weight_t`, [H, K or V]. fp32 stores it contiguous: a few rows times it is a plain
        # GEMM, which MKL runs faster than `linear`'s per-row products on a [K, H] weight (3 rows of an
        # 8192-row head: 2.7 ms against 4.7 ms, 1 thread; `benchmarks/draft_logits_cost.py`). Other dtypes keep
        # [K, H] contiguous and use `linear`: on CPUs without bf16 units its bf16 path is slow, and the transposed
        # product ~25x slower still.
        weight = weight.to(dtype)
        weight_t = weight.T.contiguous() if dtype == torch.float32 else weight.T  # [H, K or V]
        self.register_buffer("weight_t", weight_t, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """`[K or V, H]` (a view of `weight_t`)."""
        return self.weight_t.T

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[b, q, H]` drafter states -> `[b, q, V]` draft logits."""
        # 2-D on purpose: the generator passes `last_hidden_state[:, 1:]`, and a bf16 cast of that slice keeps its
        # 3-D strides, which took a slow CPU matmul path (136 ms vs 8 ms for 15 rows of SmolLM2's 49152 x 576 head,
        # 1 thread; on an AVX2 CPU without bf16 units both take ~113 ms, and the fp32 head ~35 ms:
        # `benchmarks/draft_logits_cost.py`).
        flat = hidden_states.reshape(-1, hidden_states.shape[-1]).to(self.weight_t.dtype)  # [b*q, H]
        if self.weight_t.dtype == torch.float32:  # x @ W^T as a plain GEMM on the contiguous [H, K]
            logits = flat @ self.weight_t if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
        else:
            logits = nn.functional.linear(flat, self.weight, self.bias)
        logits = logits.to(self.out_dtype)  # [b*q, K or V]
        if self.vocab_ids is not None:  # scatter the K draft-vocabulary logits into a -inf full-vocabulary row
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.vocab_ids, logits)
        return logits.view(*hidden_states.shape[:-1], -1)


_DRAFT_HEADS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def draft_lm_head(lm_head: nn.Module, dtype_name: str | None, vocab_ids: torch.Tensor | None = None) -> nn.Module:
    """`lm_head` itself, or a cached [`DraftLMHead`] in `dtype_name` restricted to `vocab_ids` (rebuilt when the
    weights or the ids change)."""
    if getattr(lm_head, "weight", None) is None:
        if vocab_ids is not None:
            raise ValueError("a reduced draft vocabulary needs a target lm head with a `weight` (an nn.Linear)")
        return lm_head
    dtype = getattr(torch, dtype_name) if dtype_name is not None else lm_head.weight.dtype
    if lm_head.weight.dtype == dtype and vocab_ids is None:
        return lm_head
    ids_key = None if vocab_ids is None else (vocab_ids.data_ptr(), vocab_ids._version, len(vocab_ids))
    key = (dtype, lm_head.weight.data_ptr(), lm_head.weight._version, ids_key)
    cached = _DRAFT_HEADS.get(lm_head)
    if cached is None or cached[0] != key:
        cached = (key, DraftLMHead(lm_head, dtype, vocab_ids))
        _DRAFT_HEADS[lm_head] = cached
    return cached[1]


__all__ = ["DraftLMHead", "draft_lm_head"]

# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Pure functions: the DFlash block-diffusion loss that ReTrace trains with (paper App. D: "the same block-diffusion
objective as DFlash", no auxiliary losses) and the greedy-acceptance bookkeeping of the simulated rounds."""

from itertools import repeat

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..data import IGNORE_INDEX


LOSS_TYPES = ("ce", "eal")


def default_loss_decay_gamma(block_size: int) -> float:
    """`gamma = (B - 2) / 2`, at least 1: 7 for the DFlash default `B = 16`, 3 for `B = 8`, 1 for `B = 4`.

    The rule keeps the weight of the last drafted slot relative to slot 1 at `exp(-2)` for every block size, so the
    loss leans on early slots (the ones acceptance depends on most) in the same proportion.
    """
    return max((block_size - 2) / 2, 1.0)


def loss_decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Per-slot weights `w_k = exp(-(k - 1) / gamma)` for `k >= 1`, `w_0 = 0` (DFlash eq. for the block loss).

    Slot 0 holds the anchor, a known token, so it is never supervised.

    Returns:
        `torch.Tensor` of shape `(block_size,)`, float32.
    """
    if gamma <= 0:
        raise ValueError(f"loss_decay_gamma must be > 0, got {gamma}")
    slots = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_cross_entropy(logits: torch.Tensor, labels: torch.LongTensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted CE normalised by the weight sum: `sum_k w_k CE_k / sum_k w_k` over supervised slots.

    Args:
        logits (`torch.Tensor` of shape `(..., vocab)`): draft logits (any float dtype; computed in float32).
        labels (`torch.LongTensor` of shape `(...)`): target token per slot, `-100` where unsupervised.
        weights (`torch.Tensor` of shape `(...)`): slot weights (e.g. decay weights broadcast over blocks).
    Returns:
        Scalar loss; `0` (still attached to the graph) when no slot is supervised.
    """
    supervised = labels != IGNORE_INDEX
    weights = weights.to(torch.float32) * supervised
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.clamp_min(0).reshape(-1), reduction="none"
    )  # [M]
    total = weights.sum()
    return (ce * weights.reshape(-1)).sum() / total.clamp_min(1e-6)


def _chunk_scores(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.LongTensor, teacher: torch.Tensor | None):
    log_probs = F.linear(hidden, weight).float().log_softmax(dim=-1)  # [m, K]
    log_likelihood = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [m]
    if teacher is None:
        return log_likelihood, log_probs.detach().argmax(dim=-1)
    with torch.no_grad():  # the target's next-token distribution over the same K rows
        teacher_probs = F.linear(teacher.to(weight.dtype), weight).float().softmax(dim=-1)  # [m, K]
    soft_cross_entropy = -(teacher_probs * log_probs).sum(dim=-1)  # [m]
    return log_likelihood, log_probs.detach().argmax(dim=-1), soft_cross_entropy


def slot_log_likelihoods(
    hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.LongTensor, chunk_rows: int = 4096,
    teacher_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.LongTensor, torch.Tensor | None]:  # fmt: skip
    """`log q(label)` and the argmax of every row, with the `[rows, K]` logits never all in memory.

    Rows are scored `chunk_rows` at a time under activation checkpointing: the backward pass recomputes a chunk's
    logits instead of keeping them, so peak memory is one `[chunk_rows, K]` fp32 block (the whole `[rows, K]` would
    be 3840 x 49152 x 4 B = 755 MB for one SmolLM2 step at full vocabulary).

    With `teacher_states` (the target's final hidden state where it predicts each row's label), the same chunks also
    give the distillation term `-sum_v p(v) log q(v)`, `p` the target's softmax over the same `K` lm-head rows: the
    target's whole next-token distribution instead of its one greedy token, at the cost of one more `[chunk, K]`
    product without gradient.

    Args:
        hidden_states (`torch.Tensor` of shape `(M, hidden)`): drafter states of supervised slots.
        weight (`torch.Tensor` of shape `(K, hidden)`): lm-head rows of the draft vocabulary (frozen).
        labels (`torch.LongTensor` of shape `(M,)`): label indices into those `K` rows (all valid).
        teacher_states (`torch.Tensor` of shape `(M, hidden)`, *optional*): post-norm target states (no gradient).
    Returns:
        `(log_likelihood, argmax, soft_cross_entropy)`: `(M,)` float32 (differentiable), `(M,)` indices into the `K`
        rows, and `(M,)` float32 (differentiable) or `None` without `teacher_states`.
    """
    if hidden_states.shape[0] == 0:
        empty = hidden_states.new_zeros(0, dtype=torch.float32)
        return empty, labels.new_zeros(0), (None if teacher_states is None else empty)
    hidden_states = hidden_states.to(weight.dtype)
    teachers = repeat(None) if teacher_states is None else teacher_states.split(chunk_rows)  # zip stops at the rows
    parts = [
        checkpoint(_chunk_scores, h, weight, y, t, use_reentrant=False)
        if torch.is_grad_enabled() and h.requires_grad
        else _chunk_scores(h, weight, y, t)
        for h, y, t in zip(hidden_states.split(chunk_rows), labels.split(chunk_rows), teachers)
    ]
    soft = None if teacher_states is None else torch.cat([p[2] for p in parts])
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), soft


def expected_accepted_length(log_likelihood: torch.Tensor, acceptable: torch.BoolTensor) -> torch.Tensor:
    """Expected number of accepted drafts of each block under greedy verification, with teacher-forced labels
    (acceptance-length-aware training, `../shared/paper/004_*.txt`): `E[n] = sum_k prod_{j <= k} q_j(y_j)`.

    A slot that is not acceptable (unsupervised, or its label is outside the draft vocabulary, so it can never be
    drafted) ends the chain: it and every later slot contribute 0.

    Args:
        log_likelihood (`torch.Tensor` of shape `(..., B - 1)`): `log q_k(y_k)` of slots `1..B-1` (any value where
            not acceptable).
        acceptable (`torch.BoolTensor` of shape `(..., B - 1)`).
    Returns:
        `torch.Tensor` of shape `(...)`: `E[n]` per block, in `[0, B - 1]`.
    """
    alive = acceptable.long().cumprod(dim=-1).bool()  # the chain reaches slot k
    log_prefix = torch.where(alive, log_likelihood, torch.zeros_like(log_likelihood)).cumsum(dim=-1)
    return (log_prefix.exp() * alive).sum(dim=-1)


def count_accepted(draft_ids: torch.LongTensor, labels: torch.LongTensor) -> torch.LongTensor:
    """Greedy acceptance `n`: number of leading drafted slots equal to their label (`-100` never matches).

    Args:
        draft_ids (`torch.LongTensor` of shape `(..., B - 1)`): drafts of slots `1 .. B-1`.
        labels (`torch.LongTensor` of shape `(..., B - 1)`): tokens at those positions, `-100` where unknown.
    Returns:
        `torch.LongTensor` of shape `(...)`, values in `[0, B - 1]`.

    Example: drafts `[5, 6, 9, 7]`, labels `[5, 6, 8, 7]` -> `2` (the match after the first mismatch does not count).
    """
    matches = (draft_ids == labels) & (labels != IGNORE_INDEX)
    return matches.long().cumprod(dim=-1).sum(dim=-1)


__all__ = [
    "LOSS_TYPES",
    "expected_accepted_length",
    "slot_log_likelihoods",
    "block_cross_entropy",
    "count_accepted",
    "default_loss_decay_gamma",
    "loss_decay_weights",
]

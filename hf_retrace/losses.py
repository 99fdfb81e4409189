# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Pure functions: the DFlash block-diffusion loss that ReTrace trains with (paper App. D: "the same block-diffusion
objective as DFlash", no auxiliary losses) and the greedy-acceptance bookkeeping of the simulated rounds."""

import torch
import torch.nn.functional as F


IGNORE_INDEX = -100


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
    "IGNORE_INDEX",
    "block_cross_entropy",
    "count_accepted",
    "default_loss_decay_gamma",
    "loss_decay_weights",
]

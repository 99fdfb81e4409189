# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Pure functions: the attention masks of block-parallel DFlash / ReTrace training (`docs/training.md`).

All masks are boolean, `True` = attend, shaped `(batch, 1, num_queries, num_keys)` so that they can be handed to the
drafter (which turns them into an additive mask) or, made additive with [`to_additive_mask`], to a transformers
target as a custom 4D mask.
"""

import torch


def build_block_mask(
    anchor_positions: torch.LongTensor,
    block_valid: torch.BoolTensor,
    context_length: int,
    block_size: int,
    context_mask: torch.Tensor | None = None,
) -> torch.BoolTensor:
    """Mask of the multi-block drafter forward: `N` blocks of `B` rows query `[context ; all blocks]`.

    Visibility rules (row = slot of block `i` anchored at `p_i`, column = key):

    1. A row sees context column `c` iff `c < p_i` (the anchor itself is not context: at inference its target
       features do not exist yet) and `context_mask[c]` is set.
    2. A row sees every row of its own block, in both directions (the block is drafted in parallel).
    3. A row never sees another block's rows.
    4. Rows of an invalid block (`block_valid` False) see only their own block, never the context: no row is
       empty (an empty softmax row is NaN in sdpa), and their loss weight is zero anyway.

    Args:
        anchor_positions (`torch.LongTensor` of shape `(batch, N)`): absolute position `p_i` of each block's anchor.
        block_valid (`torch.BoolTensor` of shape `(batch, N)`): which blocks are real.
        context_length (`int`): `C`, number of context columns (positions `0 .. C-1`).
        block_size (`int`): `B`, rows per block.
        context_mask (`torch.Tensor` of shape `(batch, C)`, *optional*): 2D padding mask of the context (1 = real).
    Returns:
        `torch.BoolTensor` of shape `(batch, 1, N * B, C + N * B)`.

    Example: anchors `[[2, 3]]`, `B = 2`, `C = 4` gives rows `[blk0 slot0, blk0 slot1, blk1 slot0, blk1 slot1]` and
    columns `[c0 c1 c2 c3 | b0s0 b0s1 | b1s0 b1s1]`; block 0 rows are `1 1 0 0 | 1 1 | 0 0`, block 1 rows
    `1 1 1 0 | 0 0 | 1 1`.
    """
    batch, num_blocks = anchor_positions.shape
    device = anchor_positions.device
    rows_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [b, N*B]: anchor of each row's block
    rows_valid = block_valid.repeat_interleave(block_size, dim=1)  # [b, N*B]
    columns = torch.arange(context_length, device=device)
    sees_context = columns.view(1, 1, -1) < rows_anchor.unsqueeze(-1)  # rule 1, [b, N*B, C]
    if context_mask is not None:
        sees_context = sees_context & context_mask.bool().unsqueeze(1)
    sees_context = sees_context & rows_valid.unsqueeze(-1)  # rule 4
    block_of_row = torch.arange(num_blocks * block_size, device=device) // block_size  # [N*B]
    same_block = block_of_row.view(-1, 1) == block_of_row.view(1, -1)  # rules 2 and 3, [N*B, N*B]
    sees_blocks = same_block.unsqueeze(0).expand(batch, -1, -1)
    return torch.cat([sees_context, sees_blocks], dim=-1).unsqueeze(1)


def build_verification_mask(
    query_positions: torch.LongTensor,
    context_length: int,
    rows_per_block: int,
    context_mask: torch.Tensor | None = None,
) -> torch.BoolTensor:
    """Mask of the target's "faithful verification" forward: per block, a causal run of draft tokens on top of the
    true prefix held in the target's cache (the tokens the target would see when verifying the drafted block).

    Visibility rules (row `s` of block `i`, at absolute position `q_{i,s}`; the run of block `i` starts at
    `q_{i,0}`):

    1. A row sees cached prefix column `c` iff `c < q_{i,0}` and `context_mask[c]` is set.
    2. A row sees rows `s' <= s` of its own block (causal, as in the target's verification pass).
    3. A row never sees another block's rows.

    Rule 2 always includes the row itself, so no row is empty even for padding rows.

    Args:
        query_positions (`torch.LongTensor` of shape `(batch, N * R)`): absolute positions of the rows, `R` per
            block, consecutive within a block.
        context_length (`int`): `C`, length of the cached prefix (positions `0 .. C-1`).
        rows_per_block (`int`): `R`.
        context_mask (`torch.Tensor` of shape `(batch, C)`, *optional*): 2D padding mask of the prefix.
    Returns:
        `torch.BoolTensor` of shape `(batch, 1, N * R, C + N * R)`.
    """
    batch, num_rows = query_positions.shape
    device = query_positions.device
    run_start = query_positions.view(batch, -1, rows_per_block)[:, :, :1]  # [b, N, 1]
    run_start = run_start.expand(-1, -1, rows_per_block).reshape(batch, num_rows)  # [b, N*R]
    sees_prefix = torch.arange(context_length, device=device).view(1, 1, -1) < run_start.unsqueeze(-1)
    if context_mask is not None:
        sees_prefix = sees_prefix & context_mask.bool().unsqueeze(1)
    rows = torch.arange(num_rows, device=device)
    same_block = (rows.view(-1, 1) // rows_per_block) == (rows.view(1, -1) // rows_per_block)
    causal = rows.view(-1, 1) >= rows.view(1, -1)
    sees_rows = (same_block & causal).unsqueeze(0).expand(batch, -1, -1)
    return torch.cat([sees_prefix, sees_rows], dim=-1).unsqueeze(1)


def to_additive_mask(mask: torch.BoolTensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask (True = attend) -> additive float mask (0 / dtype min) accepted by every attention backend."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


__all__ = ["build_block_mask", "build_verification_mask", "to_additive_mask"]

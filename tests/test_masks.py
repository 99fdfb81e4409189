"""Table tests of the training attention masks, entry by entry."""

import pytest
import torch

from hf_retrace.trainer.masks import build_block_mask, build_verification_mask, to_additive_mask


def _rows(mask):
    return ["".join("1" if v else "." for v in row) for row in mask[0, 0].tolist()]


def test_block_mask_small_case_entry_by_entry():
    # C = 5 context columns, N = 2 blocks of B = 3 anchored at p = 1 and p = 3.
    mask = build_block_mask(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), context_length=5, block_size=3)
    assert mask.shape == (1, 1, 6, 11) and mask.dtype == torch.bool
    #            context | blk0 | blk1
    assert _rows(mask) == [
        "1...." + "111" + "...",  # block 0 (p = 1): context < 1, own block only
        "1...." + "111" + "...",
        "1...." + "111" + "...",
        "111.." + "..." + "111",  # block 1 (p = 3): context < 3, never block 0
        "111.." + "..." + "111",
        "111.." + "..." + "111",
    ]


@pytest.mark.parametrize(
    "anchor, valid, context_mask, expected_context",
    [
        (0, True, None, "...."),  # rule 1: the anchor's own position is never context
        (4, True, None, "1111"),  # anchor past the context: all of it
        (3, True, [1, 1, 0, 0], "11.."),  # padding columns hidden
        (3, False, None, "...."),  # rule 4: invalid blocks see no context ...
    ],
)
def test_block_mask_context_rules(anchor, valid, context_mask, expected_context):
    cm = None if context_mask is None else torch.tensor([context_mask])
    mask = build_block_mask(torch.tensor([[anchor]]), torch.tensor([[valid]]), 4, 2, cm)
    assert _rows(mask) == [expected_context + "11"] * 2  # ... but always their own block (no empty row)


def test_block_mask_batch_rows_independent():
    anchors = torch.tensor([[2, 0], [1, 2]])
    valid = torch.tensor([[True, False], [True, True]])
    mask = build_block_mask(anchors, valid, 3, 2)
    assert _rows(mask[:1]) == ["11.11..", "11.11..", ".....11", ".....11"]  # 2nd block invalid: own block only
    assert _rows(mask[1:]) == ["1..11..", "1..11..", "11...11", "11...11"]


def test_verification_mask_small_case_entry_by_entry():
    # Two tails of R = 2 rows on a cached prefix of C = 5; tail 0 starts at position 2, tail 1 at position 4.
    positions = torch.tensor([[2, 3, 4, 5]])
    mask = build_verification_mask(positions, context_length=5, rows_per_block=2)
    assert mask.shape == (1, 1, 4, 9)
    assert _rows(mask) == [
        "11..." + "1...",  # prefix < 2, causal within the tail
        "11..." + "11..",
        "1111." + "..1.",  # prefix < 4, never the other tail
        "1111." + "..11",
    ]


def test_verification_mask_padding_and_additive():
    mask = build_verification_mask(torch.tensor([[3, 4]]), 4, 2, context_mask=torch.tensor([[1, 0, 1, 1]]))
    assert _rows(mask) == ["1.1.1.", "1.1.11"]
    additive = to_additive_mask(mask, torch.float32)
    assert additive[0, 0, 0, 0] == 0 and additive[0, 0, 0, 1] == torch.finfo(torch.float32).min

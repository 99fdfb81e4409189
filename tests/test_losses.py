"""Table tests of the DFlash block loss, its decay weights and greedy acceptance."""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_retrace.losses import (
    IGNORE_INDEX,
    block_cross_entropy,
    count_accepted,
    default_loss_decay_gamma,
    loss_decay_weights,
)


@pytest.mark.parametrize("block_size, gamma", [(16, 7.0), (8, 3.0), (10, 4.0), (4, 1.0), (2, 1.0)])
def test_default_gamma(block_size, gamma):
    assert default_loss_decay_gamma(block_size) == gamma


def test_default_gamma_keeps_last_slot_ratio():
    for block_size in (6, 8, 16, 32):
        w = loss_decay_weights(block_size, default_loss_decay_gamma(block_size))
        assert math.isclose(float(w[-1] / w[1]), math.exp(-2), rel_tol=1e-5)


@pytest.mark.parametrize(
    "block_size, gamma, expected",
    [
        (4, 1.0, [0.0, 1.0, math.exp(-1), math.exp(-2)]),
        (3, 7.0, [0.0, 1.0, math.exp(-1 / 7)]),
    ],
)
def test_decay_weights(block_size, gamma, expected):
    torch.testing.assert_close(loss_decay_weights(block_size, gamma), torch.tensor(expected))


def test_decay_weights_rejects_bad_gamma():
    with pytest.raises(ValueError, match="loss_decay_gamma"):
        loss_decay_weights(4, 0.0)


def test_block_cross_entropy_is_weight_normalised():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, 3], [IGNORE_INDEX, 0, IGNORE_INDEX, 4]])
    weights = loss_decay_weights(4, 1.0).expand(2, 4)
    ce = F.cross_entropy(logits.view(-1, 5), labels.clamp_min(0).view(-1), reduction="none").view(2, 4)
    w = weights * (labels != IGNORE_INDEX)
    expected = (ce * w).sum() / w.sum()
    torch.testing.assert_close(block_cross_entropy(logits, labels, weights), expected)


def test_block_cross_entropy_no_supervised_slot_is_zero_with_grad():
    logits = torch.randn(3, 5, requires_grad=True)
    loss = block_cross_entropy(logits, torch.full((3,), IGNORE_INDEX), torch.ones(3))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros(3, 5))


def test_block_cross_entropy_perfect_prediction_is_near_zero():
    labels = torch.tensor([1, 2])
    logits = F.one_hot(labels, 4).float() * 50
    assert block_cross_entropy(logits, labels, torch.ones(2)).item() < 1e-6


@pytest.mark.parametrize(
    "drafts, labels, expected",
    [
        ([5, 6, 7], [5, 6, 7], 3),  # full acceptance: n = B-1
        ([5, 6, 9], [5, 6, 7], 2),  # rejection at the last slot
        ([1, 6, 7], [5, 6, 7], 0),  # first slot rejected; later matches do not count
        ([5, 6, 9, 7], [5, 6, 8, 7], 2),
        ([5, 6, 7], [5, IGNORE_INDEX, 7], 1),  # an unknown label ends acceptance
    ],
)
def test_count_accepted(drafts, labels, expected):
    assert count_accepted(torch.tensor([drafts]), torch.tensor([labels])).tolist() == [expected]

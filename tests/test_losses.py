"""Table tests of the DFlash block loss, its decay weights and greedy acceptance."""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_retrace.data import IGNORE_INDEX
from hf_retrace.trainer.losses import (
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


def test_slot_log_likelihoods_chunked_equals_whole():
    from hf_retrace.trainer.losses import slot_log_likelihoods

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 6, generator=generator, requires_grad=True)
    weight = torch.randn(9, 6, generator=generator)
    labels = torch.randint(0, 9, (11,), generator=generator)
    whole = -F.cross_entropy(hidden @ weight.T, labels, reduction="none")
    (grad_whole,) = torch.autograd.grad(whole.sum(), hidden)
    chunked, argmax, soft = slot_log_likelihoods(hidden, weight, labels, chunk_rows=4)  # checkpointed chunks
    assert soft is None
    (grad_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(grad_chunked, grad_whole)
    assert torch.equal(argmax, (hidden @ weight.T).argmax(-1))


def test_expected_accepted_length():
    from hf_retrace.trainer.losses import expected_accepted_length

    probs = torch.tensor([[0.5, 0.4, 0.9], [1.0, 1.0, 1.0], [0.5, 0.4, 0.9]])
    acceptable = torch.tensor([[True, True, True], [True, True, True], [True, False, True]])
    eal = expected_accepted_length(probs.log(), acceptable)
    # E[n] = p1 + p1 p2 + p1 p2 p3; certain drafts accept all 3; a slot that cannot be accepted ends the chain
    torch.testing.assert_close(eal, torch.tensor([0.5 + 0.2 + 0.18, 3.0, 0.5]))
    # Monte Carlo check of the first row: n = number of leading successes of independent draws
    draws = torch.rand(200_000, 3, generator=torch.Generator().manual_seed(0)) < probs[0]
    assert abs(draws.long().cumprod(-1).sum(-1).float().mean().item() - eal[0].item()) < 0.01


def test_block_loss_eal_and_out_of_vocabulary_labels():
    from hf_retrace.trainer.draft_vocab import TrainingDraftHead
    from hf_retrace.trainer.objective import LossSettings, block_loss

    head = torch.nn.Linear(4, 10, bias=False)
    hidden = torch.randn(1, 2, 4, 4, requires_grad=True)  # [b, N, B, H]
    labels = torch.tensor([[[-100, 1, 4, 2], [-100, 8, -100, -100]]])  # 2 is outside the draft vocabulary
    settings = LossSettings(TrainingDraftHead.from_lm_head(head, torch.tensor([1, 4, 8])), torch.ones(4))
    ce, drafts, metrics = block_loss(hidden, labels, settings)
    assert metrics["out_of_vocab"] == pytest.approx(1 / 4)
    assert (drafts[labels == -100] == -1).all() and (drafts[..., 3] == -1).all()  # unsupervised and OOV: no draft
    settings.loss_type, settings.eal_ce_weight = "eal", 0.0
    eal_loss, _, _ = block_loss(hidden, labels, settings)
    eal_loss.backward()
    assert -1 / 3 <= eal_loss.item() <= 0 and hidden.grad.abs().sum() > 0


def test_distillation_term_is_the_soft_cross_entropy_and_vanishes_at_the_teacher():
    from hf_retrace.trainer.losses import slot_log_likelihoods

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 6, generator=generator, requires_grad=True)
    teacher = torch.randn(11, 6, generator=generator)
    weight = torch.randn(9, 6, generator=generator)
    labels = torch.randint(0, 9, (11,), generator=generator)
    expected = -((teacher @ weight.T).softmax(-1) * (hidden @ weight.T).log_softmax(-1)).sum(-1)
    log_likelihood, _, soft = slot_log_likelihoods(hidden, weight, labels, chunk_rows=4, teacher_states=teacher)
    torch.testing.assert_close(soft, expected)
    torch.testing.assert_close(log_likelihood, -F.cross_entropy(hidden @ weight.T, labels, reduction="none"))
    # the soft cross-entropy's gradient is W^T (q - p): zero where the drafter's state is the teacher's, not elsewhere
    at_teacher = teacher.clone().requires_grad_(True)
    _, _, soft = slot_log_likelihoods(at_teacher, weight, labels, chunk_rows=4, teacher_states=teacher)
    (grad,) = torch.autograd.grad(soft.sum(), at_teacher)
    torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(expected.sum(), hidden)
    assert grad.abs().max() > 1e-2


def test_block_loss_adds_the_weighted_distillation_term():
    from hf_retrace.trainer.draft_vocab import TrainingDraftHead
    from hf_retrace.trainer.objective import LossSettings, block_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 10, bias=False)
    hidden, teacher = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    labels = torch.tensor([[[-100, 1, 4, 8], [-100, 8, -100, -100]]])
    settings = LossSettings(TrainingDraftHead.from_lm_head(head, torch.tensor([1, 4, 8])), loss_decay_weights(4, 1.0))
    plain, _, metrics = block_loss(hidden, labels, settings)
    assert "distillation" not in metrics
    settings.distillation_weight = 0.5
    with pytest.raises(ValueError, match="teacher_states"):
        block_loss(hidden, labels, settings)
    distilled, _, metrics = block_loss(hidden, labels, settings, teacher)
    rows = head.weight[[1, 4, 8]]
    keep = labels != -100
    soft = -((teacher[keep] @ rows.T).softmax(-1) * (hidden[keep] @ rows.T).log_softmax(-1)).sum(-1)
    w = loss_decay_weights(4, 1.0).expand(labels.shape)[keep]
    expected = (soft * w).sum() / w.sum()
    assert metrics["distillation"] == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(distilled, plain + 0.5 * expected)

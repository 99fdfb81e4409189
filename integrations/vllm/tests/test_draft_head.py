"""The drafter's greedy drafts and their probabilities, read over the reduced draft vocabulary, are those of vLLM's
`DFlashQwen3ForCausalLM.compute_logits` (which spreads the draft logits into the target vocabulary first)."""

import types

import pytest
import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from hf_retrace_vllm.model import DFlashReTraceDraftModel


def _drafter(draft_vocab_size: int | None, vocab_size: int = 64, hidden: int = 16, seed: int = 0):
    """The attributes both methods read, with a plain matmul standing in for vLLM's logits processor."""
    generator = torch.Generator().manual_seed(seed)
    rows = draft_vocab_size or vocab_size
    head = torch.randn(rows, hidden, generator=generator)
    d2t = None
    if draft_vocab_size is not None:  # sorted target ids, as the export writes them: draft id i is i + d2t[i]
        ids = torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values
        d2t = torch.nn.Parameter(ids - torch.arange(draft_vocab_size), requires_grad=False)
    config = types.SimpleNamespace(draft_vocab_size=rows, vocab_size=vocab_size)
    return types.SimpleNamespace(lm_head=head, logits_processor=lambda lm_head, states: states @ lm_head.T,
                                 draft_id_to_target_id=d2t, config=config)  # fmt: skip


@pytest.mark.parametrize("draft_vocab_size", [None, 8, 40])
def test_greedy_top1_matches_vllms_full_vocabulary_logits(draft_vocab_size):
    drafter = _drafter(draft_vocab_size)
    states = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    drafts, probabilities = DFlashReTraceDraftModel.greedy_top1(drafter, states)

    full = DFlashQwen3ForCausalLM.compute_logits(drafter, states)  # [24, V], -inf off the draft vocabulary
    assert drafts.tolist() == full.argmax(-1).tolist()
    torch.testing.assert_close(probabilities, full.float().softmax(-1).amax(-1), rtol=1e-6, atol=1e-7)
    if draft_vocab_size is not None:  # the drafts are target ids, not draft ids
        allowed = set((torch.arange(draft_vocab_size) + drafter.draft_id_to_target_id).tolist())
        assert set(drafts.tolist()) <= allowed and max(drafts.tolist()) >= draft_vocab_size

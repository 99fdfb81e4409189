"""Speculative sampling with a ReTrace drafter keeps the target's distribution (transformers' acceptance rule, fed
the drafter's logits). Exact target marginals on a vocabulary of 8 vs empirical frequencies with a fixed seed."""

import itertools

import pytest
import torch
from transformers.generation import candidate_generator as cg

from conftest import make_drafter, make_target


VOCAB, SAMPLES, PROMPT = 8, 1000, [[3, 1, 4, 1, 5]]


def _exact_marginals(target):
    """Marginals of the 2nd and 3rd sampled tokens under the target alone, by enumerating prefixes."""
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        p1 = target(prompt).logits[0, -1].softmax(-1)  # [V]
        firsts = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        p2_given_1 = target(firsts).logits[:, -1].softmax(-1)  # [V, V]
        pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
        seconds = torch.cat([prompt.repeat(VOCAB * VOCAB, 1), pairs], dim=1)
        p3_given_12 = target(seconds).logits[:, -1].softmax(-1).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2_given_1  # [V, V]
    return joint12.sum(0), (joint12[..., None] * p3_given_12).sum((0, 1))


def _tv(p, q):
    return 0.5 * (p - q).abs().sum().item()


@pytest.mark.parametrize("draft_logits_dtype", [None, "bfloat16"])  # q from the target head, or its bf16 copy
def test_speculative_sampling_keeps_target_distribution(monkeypatch, draft_logits_dtype):
    target = make_target("qwen3", restricted=False, vocab_size=VOCAB, seed=4)
    with torch.no_grad():  # peaked distributions, so target and drafter clearly differ
        target.get_output_embeddings().weight.mul_(8.0)
    drafter = make_drafter(target, block_size=4, mode="corrected")
    drafter.config.draft_logits_dtype = draft_logits_dtype
    exact2, exact3 = _exact_marginals(target)

    drafts = []
    original = cg.DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, **kwargs):
        ids, logits = original(self, input_ids, **kwargs)
        if logits is not None:
            drafts.append(ids[0, input_ids.shape[1]].item())
        return ids, logits

    monkeypatch.setattr(cg.DFlashTokenCandidateGenerator, "get_candidates", recording)
    torch.manual_seed(0)
    counts2, counts3 = torch.zeros(VOCAB), torch.zeros(VOCAB)
    prompt = torch.tensor(PROMPT)
    accepted = 0
    for _ in range(SAMPLES):
        out = target.generate(
            prompt, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=3, assistant_model=drafter,
            pad_token_id=0,
        )  # fmt: skip
        counts2[out[0, -2]] += 1
        counts3[out[0, -1]] += 1
        accepted += drafter.last_generation_stats.acceptance_lengths[0] > 1
    draft_freq = torch.bincount(torch.tensor(drafts), minlength=VOCAB).float() / len(drafts)

    # Sampling noise of a V=8 histogram from 1000 draws is about 0.03 in total variation.
    assert _tv(counts2 / SAMPLES, exact2) < 0.07
    assert _tv(counts3 / SAMPLES, exact3) < 0.07
    # The test has power: a rule that accepted drafts blindly would produce the drafter's distribution instead.
    assert _tv(draft_freq, exact2) > 0.2
    assert accepted > SAMPLES // 10  # and drafts really were accepted, so the acceptance rule was exercised

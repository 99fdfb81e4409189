"""Speculative sampling with a ReTrace drafter keeps the target's distribution (transformers' acceptance rule, fed
the drafter's logits). Exact target marginals on a vocabulary of 8 vs empirical frequencies with a fixed seed, with
conditioned (ReTrace) rounds really running, and with a reduced draft vocabulary (q = 0 outside it)."""

import itertools

import pytest
import torch
from transformers.generation import candidate_generator as cg

from conftest import make_drafter, make_target


VOCAB, SAMPLES, PROMPT = 8, 1000, [[3, 1, 4, 1, 5]]


def _exact_marginals(target, num_tokens: int = 4):
    """Marginals of sampled tokens 2..num_tokens under the target alone, by enumerating every prefix."""
    prompt = torch.tensor(PROMPT)
    marginals = []
    with torch.no_grad():
        joint = target(prompt).logits[0, -1].softmax(-1)  # [V]: distribution of token 1
        for length in range(1, num_tokens):
            prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=length)))  # [V^length, length]
            inputs = torch.cat([prompt.repeat(len(prefixes), 1), prefixes], dim=1)
            step = target(inputs).logits[:, -1].softmax(-1)  # [V^length, V]
            joint = (joint.reshape(-1, 1) * step).reshape(-1)  # joint of tokens 1..length+1, flattened
            marginals.append(joint.view(-1, VOCAB).sum(0))
    return marginals


def _tv(p, q):
    return 0.5 * (p - q).abs().sum().item()


@pytest.mark.slow
@pytest.mark.parametrize(
    "draft_logits_dtype, draft_vocab, block_size, num_assistant_tokens, confidence",
    # q from the head, its bf16 copy, 5 of 8 tokens; B = 4 verifying only its first 2 drafts; then a confidence stop
    # (how many drafts are verified then depends on the sampled drafts themselves)
    [
        (None, None, 3, None, None),
        ("bfloat16", None, 3, None, None),
        (None, [0, 2, 3, 5, 6], 3, None, None),
        (None, None, 4, 2, None),
        (None, None, 3, None, 0.3),
    ],
)
def test_speculative_sampling_keeps_target_distribution(
    monkeypatch, draft_logits_dtype, draft_vocab, block_size, num_assistant_tokens, confidence
):
    target = make_target("qwen3", restricted=False, vocab_size=VOCAB, seed=4)
    with torch.no_grad():  # peaked distributions, so target and drafter clearly differ
        target.get_output_embeddings().weight.mul_(8.0)
    drafter = make_drafter(target, block_size=block_size, mode="corrected")
    drafter.generation_config.draft_logits_dtype = draft_logits_dtype
    drafter.generation_config.num_assistant_tokens = num_assistant_tokens
    drafter.generation_config.assistant_confidence_threshold = confidence
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    exact = _exact_marginals(target)

    drafts = []
    original = cg.DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, **kwargs):
        ids, logits = original(self, input_ids, **kwargs)
        if logits is not None:
            drafts.append(ids[0, input_ids.shape[1]].item())
        return ids, logits

    monkeypatch.setattr(cg.DFlashTokenCandidateGenerator, "get_candidates", recording)
    torch.manual_seed(0)
    counts = torch.zeros(3, VOCAB)  # tokens 2, 3 and 4
    prompt = torch.tensor(PROMPT)
    accepted = conditioned = 0
    for _ in range(SAMPLES):
        out = target.generate(
            prompt, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=4, assistant_model=drafter,
            pad_token_id=0,
        )  # fmt: skip
        for k in range(3):
            counts[k, out[0, -3 + k]] += 1
        stats = drafter.last_generation_stats
        accepted += stats.acceptance_lengths[0] > 1
        conditioned += stats.num_conditioned_rounds
    draft_freq = torch.bincount(torch.tensor(drafts), minlength=VOCAB).float() / len(drafts)

    # Sampling noise of a V=8 histogram from 1000 draws is about 0.03 in total variation.
    for k in range(3):
        assert _tv(counts[k] / SAMPLES, exact[k]) < 0.07, f"token {k + 2}"
    # The test has power: a rule that accepted drafts blindly would produce the drafter's distribution instead,
    # which is farther from the target's than the 0.07 tolerance (0.19 for the full-vocabulary drafter).
    assert _tv(draft_freq, exact[0]) > 0.12
    assert accepted > SAMPLES // 10  # and drafts really were accepted, so the acceptance rule was exercised
    # B = 3 (or k = 2 verified of B = 4) and 4 new tokens: a first cycle that rejects at slot 1 retains one slot
    # (L = B-2-n, or k-1-n, = 1), so the next cycle runs conditioned; its drafts are then part of what the marginals
    # of tokens 3 and 4 check.
    assert conditioned > SAMPLES // 20, f"only {conditioned} conditioned rounds"
    if draft_vocab is not None:
        assert set(drafts) <= set(draft_vocab)

"""Training forward == inference forward, and the round-2 bookkeeping of the ReTrace simulation.

References are built the way inference runs: target features from `outputs.hidden_states`, one drafter call per block
(plain, and through a `DFlashCache` as transformers' DFlash generator calls it), the verification pass as a target
forward over `[prefix, a, d_1 .. d_{B-1}]`, and [`build_rejected_trajectory`] for the alignment.
"""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DFlashCache

from hf_retrace import ReTraceDrafterModel, build_rejected_trajectory
from hf_retrace.trainer.draft_vocab import TrainingDraftHead
from hf_retrace.data import IGNORE_INDEX
from hf_retrace.trainer.losses import loss_decay_weights
from hf_retrace.data.target_features import compute_target_features, embed_tokens, final_hidden_states
from hf_retrace.trainer.objective import (
    LossSettings,
    acceptance_metrics,
    align_rejected_trajectory,
    block_labels,
    dflash_training_step,
    draft_blocks,
    faithful_verification_features,
    sample_anchor_positions,
    simulate_retrace_rounds,
    teacher_forced_verification_features,
)
from hf_retrace.trainer.setup import build_tiny_target
from conftest import make_target


B = 4


@pytest.fixture(scope="module", params=[False, True], ids=["dflash", "anchor_broadcast"])
def models(request):
    target = build_tiny_target(seed=0)
    torch.manual_seed(1)
    drafter = ReTraceDrafterModel.from_target(
        target, num_hidden_layers=1, block_size=B, anchor_broadcast=request.param
    )
    drafter = drafter.float().eval()
    with torch.no_grad():  # non-zero conditioning (and W_a) so that they really change the drafts
        for param in drafter.retrace.parameters():
            param.normal_(0.0, 0.5)
        if request.param:
            drafter.anchor_broadcast.weight.normal_(0.0, 0.5)
    return target, drafter


def _reference_features(target, ids, layer_ids):
    out = target(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)


def _inference_block(drafter, target, context, anchor_token, p, trajectory=None, use_cache=False):
    """The drafter call of the in-tree DFlash generator for one block anchored at `p` (context = positions `< p`)."""
    noise = torch.tensor([[anchor_token] + [drafter.config.mask_token_id] * (B - 1)])
    cache = None
    if use_cache:  # as DFlashTokenCandidateGenerator after prefill: cache empty, `p` new context states
        cache = DFlashCache(config=drafter.config)
        cache.activate_past_recording()
        cache.set_previous_accepted_tokens(p)
    out = drafter(
        noise_embeds=embed_tokens(target, noise), context_hidden_states=context,
        position_ids=torch.arange(p + B).unsqueeze(0), cache=cache, rejected_trajectory=trajectory,
    )  # fmt: skip
    return out.last_hidden_state  # [1, B, H]


def test_target_features_match_output_hidden_states(models):
    target, _ = models
    ids = torch.randint(1, 128, (2, 9))
    for layer_ids in ([0, 2], [1], [3], [0, 3]):  # early stop, and the post-norm last layer
        torch.testing.assert_close(
            compute_target_features(target, ids, layer_ids), _reference_features(target, ids, layer_ids)
        )


@pytest.mark.parametrize("use_cache", [False, True])
def test_round1_training_forward_equals_inference(models, use_cache):
    target, drafter = models
    ids = torch.randint(1, 128, (2, 14), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 11:] = 0  # right padding on row 1
    anchors = torch.tensor([[1, 5, 6, 11], [2, 3, 9, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    layer_ids = drafter.config.target_layer_ids
    feats = compute_target_features(target, ids, layer_ids, attention_mask)
    with torch.no_grad():
        hidden = draft_blocks(drafter, target, ids, feats, anchors, valid, attention_mask)  # [2, 4, B, H]
        lm_head = target.get_output_embeddings()
        for row in range(2):
            ref_feats = _reference_features(target, ids[row : row + 1], layer_ids)
            for i in range(4):
                if not valid[row, i]:
                    continue
                p = int(anchors[row, i])
                ref = _inference_block(drafter, target, ref_feats[:, :p], int(ids[row, p]), p, use_cache=use_cache)
                torch.testing.assert_close(lm_head(hidden[row, i]), lm_head(ref[0]), atol=1e-5, rtol=1e-5)


def _sequence_with_acceptance(drafter, target, prefix, n, total_length, seed):
    """A sequence whose block at `p = len(prefix) - 1` gets exactly `n` drafts accepted: `x_{p+k} = d_k` for `k <= n`,
    then a token different from `d_{n+1}`, then random tokens."""
    p = prefix.shape[1] - 1
    with torch.no_grad():
        ref_feats = _reference_features(target, prefix, drafter.config.target_layer_ids)
        first = _inference_block(drafter, target, ref_feats[:, :p], int(prefix[0, p]), p)
        drafts = target.get_output_embeddings()(first[0, 1:]).argmax(-1)  # d_1 .. d_{B-1}
    generator = torch.Generator().manual_seed(seed)
    tail = torch.randint(1, 128, (total_length - p - 1,), generator=generator)
    tail[:n] = drafts[:n]
    if n < B - 1:
        tail[n] = (drafts[n] + 1) % 128  # first rejection at slot n+1
    return torch.cat([prefix[0], tail]).unsqueeze(0)


def _inference_rounds(drafter, target, ids, p):
    """Round 1, verification pass, alignment and round 2 exactly as inference runs them."""
    layer_ids = drafter.config.target_layer_ids
    lm_head = target.get_output_embeddings()
    clean = _reference_features(target, ids, layer_ids)
    first = _inference_block(drafter, target, clean[:, :p], int(ids[0, p]), p)
    drafts = lm_head(first[0, 1:]).argmax(-1)
    labels = ids[0, p + 1 : p + B]
    n = int((drafts[: len(labels)] == labels).long().cumprod(0).sum())
    verified = torch.cat([ids[:, : p + 1], drafts.unsqueeze(0)], dim=1)  # [x_<p, a, d_1 .. d_{B-1}]
    verification = _reference_features(target, verified, layer_ids)[:, -B:]
    trajectory = build_rejected_trajectory(first, verification, n)
    p_next = p + n + 1
    context = torch.cat([clean[:, :p], verification[:, : n + 1]], dim=1)  # committed: x_<p, then a, d_1 .. d_n
    second = _inference_block(drafter, target, context, int(ids[0, p_next]), p_next, trajectory)
    return n, first, second, trajectory


@pytest.mark.parametrize("verification", ["faithful", "teacher_forced"])
def test_round2_training_forward_equals_inference(models, verification):
    target, drafter = models
    p, length = 5, 16
    prefix = torch.randint(1, 128, (1, p + 1), generator=torch.Generator().manual_seed(7))
    rows = [_sequence_with_acceptance(drafter, target, prefix, n, length, seed=n) for n in range(B)]
    ids = torch.cat(rows)  # row n: the block at p accepts exactly n drafts
    attention_mask, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    anchors = torch.tensor([[2, p]] * B)  # a second block per row checks that blocks do not interact
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        rounds = simulate_retrace_rounds(drafter, target, ids, attention_mask, loss_mask, anchors, valid, verification)
    lm_head = target.get_output_embeddings()
    for n in range(B):
        ref_n, ref_first, ref_second, trajectory = _inference_rounds(drafter, target, ids[n : n + 1], p)
        assert ref_n == n == int(rounds.num_accepted[n, 1])
        assert int(rounds.anchor_positions[n, 1]) == p + n + 1
        assert int(rounds.num_retained[n, 1]) == max(B - 2 - n, 0)
        torch.testing.assert_close(rounds.first_hidden_states[n, 1], ref_first[0], atol=1e-5, rtol=1e-5)
        slots = rounds.conditioning.slot_mask.view(B, 2, B)[n, 1]
        assert slots.tolist() == (trajectory.dense_slot_mask(B)[0].tolist() if trajectory is not None else [False] * B)
        if verification == "faithful" or trajectory is None:  # teacher forcing feeds other features by design
            torch.testing.assert_close(
                lm_head(rounds.hidden_states[n, 1]), lm_head(ref_second[0]), atol=1e-4, rtol=1e-4
            )


def test_teacher_forced_differs_from_faithful_only_after_rejection(models):
    """Faithful and teacher-forced features agree at accepted positions and differ at the rejected ones."""
    target, drafter = models
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    layer_ids = drafter.config.target_layer_ids
    cache = DynamicCache(config=target.config)
    clean = compute_target_features(target, ids, layer_ids, cache=cache, use_cache=True)
    anchors, accepted = torch.tensor([[3]]), torch.tensor([[0]])
    block_ids = torch.tensor([[[int(ids[0, 3]), 9, 10, 11]]])  # d_1 = 9 is rejected (n = 0)
    faithful = faithful_verification_features(target, layer_ids, cache, block_ids, anchors, accepted, None)
    forced = teacher_forced_verification_features(clean, anchors, B)
    verified = torch.cat([ids[:, :4], block_ids[0, :, 1:]], dim=1)
    reference = _reference_features(target, verified, layer_ids)[:, -B:]
    # Filled positions i = n+1 .. B-2 = 1, 2: the verification inputs d_1, d_2.
    torch.testing.assert_close(faithful[0, 0, 1:3], reference[0, 1:3], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(faithful[0, 0, 1:3], forced[0, 0, 1:3])


@pytest.mark.parametrize("n", range(B))
def test_alignment_matches_build_rejected_trajectory(n):
    """Round-2 bookkeeping on hand-made states: slots, sources and feature positions equal the inference alignment."""
    hidden = torch.arange(B, dtype=torch.float32).view(1, 1, B, 1).expand(1, 1, B, 3) + 100  # h_j = 100 + j
    feats = torch.arange(B, dtype=torch.float32).view(1, 1, B, 1).expand(1, 1, B, 2) + 200  # v_i = 200 + i
    accepted = torch.tensor([[n]])
    conditioning = align_rejected_trajectory(hidden, feats, accepted, torch.tensor([[True]]))
    reference = build_rejected_trajectory(hidden[:, 0], feats[:, 0], n)
    if reference is None:  # L = B-2-n <= 0: full acceptance or rejection at the last slot
        assert not conditioning.slot_mask.any()
        assert not conditioning.hidden_states.any()
        return
    slots = reference.dense_slot_mask(B)
    assert conditioning.slot_mask.tolist() == slots.tolist()
    torch.testing.assert_close(conditioning.hidden_states[slots], reference.hidden_states.flatten(0, 1))
    torch.testing.assert_close(conditioning.target_features[slots], reference.target_features.flatten(0, 1))
    # slot s = 1..L holds h_{s+n+1} and v_{s+n}
    for s in range(1, B - 1 - n):
        assert conditioning.hidden_states[0, s, 0] == 100 + s + n + 1
        assert conditioning.target_features[0, s, 0] == 200 + s + n


def test_alignment_invalid_block_is_unconditioned():
    hidden, feats = torch.ones(1, 2, B, 3), torch.ones(1, 2, B, 2)
    conditioning = align_rejected_trajectory(hidden, feats, torch.tensor([[0, 0]]), torch.tensor([[True, False]]))
    assert conditioning.slot_mask.view(2, B).tolist() == [[False, True, True, False], [False] * B]


@pytest.mark.parametrize(
    "loss_mask, expected",
    [
        ([0, 0, 1, 1, 1, 1], [2, 3, 4]),  # anchors need loss_mask[p] and loss_mask[p + 1]
        ([0, 1, 0, 1, 1, 0], [3]),
        ([0, 0, 0, 0, 1, 0], []),  # a lone response token has no supervised next token
    ],
)
def test_sample_anchor_positions(loss_mask, expected):
    anchors, valid = sample_anchor_positions(torch.tensor([loss_mask]), 8, torch.Generator().manual_seed(0))
    assert anchors[valid].tolist() == expected
    assert anchors.shape[1] == max(len(expected), 1)


def test_sample_anchor_positions_caps_and_is_seeded():
    loss_mask = torch.ones(3, 40, dtype=torch.long)
    a1, v1 = sample_anchor_positions(loss_mask, 5, torch.Generator().manual_seed(1))
    a2, _ = sample_anchor_positions(loss_mask, 5, torch.Generator().manual_seed(1))
    assert a1.shape == (3, 5) and v1.all() and torch.equal(a1, a2)
    assert all(row.tolist() == sorted(set(row.tolist())) for row in a1)  # distinct, ascending


def test_block_labels():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    labels = block_labels(ids, loss_mask, torch.tensor([[2, 4, 0]]), torch.tensor([[True, True, False]]), B)
    I = IGNORE_INDEX
    # slot 0 never supervised; past the loss mask / sequence end ignored; invalid block ignored
    assert labels.tolist() == [[[I, 13, 14, I], [I, I, I, I], [I, I, I, I]]]


@pytest.mark.parametrize("verification", ["faithful", "teacher_forced"])
def test_left_and_right_padding_agree(models, verification):
    """Positions come from the attention mask, so the padding side does not change any block."""
    target, drafter = models
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(11))
    right_mask = torch.ones_like(ids)
    right_mask[1, 8:] = 0
    left_ids = ids.clone()
    left_ids[1] = torch.cat([ids[1, 8:], ids[1, :8]])  # the 4 padding slots move to the front
    left_mask = torch.ones_like(ids)
    left_mask[1, :4] = 0
    anchors = torch.tensor([[2, 6], [1, 5]])
    left_anchors = anchors + torch.tensor([[0], [4]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        right = simulate_retrace_rounds(drafter, target, ids, right_mask, right_mask, anchors, valid, verification)
        left = simulate_retrace_rounds(
            drafter, target, left_ids, left_mask, left_mask, left_anchors, valid, verification
        )
    torch.testing.assert_close(left.first_hidden_states, right.first_hidden_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left.hidden_states, right.hidden_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(left.labels, right.labels)


def test_grouped_drafter_forwards_equal_one_forward(models):
    """`max_blocks_per_forward`: blocks never see each other, so groups of blocks give the same states (and the
    ReTrace round-2 conditioning is sliced with its blocks)."""
    target, drafter = models
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 15:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    anchors, valid = sample_anchor_positions(loss_mask, 7, torch.Generator().manual_seed(0))
    feats = compute_target_features(target, ids, drafter.config.target_layer_ids, attention_mask)
    with torch.no_grad():
        whole = draft_blocks(drafter, target, ids, feats, anchors, valid, attention_mask)
        for group in (1, 3):
            grouped = draft_blocks(
                drafter, target, ids, feats, anchors, valid, attention_mask, max_blocks_per_forward=group
            )
            torch.testing.assert_close(grouped, whole, atol=1e-5, rtol=1e-5)
        rounds = [
            simulate_retrace_rounds(drafter, target, ids, attention_mask, loss_mask, anchors, valid, "teacher_forced",
                                    features=feats, max_blocks_per_forward=group)  # fmt: skip
            for group in (None, 2)
        ]
    assert rounds[0].conditioning.slot_mask.any()
    torch.testing.assert_close(rounds[1].hidden_states, rounds[0].hidden_states, atol=1e-5, rtol=1e-5)


def test_cached_features_replace_the_target(models):
    """With cached features (and teacher-forced verification features) a step never calls the target's decoder,
    and gives the loss of the online step."""
    target, drafter = models
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    feats = compute_target_features(target, ids, drafter.config.target_layer_ids, mask)
    head = TrainingDraftHead.from_lm_head(target.get_output_embeddings(), None)
    loss = LossSettings(head, loss_decay_weights(B, 1.0))
    online = dflash_training_step(drafter, target, ids, mask, loss_mask, num_anchors=5, loss=loss,
                                  generator=torch.Generator().manual_seed(0))  # fmt: skip
    calls = []
    handle = target.get_decoder().register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        cached = dflash_training_step(drafter, target, ids, mask, loss_mask, num_anchors=5, loss=loss,
                                      generator=torch.Generator().manual_seed(0), features=feats)  # fmt: skip
        simulate_retrace_rounds(drafter, target, ids, mask, loss_mask, *sample_anchor_positions(loss_mask, 5),
                                "teacher_forced", features=feats)  # fmt: skip
    finally:
        handle.remove()
    assert calls == []
    torch.testing.assert_close(cached.loss, online.loss)
    assert cached.metrics["supervised_slots"] > 0


def test_block_labels_follow_the_greedy_chain():
    """With `target_ids`, slot k is labelled by the target's greedy token and supervised only while the text so far
    is the greedy chain (the slots greedy verification could reach)."""
    I = IGNORE_INDEX
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    greedy = torch.tensor([[11, 20, 13, 14, 21, 16, I]])  # the text follows the target at 1, 3, 4, 6
    everywhere = torch.ones_like(ids)
    valid = torch.tensor([[True, True, True]])
    labels = block_labels(ids, everywhere, torch.tensor([[0, 2, 4]]), valid, B, target_ids=greedy)
    assert labels.tolist() == [[[I, 11, 20, I], [I, 13, 14, 21], [I, 21, I, I]]]
    # a greedy response (text == chain): the same labels as without target ids
    chain = torch.cat([ids[:, 1:], torch.full((1, 1), I)], dim=1)
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    anchors = torch.tensor([[1, 3, 5]])
    assert torch.equal(
        block_labels(ids, loss_mask, anchors, valid, B, target_ids=chain),
        block_labels(ids, loss_mask, anchors, valid, B),
    )


@pytest.mark.parametrize("architecture", ["qwen3", "llama", "granite"])
@pytest.mark.parametrize("layer_ids", [[1], [2, 0], [0, 3]])
def test_final_states_resume_after_the_deepest_feature_layer(architecture, layer_ids):
    """The distillation teacher: layers after the deepest cached one, fed its features, give the full forward's
    post-norm last state (right-padded rows included: padding never reaches a real position)."""
    scaled = {"embedding_multiplier": 12.0} if architecture == "granite" else {}  # scales inputs_embeds in forward
    target = make_target(architecture, restricted=False, **scaled)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        full = target(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    feats = compute_target_features(target, ids, layer_ids, mask)
    calls = []
    handle = target.get_decoder().layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        final = final_hidden_states(target, ids, mask, feats, layer_ids)
    finally:
        handle.remove()
    assert len(target.get_decoder().layers) == 4 and calls == []  # layer 0 never reruns; the list is restored
    real = mask.bool()
    torch.testing.assert_close(final[real], full[real], atol=1e-5, rtol=1e-5)


def test_distillation_step_uses_the_target_distribution(models):
    """A step with `distillation_weight` adds the soft term to the same block loss (same anchors, same labels), and
    its teacher states come from cached features alone."""
    target, drafter = models
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    mask, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    loss_mask[:, :4] = 0
    feats = compute_target_features(target, ids, drafter.config.target_layer_ids, mask)
    head = TrainingDraftHead.from_lm_head(target.get_output_embeddings(), None)
    plain = dflash_training_step(drafter, target, ids, mask, loss_mask, num_anchors=5, features=feats,
                                 loss=LossSettings(head, loss_decay_weights(B, 1.0)),
                                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    settings = LossSettings(head, loss_decay_weights(B, 1.0), distillation_weight=2.0)
    distilled = dflash_training_step(drafter, target, ids, mask, loss_mask, num_anchors=5, features=feats,
                                     loss=settings, generator=torch.Generator().manual_seed(0))  # fmt: skip
    soft = distilled.metrics["distillation"]
    assert soft > 0
    torch.testing.assert_close(distilled.loss, plain.loss + 2.0 * soft, atol=1e-4, rtol=1e-5)
    assert distilled.metrics["acceptance"] == plain.metrics["acceptance"]


def test_acceptance_shares_add_up_to_the_mean(models):
    """`accepted_ge_k` are the shares of blocks with at least k accepted drafts: with B = 4 (at most 3 drafts) they
    sum exactly to `acceptance`, and fall with k."""
    accepted = torch.tensor([[0, 1, 3, 2], [3, 0, 0, 1]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, True]])
    metrics = acceptance_metrics(accepted, valid)  # valid n: 0, 1, 3, 3, 0, 1 -> mean 8 / 6
    assert metrics["acceptance"] == pytest.approx(8 / 6)
    assert [metrics[f"accepted_ge_{k}"] for k in (1, 2, 3)] == pytest.approx([4 / 6, 2 / 6, 2 / 6])
    target, drafter = models
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    mask, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    head = TrainingDraftHead.from_lm_head(target.get_output_embeddings(), None)
    loss = LossSettings(head, loss_decay_weights(B, 1.0))
    out = dflash_training_step(drafter, target, ids, mask, loss_mask, num_anchors=8, loss=loss,
                               generator=torch.Generator().manual_seed(0)).metrics  # fmt: skip
    shares = [out[f"accepted_ge_{k}"] for k in (1, 2, 3)]
    assert sum(shares) == pytest.approx(out["acceptance"]) and shares == sorted(shares, reverse=True)

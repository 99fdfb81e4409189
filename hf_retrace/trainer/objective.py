# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Block-parallel DFlash training forward and the two-round ReTrace simulation (`docs/training.md`).

Notation (`docs/design.md`, "A cycle"): a block anchored at absolute position `p` has slots `k = 0 .. B-1` at positions `p + k`; slot
0 holds the anchor token `x_p`, slots `1..B-1` the mask token, and slot `k` predicts `x_{p+k}`. Context = target
features of positions `< p`. `N` blocks per sequence run in ONE drafter forward under [`build_block_mask`].

ReTrace step, per round-1 block at `p` (all blocks batched):

1. round 1 (no grad): drafts `d_1..d_{B-1}`, final states `h_0..h_{B-1}`;
2. `n` = leading drafts equal to the labels (greedy acceptance);
3. verification features `v_i` of block position `i` (input `[a, d_1..d_{B-1}][i]` at `p + i`);
4. round 2 (with grad) at `p' = p + n + 1`: next slot `s = 1..L` (`L = B-2-n`) gets `h_{n+1+s}` and `v_{n+s}`,
   exactly as [`build_rejected_trajectory`] aligns them at inference; DFlash loss on round 2.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from ..data import IGNORE_INDEX
from ..data.target_features import compute_target_features, embed_tokens, final_hidden_states, token_positions
from ..models.configuration_retrace import ReTraceDrafterConfig
from ..models.generation_retrace import ReTraceConditioning
from .draft_vocab import TrainingDraftHead
from .losses import count_accepted, expected_accepted_length, slot_log_likelihoods
from .masks import build_block_mask, build_verification_mask, to_additive_mask


VERIFICATION_FEATURES = ("faithful", "teacher_forced")


@dataclass
class LossSettings:
    """How the block loss is computed.

    Attributes:
        head ([`TrainingDraftHead`]): the frozen lm-head rows of the draft vocabulary.
        decay_weights (`torch.Tensor` of shape `(B,)`): [`loss_decay_weights`] of the CE.
        loss_type (`str`): `"ce"` (decayed block CE) or `"eal"` (maximise the expected accepted length, plus
            `eal_ce_weight` x the CE).
        chunk_rows (`int`): rows of draft logits materialised at a time.
        distillation_weight (`float`): weight of the decayed distillation term (the target's next-token distribution
            as a soft label, [`slot_log_likelihoods`]) added to the loss; 0 turns it off.
    """

    head: TrainingDraftHead
    decay_weights: torch.Tensor
    loss_type: str = "ce"
    eal_ce_weight: float = 0.1
    chunk_rows: int = 4096
    distillation_weight: float = 0.0


def block_loss(
    hidden_states: torch.Tensor, labels: torch.LongTensor, settings: LossSettings,
    teacher_states: torch.Tensor | None = None,
):  # fmt: skip
    """The block loss over supervised slots (the lm head never sees unsupervised rows).

    Args:
        hidden_states (`torch.Tensor` of shape `(b, N, B, hidden)`), labels (`torch.LongTensor` of shape
            `(b, N, B)`, target ids, `-100` unsupervised).
        teacher_states (`torch.Tensor` of shape `(b, N, B, hidden)`, *optional*): the target's final state at
            `p + k - 1` for slot `k` ([`slot_teacher_states`]); needed when `settings.distillation_weight > 0`.
    Returns:
        `(loss, drafts, metrics)`: scalar loss; `[b, N, B]` argmax drafts as target ids (`-1` on unsupervised
        slots, for the acceptance metric); `{"out_of_vocab": share of supervised labels outside the draft
        vocabulary, which are never trained on and are always rejections at inference}` (and `"distillation"`, the
        decayed soft cross-entropy, when distilling).
    """
    head = settings.head
    distill = settings.distillation_weight > 0
    if distill and teacher_states is None:
        raise ValueError("distillation_weight > 0 needs the target's final states (`teacher_states`) of the slots.")
    supervised = labels != IGNORE_INDEX  # [b, N, B]
    draft_labels = head.full_to_draft[labels.clamp_min(0)]  # [b, N, B]: row in the draft vocabulary, -1 outside
    in_vocab = supervised & (draft_labels >= 0)
    log_likelihood, argmax, soft = slot_log_likelihoods(
        hidden_states[in_vocab], head.weight, draft_labels[in_vocab], settings.chunk_rows,
        teacher_states=teacher_states[in_vocab] if distill else None,
    )  # fmt: skip  # [M], [M], [M] or None
    weights = settings.decay_weights.to(labels.device).expand(labels.shape)[in_vocab]
    ce = -(log_likelihood * weights).sum() / weights.sum().clamp_min(1e-6)
    if settings.loss_type == "eal":
        grid = log_likelihood.new_zeros(labels.shape).masked_scatter(in_vocab, log_likelihood)  # [b, N, B]
        expected = expected_accepted_length(grid[..., 1:], in_vocab[..., 1:])  # [b, N]
        blocks = supervised[..., 1:].any(dim=-1)
        eal = (expected * blocks).sum() / blocks.sum().clamp_min(1)
        loss = -eal / (labels.shape[-1] - 1) + settings.eal_ce_weight * ce
    else:
        loss = ce
    metrics = {"out_of_vocab": float((supervised & ~in_vocab).sum()) / max(float(supervised.sum()), 1.0)}
    if distill:
        distillation = (soft * weights).sum() / weights.sum().clamp_min(1e-6)
        loss = loss + settings.distillation_weight * distillation
        metrics["distillation"] = distillation.item()
    drafts = torch.full_like(labels, -1)
    drafts[in_vocab] = head.draft_to_full[argmax]
    return loss, drafts, metrics


def slot_teacher_states(final_states: torch.Tensor, anchor_positions: torch.LongTensor, block_size: int):
    """The target's final state that predicts each slot's label: position `p + k - 1` for slot `k` of the block at
    `p` (slot 0's entry, position `p - 1`, is never supervised; clamped into the sequence).

    Args:
        final_states (`torch.Tensor` of shape `(b, T, hidden)`): [`final_hidden_states`] of the sequence.
        anchor_positions (`torch.LongTensor` of shape `(b, N)`).
    Returns:
        `torch.Tensor` of shape `(b, N, B, hidden)`.
    """
    seq_len = final_states.shape[1]
    slots = torch.arange(block_size, device=anchor_positions.device)
    positions = (anchor_positions.unsqueeze(-1) + slots - 1).clamp(0, seq_len - 1).flatten(1)  # [b, N*B]
    states = torch.gather(final_states, 1, positions.unsqueeze(-1).expand(-1, -1, final_states.shape[-1]))
    return states.view(*anchor_positions.shape, block_size, -1)


def sample_anchor_positions(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Samples up to `num_anchors` distinct anchors per sequence among positions `p` with `loss_mask[p]` and
    `loss_mask[p + 1]` (the anchor is a response token and the next token is supervised), sorted ascending.

    Args:
        loss_mask (`torch.Tensor` of shape `(batch, T)`): 1 on response (supervised) tokens.
        generator (`torch.Generator`, *optional*): CPU generator; the sample is a pure function of its state.
    Returns:
        `(anchor_positions, block_valid)`, both `(batch, N)` with `N = min(num_anchors, max candidates)` (>= 1);
        padding entries have anchor 0 and `block_valid` False.
    """
    supervised = loss_mask.bool()
    candidates = (supervised[:, :-1] & supervised[:, 1:]).cpu()  # [b, T-1]: position p is a candidate
    num = int(min(num_anchors, max(int(candidates.sum(dim=1).max()), 1)))
    scores = torch.rand(candidates.shape, generator=generator)  # [b, T-1]
    scores = torch.where(candidates, scores, torch.full_like(scores, 2.0))  # non-candidates sort last
    picked = scores.argsort(dim=1)[:, :num]  # [b, N]
    valid = torch.gather(candidates, 1, picked)
    anchors = torch.where(valid, picked, torch.zeros_like(picked))
    anchors, order = torch.sort(anchors + (~valid) * candidates.shape[1], dim=1)  # valid first, ascending
    valid = torch.gather(valid, 1, order)
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_labels(
    input_ids: torch.LongTensor, loss_mask: torch.Tensor, anchor_positions: torch.LongTensor,
    block_valid: torch.BoolTensor, block_size: int, target_ids: torch.LongTensor | None = None,
) -> torch.LongTensor:  # fmt: skip
    """Labels `[b, N, B]`: slot `k` of the block at `p` is labelled `x_{p+k}`; `-100` for slot 0, positions past the
    sequence, unsupervised positions (`loss_mask` 0) and invalid blocks.

    With `target_ids` (`(b, T)`, the target's greedy token after each position, `-100` where unknown) slot `k` is
    labelled `target_ids[p+k-1]` instead, and kept only while the text follows the greedy chain:
    `x_{p+i} == target_ids[p+i-1]` for `i = 1..k-1`. Those are exactly the slots that greedy verification can reach
    from `p`, so human text (a prompt) supervises what the target would say there; on a greedy response the chain
    always holds and the labels are the response tokens.
    """
    seq_len = input_ids.shape[1]
    slots = torch.arange(block_size, device=input_ids.device)
    positions = anchor_positions.unsqueeze(-1) + slots  # [b, N, B]
    safe = positions.clamp(max=seq_len - 1).flatten(1)  # [b, N*B]
    tokens = torch.gather(input_ids, 1, safe).view(positions.shape)
    supervised = torch.gather(loss_mask.bool(), 1, safe).view(positions.shape)
    keep = supervised & (positions < seq_len) & (slots > 0) & block_valid.unsqueeze(-1)
    if target_ids is not None:
        # greedy[k] = target_ids[p + k - 1] predicts slot k; slot 0's entry is unused (clamped to position p)
        previous = (positions - 1).clamp(min=0, max=seq_len - 1).flatten(1)  # [b, N*B]
        greedy = torch.gather(target_ids, 1, previous).view(positions.shape)
        follows = (tokens == greedy) | (slots == 0)  # slot k's text is the target's greedy token (slot 0 given)
        on_chain = torch.cumprod(follows.long(), dim=-1).bool()  # x_{p+1..p+k} all on the chain
        reachable = torch.cat([on_chain[..., :1], on_chain[..., :-1]], dim=-1)  # slot k needs x_{p+1..p+k-1}
        keep = keep & reachable & (greedy != IGNORE_INDEX)
        tokens = greedy
    return torch.where(keep, tokens, torch.full_like(tokens, IGNORE_INDEX))


def block_noise_ids(
    input_ids: torch.LongTensor, anchor_positions: torch.LongTensor, mask_token_id: int, block_size: int
) -> torch.LongTensor:
    """Block inputs `[b, N*B]`: `[x_p, M, .., M]` per block (the anchor token then `B-1` mask tokens)."""
    anchors = torch.gather(input_ids, 1, anchor_positions.clamp(max=input_ids.shape[1] - 1))  # [b, N]
    ids = torch.full((*anchor_positions.shape, block_size), mask_token_id, device=input_ids.device)
    ids[..., 0] = anchors
    return ids.flatten(1)


def draft_blocks(
    drafter: nn.Module, target: nn.Module, input_ids: torch.LongTensor, context_features: torch.Tensor,
    anchor_positions: torch.LongTensor, block_valid: torch.BoolTensor, context_mask: torch.Tensor | None,
    conditioning: ReTraceConditioning | None = None, max_blocks_per_forward: int | None = None,
    config: ReTraceDrafterConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """Drafter forwards over the `N` blocks of each sequence, `max_blocks_per_forward` blocks at a time.

    A block never sees another block (rule 3 of [`build_block_mask`]), so splitting the `N` blocks into groups changes
    nothing in the result; it bounds the mask at `(n * B, T + n * B)` per row instead of `(N * B, T + N * B)` (for
    the Qwen3-4B recipe, N = 512, B = 16, T = 3072: 92M entries per row) and skips the block-to-block scores that the
    mask would discard anyway. The context projection is recomputed per group (`T` rows, cheap next to `n * B` block
    rows through every layer).

    Args:
        drafter (`nn.Module`): the drafter, possibly wrapped (DDP, PEFT).
        context_features (`torch.Tensor` of shape `(batch, T, K * hidden)`): target features of all positions; the
            block mask shows each block only the ones before its anchor.
        conditioning ([`ReTraceConditioning`] with `N*B` slots, *optional*): round-2 retained suffixes.
        max_blocks_per_forward (`int`, *optional*): blocks per drafter forward; all `N` at once when unset.
        config ([`ReTraceDrafterConfig`], *optional*): the drafter's config (`block_size`, `mask_token_id`,
            `target_layer_ids`); `drafter.config` when unset. A wrapped drafter needs it: the trainer passes
            `accelerator.unwrap_model(model).config` (every step function below takes it too).
    Returns:
        `torch.Tensor` of shape `(batch, N, B, hidden)`: post-norm drafter states.
    """
    config = drafter.config if config is None else config
    batch, seq_len = input_ids.shape
    block_size, num_blocks = config.block_size, anchor_positions.shape[1]
    context_positions = token_positions(context_mask, input_ids.shape).to(input_ids.device)  # [b, T]
    slots = torch.arange(block_size, device=input_ids.device)
    group = max_blocks_per_forward or num_blocks
    outputs = []
    for start in range(0, num_blocks, group):
        anchors, valid = anchor_positions[:, start : start + group], block_valid[:, start : start + group]
        noise_ids = block_noise_ids(input_ids, anchors, config.mask_token_id, block_size)  # [b, n*B]
        anchor_rope = torch.gather(context_positions, 1, anchors.clamp(max=seq_len - 1))  # [b, n]
        block_positions = (anchor_rope.unsqueeze(-1) + slots).flatten(1)  # [b, n*B]: p + k
        out = drafter(
            noise_embeds=embed_tokens(target, noise_ids),
            context_hidden_states=context_features,
            attention_mask=build_block_mask(anchors, valid, seq_len, block_size, context_mask),
            position_ids=torch.cat([context_positions, block_positions], dim=1),
            rejected_trajectory=_slice_conditioning(conditioning, start * block_size, noise_ids.shape[1]),
        )
        outputs.append(out.last_hidden_state.view(batch, -1, block_size, out.last_hidden_state.shape[-1]))
    return torch.cat(outputs, dim=1)


def _slice_conditioning(conditioning: ReTraceConditioning | None, start: int, rows: int):
    if conditioning is None:
        return None
    return ReTraceConditioning(
        hidden_states=conditioning.hidden_states[:, start : start + rows],
        target_features=conditioning.target_features[:, start : start + rows],
        slot_mask=conditioning.slot_mask[:, start : start + rows],
    )


def align_rejected_trajectory(
    draft_hidden_states: torch.Tensor, verification_features: torch.Tensor, num_accepted: torch.LongTensor,
    block_valid: torch.BoolTensor,
) -> ReTraceConditioning:  # fmt: skip
    """Batched [`build_rejected_trajectory`]: round-1 block -> round-2 conditioning, block by block.

    Args:
        draft_hidden_states (`torch.Tensor` of shape `(batch, N, B, hidden)`): round-1 states `h_j`.
        verification_features (`torch.Tensor` of shape `(batch, N, B, F)`): `v_i` of round-1 block position `i`.
        num_accepted (`torch.LongTensor` of shape `(batch, N)`): `n`.
        block_valid (`torch.BoolTensor` of shape `(batch, N)`).
    Returns:
        [`ReTraceConditioning`] with `N*B` slots: next slot `s in 1..L` holds `h_{s+n+1}` and `v_{s+n}` (retained slot
        `j = s+n+1` and its verification position `j-1`); other slots are zero and unmasked. Worked example: `B = 8`,
        `n = 2` -> `L = 4`, slots 1..4 take `h_4..h_7` and `v_3..v_6`.
    """
    block_size = draft_hidden_states.shape[2]
    slots = torch.arange(block_size, device=num_accepted.device)
    source = slots + num_accepted.unsqueeze(-1) + 1  # [b, N, B]: j = s + n + 1
    slot_mask = (slots >= 1) & (source <= block_size - 1) & block_valid.unsqueeze(-1)  # 1 <= s <= L
    hidden = _gather_slots(draft_hidden_states, source.clamp(max=block_size - 1), slot_mask)
    features = _gather_slots(verification_features, (source - 1).clamp(max=block_size - 1), slot_mask)
    return ReTraceConditioning(
        hidden_states=hidden.flatten(1, 2), target_features=features.flatten(1, 2), slot_mask=slot_mask.flatten(1)
    )


def _gather_slots(values: torch.Tensor, index: torch.LongTensor, keep: torch.BoolTensor) -> torch.Tensor:
    """`values[b, i, index[b, i, s]]` where `keep`, zero elsewhere; `values` `[b, N, B, D]`, `index` `[b, N, B]`."""
    out = torch.gather(values, 2, index.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
    return out * keep.unsqueeze(-1).to(out.dtype)


def teacher_forced_verification_features(
    context_features: torch.Tensor, anchor_positions: torch.LongTensor, block_size: int
) -> torch.Tensor:
    """`v_i` = clean target features at `p + i` (the true continuation instead of the drafts): `[b, N, B, F]`."""
    seq_len = context_features.shape[1]
    slots = torch.arange(block_size, device=anchor_positions.device)
    positions = (anchor_positions.unsqueeze(-1) + slots).clamp(max=seq_len - 1).flatten(1)  # [b, N*B]
    feats = torch.gather(context_features, 1, positions.unsqueeze(-1).expand(-1, -1, context_features.shape[-1]))
    return feats.view(*anchor_positions.shape, block_size, -1)


def faithful_verification_features(
    target: nn.Module, layer_ids: list[int], prefix_cache, block_ids: torch.LongTensor,
    anchor_positions: torch.LongTensor, num_accepted: torch.LongTensor, context_mask: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """`v_i` as inference computes them: target features of the drafted block `[a, d_1..d_{B-1}]` on the true prefix.

    Only the rejected tail is run: for `i <= n` the block inputs equal the true tokens, whose keys/values are already
    in `prefix_cache` (the clean forward). Row `r = 0..B-3` of a block is block position `i = n+1+r` (input `d_i` at
    `p + i = p' + r`); it sees the prefix `< p'` and rows `<= r` of its own tail, as the verification pass does.

    Args:
        prefix_cache (`Cache`): target cache of the clean forward over the whole sequence (length `T`).
        block_ids (`torch.LongTensor` of shape `(batch, N, B)`): `[x_p, d_1 .. d_{B-1}]` per block.
        anchor_positions, num_accepted (`torch.LongTensor` of shape `(batch, N)`): `p` and `n`.
        context_mask (`torch.Tensor` of shape `(batch, T)`, *optional*): padding mask of the prefix.
    Returns:
        `torch.Tensor` of shape `(batch, N, B, F)`; filled at `i = n+1 .. B-2`, zero elsewhere (never read).
    """
    batch, num_blocks, block_size = block_ids.shape
    rows = block_size - 2  # longest tail: n = 0 retains B-2 slots
    index = num_accepted.unsqueeze(-1) + 1 + torch.arange(rows, device=block_ids.device)  # [b, N, R]: i
    real = index <= block_size - 2
    tokens = torch.gather(block_ids, 2, index.clamp(max=block_size - 1)).flatten(1)  # [b, N*R]
    seq_len = prefix_cache.get_seq_length()
    prefix_positions = token_positions(context_mask, (batch, seq_len)).to(block_ids.device)  # [b, T]
    anchor_rope = torch.gather(prefix_positions, 1, anchor_positions.clamp(max=seq_len - 1))  # RoPE position of p
    positions = (anchor_rope.unsqueeze(-1) + index).flatten(1)  # [b, N*R]: p + i
    mask = build_verification_mask((anchor_positions.unsqueeze(-1) + index).flatten(1), seq_len, rows, context_mask)
    dtype = target.get_input_embeddings().weight.dtype
    feats = compute_target_features(
        target, tokens, layer_ids, attention_mask=to_additive_mask(mask, dtype), position_ids=positions,
        cache=prefix_cache, use_cache=True,
    )  # fmt: skip
    out = feats.new_zeros(batch, num_blocks, block_size, feats.shape[-1])
    feats = feats.view(batch, num_blocks, rows, -1) * real.unsqueeze(-1)
    return out.scatter(2, index.clamp(max=block_size - 1).unsqueeze(-1).expand_as(feats), feats)


@dataclass
class TrainingStepOutput:
    """Loss of one step and its scalar metrics (plain floats, means over the step's valid blocks)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def dflash_training_step(
    drafter: nn.Module, target: nn.Module, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
    loss_mask: torch.Tensor, *, num_anchors: int, loss: LossSettings, generator: torch.Generator | None = None,
    features: torch.Tensor | None = None, max_blocks_per_forward: int | None = None,
    config: ReTraceDrafterConfig | None = None, target_ids: torch.LongTensor | None = None,
) -> TrainingStepOutput:  # fmt: skip
    """The DFlash objective: drafter forwards over `N` sampled blocks per sequence, then the block loss.

    Args:
        input_ids, attention_mask, loss_mask (`torch.Tensor` of shape `(batch, T)`): right-padded batch.
        target_ids (`torch.LongTensor` of shape `(batch, T)`, *optional*): the target's greedy chain labels of
            [`block_labels`] (for anchors in prompts).
        loss ([`LossSettings`]): draft head, decay weights and loss type.
        features (`torch.Tensor` of shape `(batch, T, K * hidden)`, *optional*): cached target features of the
            drafter's `target_layer_ids`; computed by the target here when unset (online mode).
    """
    config = drafter.config if config is None else config
    if features is None:
        positions = token_positions(attention_mask, input_ids.shape)
        features = compute_target_features(target, input_ids, config.target_layer_ids, attention_mask, positions)
    anchors, valid = sample_anchor_positions(loss_mask, num_anchors, generator)
    labels = block_labels(input_ids, loss_mask, anchors, valid, config.block_size, target_ids)
    hidden = draft_blocks(
        drafter, target, input_ids, features, anchors, valid, attention_mask,
        max_blocks_per_forward=max_blocks_per_forward, config=config,
    )  # fmt: skip
    teacher = None
    if loss.distillation_weight > 0:
        final = final_hidden_states(target, input_ids, attention_mask, features, config.target_layer_ids)
        teacher = slot_teacher_states(final, anchors, config.block_size)
    value, drafts, extra = block_loss(hidden, labels, loss, teacher)
    accepted = count_accepted(drafts[..., 1:], labels[..., 1:])
    metrics = {"loss": value.item(), **acceptance_metrics(accepted, valid), "blocks": float(valid.sum())}
    metrics["supervised_slots"] = float((labels != IGNORE_INDEX).sum())
    return TrainingStepOutput(loss=value, metrics=metrics | extra)


@dataclass
class SimulatedRounds:
    """The two simulated rounds of a ReTrace step, all `[b, N, ...]` per round-1 block.

    Attributes:
        first_hidden_states (`torch.Tensor` of shape `(b, N, B, hidden)`): round-1 states (no grad).
        num_accepted (`torch.LongTensor` of shape `(b, N)`): `n` of round 1 (0 for invalid blocks).
        anchor_positions (`torch.LongTensor` of shape `(b, N)`): round-2 anchors `p' = p + n + 1`.
        block_valid (`torch.BoolTensor` of shape `(b, N)`): round-2 blocks that exist (`p'` is a real token).
        labels (`torch.LongTensor` of shape `(b, N, B)`): round-2 labels.
        conditioning ([`ReTraceConditioning`] with `N*B` slots): what round 2 was conditioned on.
        hidden_states (`torch.Tensor` of shape `(b, N, B, hidden)`): round-2 states (with grad).
    """

    first_hidden_states: torch.Tensor
    num_accepted: torch.LongTensor
    anchor_positions: torch.LongTensor
    block_valid: torch.BoolTensor
    labels: torch.LongTensor
    conditioning: ReTraceConditioning
    hidden_states: torch.Tensor

    @property
    def num_retained(self) -> torch.LongTensor:
        """`L = B - 2 - n` per round-2 block, 0 when negative or the block is invalid."""
        block_size = self.labels.shape[-1]
        return (block_size - 2 - self.num_accepted).clamp_min(0) * self.block_valid


def simulate_retrace_rounds(
    drafter: nn.Module, target: nn.Module, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
    loss_mask: torch.Tensor, anchor_positions: torch.LongTensor, block_valid: torch.BoolTensor,
    verification_features: str = "faithful", draft_head: TrainingDraftHead | None = None,
    features: torch.Tensor | None = None, max_blocks_per_forward: int | None = None,
    config: ReTraceDrafterConfig | None = None,
) -> SimulatedRounds:  # fmt: skip
    """Round 1 (no grad) at the given anchors, then round 2 (with grad) conditioned on round 1's rejected suffix.

    One clean target forward serves both rounds (context features of positions `< p'` are the same for the true
    prefix) and, with `"faithful"`, its cache is the prefix of the extra forward over the drafted tails. With
    cached `features` and `"teacher_forced"` verification features the target is not run at all. Round-1 drafts are
    the argmax over `draft_head` (the reduced draft vocabulary when the drafter has one), as at inference.
    """
    if verification_features not in VERIFICATION_FEATURES:
        raise ValueError(
            f"verification_features must be one of {VERIFICATION_FEATURES}, got {verification_features!r}"
        )
    config = drafter.config if config is None else config
    block_size, layer_ids = config.block_size, config.target_layer_ids
    faithful = verification_features == "faithful"
    cache = DynamicCache(config=target.config) if faithful else None
    if features is None or faithful:  # faithful needs the clean forward's cache as the prefix of the tails
        positions = token_positions(attention_mask, input_ids.shape)
        features = compute_target_features(
            target, input_ids, layer_ids, attention_mask, positions, cache=cache, use_cache=faithful
        )
    if draft_head is None:
        draft_head = TrainingDraftHead.from_lm_head(target.get_output_embeddings(), None)
    chunk = dict(max_blocks_per_forward=max_blocks_per_forward, config=config)
    labels = block_labels(input_ids, loss_mask, anchor_positions, block_valid, block_size)
    with torch.no_grad():  # round 1: "training detaches cached representations across rounds" (paper Sec. 3)
        first = draft_blocks(
            drafter, target, input_ids, features, anchor_positions, block_valid, attention_mask, **chunk
        )
        drafts = draft_head.greedy_ids(first[:, :, 1:])  # [b, N, B-1]: d_1..d_{B-1}
    accepted = count_accepted(drafts, labels[..., 1:]) * block_valid  # n
    next_anchors = anchor_positions + accepted + 1  # p' = p + n + 1: the target's correction anchors round 2
    next_valid = block_valid & _is_real_position(next_anchors, attention_mask)
    if faithful:
        anchor_ids = torch.gather(input_ids, 1, anchor_positions).unsqueeze(-1)
        block_ids = torch.cat([anchor_ids, drafts], dim=-1)  # [b, N, B]: [a, d_1 .. d_{B-1}]
        verification = faithful_verification_features(
            target, layer_ids, cache, block_ids, anchor_positions, accepted, attention_mask
        )
    else:
        verification = teacher_forced_verification_features(features, anchor_positions, block_size)
    conditioning = align_rejected_trajectory(first, verification, accepted, next_valid)
    next_labels = block_labels(input_ids, loss_mask, next_anchors, next_valid, block_size)
    hidden = draft_blocks(
        drafter, target, input_ids, features, next_anchors, next_valid, attention_mask, conditioning, **chunk
    )
    return SimulatedRounds(first, accepted, next_anchors, next_valid, next_labels, conditioning, hidden)


def retrace_training_step(
    drafter: nn.Module, target: nn.Module, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
    loss_mask: torch.Tensor, *, num_anchors: int, loss: LossSettings, verification_features: str = "faithful",
    generator: torch.Generator | None = None, features: torch.Tensor | None = None,
    max_blocks_per_forward: int | None = None, config: ReTraceDrafterConfig | None = None,
) -> TrainingStepOutput:  # fmt: skip
    """The ReTrace objective: [`simulate_retrace_rounds`] at sampled anchors, DFlash loss on round 2 (module
    docstring). Round-2 blocks with `L <= 0` train as plain DFlash blocks at `p'`.

    Args:
        verification_features (`str`): `"faithful"` (target features of the drafted block, one extra target forward
            over the rejected tails) or `"teacher_forced"` (clean features of the true continuation, free).
    """
    anchors, valid = sample_anchor_positions(loss_mask, num_anchors, generator)
    rounds = simulate_retrace_rounds(
        drafter, target, input_ids, attention_mask, loss_mask, anchors, valid, verification_features,
        draft_head=loss.head, features=features, max_blocks_per_forward=max_blocks_per_forward, config=config,
    )  # fmt: skip
    value, drafts, extra = block_loss(rounds.hidden_states, rounds.labels, loss)
    retained = rounds.num_retained
    metrics = extra | {
        "loss": value.item(),
        **acceptance_metrics(count_accepted(drafts[..., 1:], rounds.labels[..., 1:]), rounds.block_valid),
        "round1_acceptance": _masked_mean(rounds.num_accepted, valid),
        "conditioned_share": _masked_mean(retained > 0, rounds.block_valid),
        "mean_retained": _masked_mean(retained, retained > 0),
        "blocks": float(rounds.block_valid.sum()),
        "supervised_slots": float((rounds.labels != IGNORE_INDEX).sum()),
    }
    return TrainingStepOutput(loss=value, metrics=metrics)


def _is_real_position(positions: torch.LongTensor, attention_mask: torch.Tensor | None) -> torch.BoolTensor:
    """Whether each `[b, N]` position holds a real (non-padding) token of its sequence."""
    seq_len = attention_mask.shape[1]
    inside = positions < seq_len
    real = torch.gather(attention_mask.bool(), 1, positions.clamp(max=seq_len - 1))
    return inside & real


def acceptance_metrics(accepted: torch.LongTensor, valid: torch.BoolTensor, depths: int = 3) -> dict[str, float]:
    """`acceptance`, the mean accepted drafts `n` per valid block, and `accepted_ge_k` for `k = 1..depths`, the share
    of blocks with `n >= k` (slot `k`'s draft and all before it right). `acceptance = sum_k accepted_ge_k` over all
    `k <= B - 1`, so the shares say which slots the mean comes from: a steep fall from `accepted_ge_1` to
    `accepted_ge_2` means the later slots of a block are rarely reached.

    Args:
        accepted (`torch.LongTensor` of shape `(b, N)`): [`count_accepted`] per block; valid (`(b, N)`).
    """
    metrics = {"acceptance": _masked_mean(accepted, valid)}
    metrics.update({f"accepted_ge_{k}": _masked_mean(accepted >= k, valid) for k in range(1, depths + 1)})
    return metrics


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.bool()
    return float(values[mask].float().mean()) if mask.any() else 0.0


__all__ = [
    "VERIFICATION_FEATURES",
    "LossSettings",
    "acceptance_metrics",
    "block_loss",
    "SimulatedRounds",
    "TrainingStepOutput",
    "align_rejected_trajectory",
    "block_labels",
    "block_noise_ids",
    "dflash_training_step",
    "draft_blocks",
    "faithful_verification_features",
    "retrace_training_step",
    "sample_anchor_positions",
    "simulate_retrace_rounds",
    "slot_teacher_states",
    "teacher_forced_verification_features",
]

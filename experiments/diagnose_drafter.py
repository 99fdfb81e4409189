"""Collapse diagnostics of a SmolLM2 drafter (the figures behind `anchor_broadcast` / `loss_decay_gamma`).

    python experiments/diagnose_drafter.py runs/v2/dflash-plain/checkpoint-250 [--data data_cache/phase2]

Prints, for the drafter in `retrace_mode="off"` on the default target:
1. a bigram baseline: slot-1 accuracy of "most frequent successor of the anchor token", fitted on the first 520
   responses of the pool and scored on the rest (what a drafter that reads its anchor should at least reach);
2. per-slot accuracy (slots 1..5) and the number of distinct slot-1 predictions on 8 training sequences, 64 anchors
   each, through the training forward (`draft_blocks`);
3. sensitivity of slot-1 logits to the anchor token and to the context (mean |delta logit| vs mean |logit|);
4. slot-1 attention mass per layer on the block rows, on the anchor and on the last context position.
"""

import argparse
from collections import Counter, defaultdict

import torch
from datasets import load_from_disk

from hf_retrace.data.responses import DataCollatorForReTrace, tokenize_conversations
from hf_retrace.models.modeling_retrace import ReTraceDrafterModel, apply_rotary_pos_emb
from hf_retrace.data.target_features import compute_target_features, embed_tokens
from hf_retrace.trainer.objective import block_labels, draft_blocks, sample_anchor_positions, token_positions
from hf_retrace.trainer.setup import load_target


TEXT = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell? Natalia sold 48 clips in"


def bigram_accuracy(responses: list[list[int]], num_fit: int = 520) -> float:
    successors = defaultdict(Counter)
    for ids in responses[:num_fit]:
        for a, b in zip(ids, ids[1:]):
            successors[a][b] += 1
    pairs = [(a, b) for ids in responses[num_fit:] for a, b in zip(ids, ids[1:])]
    hits = sum(1 for a, b in pairs if successors.get(a) and successors[a].most_common(1)[0][0] == b)
    return hits / len(pairs)


@torch.no_grad()
def slot_accuracy(drafter, target, tokenizer, data, num_rows: int = 8, num_anchors: int = 64):
    rows = tokenize_conversations(data.select(range(num_rows)), tokenizer, 768)
    batch = DataCollatorForReTrace(pad_token_id=tokenizer.pad_token_id or 0)([rows[i] for i in range(num_rows)])
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    positions = token_positions(mask, ids.shape)
    feats = compute_target_features(target, ids, drafter.config.target_layer_ids, mask, positions)
    anchors, valid = sample_anchor_positions(loss_mask, num_anchors, torch.Generator().manual_seed(0))
    labels = block_labels(ids, loss_mask, anchors, valid, drafter.config.block_size)
    drafts = target.get_output_embeddings()(draft_blocks(drafter, target, ids, feats, anchors, valid, mask)).argmax(-1)
    supervised = labels != -100
    for k in range(1, 6):
        hits = ((drafts[..., k] == labels[..., k]) & supervised[..., k]).sum() / supervised[..., k].sum()
        print(f"  slot {k} accuracy {hits:.3f}")
    print(f"  distinct slot-1 predictions: {drafts[..., 1][supervised[..., 1]].unique().numel()} "
          f"over {int(supervised[..., 1].sum())} blocks")  # fmt: skip


@torch.no_grad()
def block_inputs(drafter, target, tokenizer):
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    p = ids.shape[1] - 1  # anchor: the last token; context: positions < p
    feats = compute_target_features(target, ids, drafter.config.target_layer_ids)[:, :p]
    noise = torch.tensor([[int(ids[0, p])] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1)])
    return noise, feats


@torch.no_grad()
def slot1_logits(drafter, target, noise, feats):
    positions = torch.arange(feats.shape[1] + noise.shape[1]).unsqueeze(0)
    out = drafter(noise_embeds=embed_tokens(target, noise), context_hidden_states=feats, position_ids=positions)
    return target.get_output_embeddings()(out.last_hidden_state[0, 1])


@torch.no_grad()
def sensitivity(drafter, target, tokenizer, noise, feats):
    base = slot1_logits(drafter, target, noise, feats)
    other = noise.clone()
    other[0, 0] = tokenizer(" May").input_ids[0]
    anchor = (slot1_logits(drafter, target, other, feats) - base).abs().mean()
    context = (slot1_logits(drafter, target, noise, feats * 0) - base).abs().mean()
    print(f"  mean |dlogit|: anchor changed {anchor:.3f}, context zeroed {context:.3f}; "
          f"mean |logit| {base.abs().mean():.3f}")


@torch.no_grad()
def attention_mass(drafter, target, noise, feats):
    context = drafter.project_context(feats)
    T, B = context.shape[1], noise.shape[1]
    hidden = embed_tokens(target, noise).to(context.dtype)
    if drafter.anchor_broadcast is not None:
        hidden = drafter.anchor_broadcast(hidden)
    rope = drafter.rotary_emb(hidden, torch.arange(T + B).unsqueeze(0))
    for i, layer in enumerate(drafter.layers):
        attn, x = layer.self_attn, layer.input_layernorm(hidden)
        kv = torch.cat([context, x], dim=1)
        q = attn.q_norm(attn.q_proj(x).view(1, B, -1, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(kv).view(1, T + B, -1, attn.head_dim)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        k = k.repeat_interleave(attn.num_key_value_groups, dim=1)
        weights = (q @ k.transpose(-1, -2) * attn.scaling).softmax(-1)[0, :, 1]  # [heads, T+B]: slot 1's row
        print(f"  layer {i}: slot-1 attention on block rows {weights[:, T:].sum(-1).mean():.3f}, on the anchor "
              f"{weights[:, T].mean():.4f}, on the last context position {weights[:, T - 1].mean():.3f} "
              f"(T={T})")  # fmt: skip
        hidden = layer(hidden, context, rope)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter")
    parser.add_argument("--data", default="data_cache/phase2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_target("default", "float32")
    drafter = ReTraceDrafterModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    drafter.set_retrace_mode("off")
    data = load_from_disk(args.data)
    print(f"bigram baseline, held-out slot-1 accuracy: {bigram_accuracy(data['response_ids']):.3f}")
    print(f"drafter {args.drafter}:")
    slot_accuracy(drafter, target, tokenizer, data)
    noise, feats = block_inputs(drafter, target, tokenizer)
    sensitivity(drafter, target, tokenizer, noise, feats)
    attention_mass(drafter, target, noise, feats)


if __name__ == "__main__":
    main()

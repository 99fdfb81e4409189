"""Greedy DFlash cycles replayed offline: the bench's tau from one target forward per prompt, no decoding loop.

Under greedy verification a DFlash cycle anchored at position `p` (its anchor is the last committed token `x_p`) sees
exactly: the target features of positions `< p` and the block `[x_p, mask, ..., mask]` at positions `p .. p+B-1`.
Everything it needs is therefore in ONE target forward over the prompt and the target's greedy continuation:

1. `a_p` = leading drafts `d_1 .. d_{B-1}` of the block at `p` equal to `x_{p+1} .. x_{p+B-1}`, for every response
   position `p` ([`anchor_acceptance`]);
2. the cycles greedy decoding actually runs are a walk over those anchors: the first anchor is the prefill's token
   at `P` (the prompt length), a cycle at `p` commits `a_p + 1` tokens (bonus included), the next anchor is
   `p + a_p + 1` ([`replay_cycles`]).

The walk reproduces `drafter.last_generation_stats.acceptance_lengths` (tested on tiny models, exact), and on the
real target it agrees with the bench up to fp32 rounding differences between one full forward and the verification
forwards. Two things follow. A drafter is scored on the bench's prompts in a fraction of the bench's time. And the
mean of `a_p` over all anchors (what the trainer's `eval_acceptance` estimates with random anchors) overstates the
per-cycle mean: a cycle starts right after a rejection, so easy stretches are crossed in few cycles and hard ones in
many; `ReplayResult` reports both.
"""

from dataclasses import dataclass, field

import torch

from ..models.generation_retrace import draft_lm_head


@torch.no_grad()
def target_features(target, input_ids: torch.LongTensor, layer_ids: list[int]) -> torch.Tensor:
    """`[1, T, len(layer_ids) * H]`: the concatenated outputs of target layers `layer_ids` (0-based), as the
    candidate generator reads them (`hidden_states[i + 1]`)."""
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def anchor_acceptance(target, drafter, input_ids: torch.LongTensor, prompt_length: int) -> list[int]:
    """Greedy acceptance `a_p` of the DFlash block anchored at every response position.

    Args:
        target (`PreTrainedModel`): the target (its embeddings, lm head and features).
        drafter ([`ReTraceDrafterModel`]): run with its own block size, mask token, draft vocabulary and
            `draft_logits_dtype`, as in generation; ReTrace conditioning is not replayed (it depends on past drafts).
        input_ids (`torch.LongTensor` of shape `(1, T)`): prompt, then the target's greedy continuation.
        prompt_length (`int`): `P`; the first anchor is the token at `P` (the one the prefill produced).
    Returns:
        `list[int]` of length `T - 1 - P`: entry `i` is `a_{P+i}` in `0 .. min(B-1, T-2-P-i)` (labels end at `T`).
    """
    config = drafter.config
    block = config.block_size
    features = target_features(target, input_ids, config.target_layer_ids).to(drafter.dtype)  # [1, T, F]
    embed = target.get_input_embeddings()
    head = draft_lm_head(target.get_output_embeddings(), config.draft_logits_dtype, drafter.draft_vocab_ids)
    ids = input_ids[0].tolist()
    acceptance = []
    for p in range(prompt_length, len(ids) - 1):
        slots = torch.full((1, block), config.mask_token_id, dtype=torch.long, device=input_ids.device)
        slots[0, 0] = ids[p]
        states = drafter(embed(slots), features[:, :p]).last_hidden_state  # [1, B, H], positions 0 .. p+B-1
        drafts = head(states[:, 1:]).argmax(dim=-1)[0].tolist()  # d_1 .. d_{B-1}
        accepted = 0
        for draft, label in zip(drafts, ids[p + 1 :]):  # zip stops at the sequence end
            if draft != label:
                break
            accepted += 1
        acceptance.append(accepted)
    return acceptance


def replay_cycles(acceptance: list[int], num_assistant_tokens: int | None = None) -> list[int]:
    """The committed length `a_p + 1` of each cycle greedy decoding runs, walking from the first anchor.

    `acceptance[i]` is `a_{P+i}`; the sequence has `len(acceptance) + 1` new tokens, the first from the prefill. As
    in transformers' assisted decoding, a cycle commits at most the tokens still missing (its bonus included), and
    when exactly one is missing the target takes a plain step, which is not a drafted cycle. `num_assistant_tokens`
    replays generation that verifies only the first k drafts of each block (`a_p` capped at k): the drafter still
    runs its full block, so those k drafts are the ones `acceptance` scored.
    """
    cap = num_assistant_tokens if num_assistant_tokens is not None else len(acceptance)
    lengths, position = [], 0
    while position < len(acceptance) - 1:  # with one token left, generation takes a plain target step, no draft
        committed = min(acceptance[position], cap, len(acceptance) - position - 1) + 1
        lengths.append(committed)
        position += committed
    return lengths


@dataclass
class ReplayResult:
    """Per prompt: `acceptance` (`a_p` at every anchor) and `cycles` (committed lengths of the replayed cycles, each
    verifying at most `num_assistant_tokens` drafts; `None`: the whole block)."""

    acceptance: list[list[int]] = field(default_factory=list)
    cycles: list[list[int]] = field(default_factory=list)
    num_assistant_tokens: int | None = None

    @property
    def tau(self) -> float:
        """Pooled over cycles, as the bench: committed tokens / cycles."""
        return sum(map(sum, self.cycles)) / max(sum(map(len, self.cycles)), 1)

    @property
    def anchor_mean(self) -> float:
        """`1 +` the mean of `a_p` over every anchor: what uniformly sampled anchors estimate."""
        values = [a for row in self.acceptance for a in row]
        return 1 + sum(values) / max(len(values), 1)

    def add(self, acceptance: list[int]) -> None:
        self.acceptance.append(acceptance)
        self.cycles.append(replay_cycles(acceptance, self.num_assistant_tokens))


__all__ = ["ReplayResult", "anchor_acceptance", "replay_cycles", "target_features"]

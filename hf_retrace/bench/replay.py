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

import types
from dataclasses import dataclass, field

import torch

from ..models.draft_head_retrace import draft_lm_head
from ..models.policy_settings_retrace import DECODING_DEFAULTS
from ..models.sources_retrace import CandidateSource, candidate_sources, propose_from_sources


_UNCAPPED = 1 << 30  # the replay caps proposals at the sequence end itself (`_walk`), as generation's room does


@torch.no_grad()
def target_features(target, input_ids: torch.LongTensor, layer_ids: list[int]) -> torch.Tensor:
    """`[1, T, len(layer_ids) * H]`: the concatenated outputs of target layers `layer_ids` (0-based), as the
    candidate generator reads them (`hidden_states[i + 1]`)."""
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@dataclass
class AnchorScores:
    """Per response anchor `p`: `acceptance` (`a_p`) and `confidence` (the drafter's top-1 probability at each of the
    block's `B-1` slots, what `assistant_confidence_threshold` reads)."""

    acceptance: list[int] = field(default_factory=list)
    confidence: list[list[float]] = field(default_factory=list)

    def proposed(self, threshold: float) -> list[int]:
        """Drafts a cycle at each anchor proposes under a confidence stop: its leading slots at or above `threshold`
        (all `B-1` for `threshold = 0`)."""
        return [next((j for j, c in enumerate(slots) if c < threshold), len(slots)) for slots in self.confidence]


@torch.no_grad()
def anchor_scores(target, drafter, input_ids: torch.LongTensor, prompt_length: int) -> AnchorScores:
    """Greedy acceptance `a_p` and slot confidences of the DFlash block anchored at every response position.

    Args:
        target (`PreTrainedModel`): the target (its embeddings, lm head and features).
        drafter ([`ReTraceDrafterModel`]): run with its own block size, mask token, draft vocabulary and
            `draft_logits_dtype`, as in generation; ReTrace conditioning is not replayed (it depends on past drafts).
        input_ids (`torch.LongTensor` of shape `(1, T)`): prompt, then the target's greedy continuation.
        prompt_length (`int`): `P`; the first anchor is the token at `P` (the one the prefill produced).
    Returns:
        [`AnchorScores`] of `T - 1 - P` anchors: `acceptance[i]` is `a_{P+i}` in `0 .. min(B-1, T-2-P-i)` (labels
        end at `T`).
    """
    config = drafter.config
    block = config.block_size
    features = target_features(target, input_ids, config.target_layer_ids).to(drafter.dtype)  # [1, T, F]
    embed = target.get_input_embeddings()
    head = draft_lm_head(
        target.get_output_embeddings(), drafter.generation_config.draft_logits_dtype, drafter.draft_vocab_ids
    )
    ids = input_ids[0].tolist()
    scores = AnchorScores()
    for p in range(prompt_length, len(ids) - 1):
        slots = torch.full((1, block), config.mask_token_id, dtype=torch.long, device=input_ids.device)
        slots[0, 0] = ids[p]
        states = drafter(embed(slots), features[:, :p]).last_hidden_state  # [1, B, H], positions 0 .. p+B-1
        confidence, drafts = head(states[:, 1:]).float().softmax(-1).max(dim=-1)  # [1, B-1] each: slots 1 .. B-1
        scores.acceptance.append(_leading_matches(drafts[0].tolist(), ids[p + 1 :]))
        scores.confidence.append(confidence[0].tolist())
    return scores


def _leading_matches(proposed: list[int], labels: list[int]) -> int:
    """How many leading `proposed` tokens equal `labels` (greedy acceptance; stops at the shorter list)."""
    accepted = 0
    for token, label in zip(proposed, labels):
        if token != label:
            break
        accepted += 1
    return accepted


def anchor_acceptance(target, drafter, input_ids: torch.LongTensor, prompt_length: int) -> list[int]:
    """`a_p` at every response anchor: [`anchor_scores`] without the confidences."""
    return anchor_scores(target, drafter, input_ids, prompt_length).acceptance


def source_acceptance(
    input_ids: torch.LongTensor, prompt_length: int, sources: list[CandidateSource]
) -> list[tuple[int, int] | None]:
    """The candidate sources in front of the drafter, at every response anchor: what the first of `sources` (in
    registry order, as generation asks them; e.g. `candidate_sources(drafter.decoding_settings(), drafter)`)
    proposes there from the committed tokens `x_0 .. x_p`, as `(candidates m, accepted)` (the leading candidates
    equal to `x_{p+1} ..`), or `None` where no source proposes and the drafter drafts.

    Args:
        input_ids (`torch.LongTensor` of shape `(1, T)`): prompt, then the target's greedy continuation.
        prompt_length (`int`): `P`; anchors are `P .. T-2`, as in [`anchor_scores`].
        sources (`list[CandidateSource]`): the sources turned on, in the order a cycle asks them.
    """
    tokens = input_ids[0].cpu().numpy()
    out = []
    for p in range(prompt_length, tokens.shape[0] - 1):
        _, candidates = propose_from_sources(sources, tokens[: p + 1], _UNCAPPED)
        if candidates is None:
            out.append(None)
            continue
        out.append((len(candidates), _leading_matches(candidates, tokens[p + 1 :].tolist())))
    return out


def lookup_acceptance(
    input_ids: torch.LongTensor,
    prompt_length: int,
    num_tokens: int | None,
    max_ngram_size: int = 3,
    min_ngram_size: int = 2,
    datastore=None,
) -> list[tuple[int, int] | None]:
    """[`source_acceptance`] of prompt lookup (`prompt_lookup_num_tokens = num_tokens`, `None` turns it off, with
    n-grams `max_ngram_size` down to `min_ngram_size`) and, with `datastore` (an [`NgramDatastore`], e.g.
    `drafter.datastore(...)`), datastore lookup, asked in the registry's order as generation asks them."""
    settings = types.SimpleNamespace(**{
        **DECODING_DEFAULTS, "prompt_lookup_num_tokens": num_tokens, "max_matching_ngram_size": max_ngram_size,
        "prompt_lookup_min_ngram_size": min_ngram_size,
        "datastore_num_tokens": None if datastore is None else datastore.num_tokens,
    })  # fmt: skip
    resources = types.SimpleNamespace(datastore=lambda *sizes: datastore)
    return source_acceptance(input_ids, prompt_length, candidate_sources(settings, resources))


def replay_cycles(
    acceptance: list[int],
    num_assistant_tokens: int | None = None,
    proposed: list[int] | None = None,
    lookups: list[tuple[int, int] | None] | None = None,
) -> list[int]:
    """The committed length `a_p + 1` of each cycle greedy decoding runs, walking from the first anchor.

    `acceptance[i]` is `a_{P+i}`; the sequence has `len(acceptance) + 1` new tokens, the first from the prefill. As
    in transformers' assisted decoding, a cycle commits at most the tokens still missing (its bonus included), and
    when exactly one is missing the target takes a plain step, which is not a drafted cycle. `num_assistant_tokens`
    replays generation that verifies only the first k drafts of each block, and `proposed[i]` (from
    [`AnchorScores.proposed`]) the drafts a confidence stop leaves at anchor `i`: `a_p` is capped by both, since the
    drafter still runs its full block and the drafts it proposes are the ones `acceptance` scored. `lookups[i]`
    (from [`source_acceptance`]) replays the candidate sources in front of the drafter: where it is not `None`, the
    cycle verifies those candidates instead of drafts.
    """
    return [committed for _, committed in _walk(acceptance, num_assistant_tokens, proposed, lookups)]


def _walk(acceptance: list[int], num_assistant_tokens: int | None, proposed: list[int] | None, lookups=None):
    """Yields `(drafts verified, tokens committed)` per replayed cycle; see [`replay_cycles`]. The drafts verified
    are not capped by the sequence end (transformers verifies the whole proposal and crops after), and are `None`
    when neither a cap nor `proposed` says how many there were."""
    position = 0
    while position < len(acceptance) - 1:  # with one token left, generation takes a plain target step, no draft
        missing = len(acceptance) - position - 1
        if lookups is not None and lookups[position] is not None:
            # generation caps the candidates at the tokens still missing before `max_length`: exact for sequences
            # that end there, as the bench's do
            candidates, accepted = lookups[position]
            yield min(candidates, missing), min(accepted, missing) + 1
            position += min(accepted, missing) + 1
            continue
        limits = [num_assistant_tokens] if num_assistant_tokens is not None else []
        limits += [proposed[position]] if proposed is not None else []
        drafts = min(limits) if limits else None
        committed = min(acceptance[position], len(acceptance) - position - 1, *limits) + 1
        yield drafts, committed
        position += committed


@dataclass
class ReplayResult:
    """Per prompt: `acceptance` (`a_p` at every anchor), `cycles` (committed lengths of the replayed cycles) and
    `verified` (tokens of each cycle's verification forward), each cycle verifying at most `num_assistant_tokens`
    drafts and, with `assistant_confidence_threshold`, only its confident ones (`None`: no such limit)."""

    acceptance: list[list[int]] = field(default_factory=list)
    cycles: list[list[int]] = field(default_factory=list)
    verified: list[list[int]] = field(default_factory=list)
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None

    @property
    def tau(self) -> float:
        """Pooled over cycles, as the bench: committed tokens / cycles."""
        return sum(map(sum, self.cycles)) / max(sum(map(len, self.cycles)), 1)

    @property
    def anchor_mean(self) -> float:
        """`1 +` the mean of `a_p` over every anchor: what uniformly sampled anchors estimate."""
        values = [a for row in self.acceptance for a in row]
        return 1 + sum(values) / max(len(values), 1)

    @property
    def mean_verified(self) -> float:
        """Mean tokens per verification forward (the anchor and the proposed drafts): what sets a cycle's cost."""
        return sum(map(sum, self.verified)) / max(sum(map(len, self.verified)), 1)

    def add(self, scores: "AnchorScores | list[int]", lookups: list[tuple[int, int] | None] | None = None) -> None:
        """Adds one prompt: its [`AnchorScores`], or its bare acceptance when there is no confidence stop, and with
        `lookups` ([`source_acceptance`]) the candidate sources in front of the drafter."""
        threshold = self.assistant_confidence_threshold
        if isinstance(scores, AnchorScores):
            acceptance = scores.acceptance
            # without a confidence stop every anchor proposes its whole block (B-1 drafts), up to num_assistant_tokens
            proposed = scores.proposed(threshold if threshold is not None else 0.0)
        elif threshold is None:
            acceptance, proposed = scores, None
        else:
            raise ValueError("a confidence stop needs the slot confidences: pass anchor_scores(...), not acceptance")
        walk = list(_walk(acceptance, self.num_assistant_tokens, proposed, lookups))
        self.acceptance.append(acceptance)
        self.cycles.append([committed for _, committed in walk])
        self.verified.append([drafts + 1 for drafts, _ in walk if drafts is not None])


__all__ = [
    "AnchorScores", "ReplayResult", "anchor_acceptance", "anchor_scores", "lookup_acceptance", "replay_cycles",
    "source_acceptance", "target_features",
]  # fmt: skip

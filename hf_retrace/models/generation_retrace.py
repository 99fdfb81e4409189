# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch and transformers only, so `trust_remote_code=True` loads it. `modeling_retrace` imports
# this file (for `ReTraceConditioning`), so loading the drafter, from the package or as remote code, installs the hook.
"""ReTrace speculative decoding on top of transformers' in-tree DFlash candidate generator.

Round r drafts the block `[a, d1 .. d_{B-1}]` at positions `p .. p+B-1`; the target accepts `d1..dn` and commits
its correction `c` at `p+n+1`, the next anchor. ReTrace keeps the drafter states of slots `j = n+2 .. B-1`
(`L = B-2-n` of them) and feeds them to the next round's mask slots `1 .. L` (same absolute positions), together
with the target features of verification position `j-1`, the one that scored draft `d_j` (DESIGN §1.1).
"""

import functools
import importlib
import re
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import transformers
from torch import nn
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
from transformers.generation.utils import GenerationMixin


SUPPORTED_TRANSFORMERS = ((5, 24), (6, 0))  # [min, max) as (major, minor)


@dataclass
class ReTraceConditioning:
    """The previous round's rejected suffix, aligned slot by slot with the next draft block.

    Two layouts. At inference the conditioned slots are always `1 .. L` with `L` known on the host, so the tensors
    hold just those `L` slots and `slot_mask` is `None`: applying them is slicing, with no boolean gather or
    `index_put` (each a host sync on an accelerator). In training, slots vary per block, so the tensors span all
    slots (zeros where unconditioned) and `slot_mask` says which are conditioned.

    Args:
        hidden_states (`torch.Tensor` of shape `(batch_size, L or num_slots, hidden_size)`):
            drafter final (post-norm) hidden states of the retained drafts.
        target_features (`torch.Tensor` of shape `(batch_size, L or num_slots, len(target_layer_ids) * hidden_size)`):
            target verification features of the position that scored each retained draft.
        slot_mask (`torch.BoolTensor` of shape `(batch_size, num_slots)`, *optional*): which slots are conditioned;
            `None` for the inference layout (slots `1 .. L`).
    """

    hidden_states: torch.Tensor
    target_features: torch.Tensor
    slot_mask: torch.Tensor | None = None

    def dense_slot_mask(self, num_slots: int) -> torch.Tensor:
        """`(batch_size, num_slots)` bool mask of the conditioned slots, for either layout."""
        if self.slot_mask is not None:
            return self.slot_mask
        slots = torch.arange(num_slots, device=self.hidden_states.device)
        retained = self.hidden_states.shape[1]
        return ((slots >= 1) & (slots <= retained)).expand(self.hidden_states.shape[0], num_slots)


def build_rejected_trajectory(
    draft_hidden_states: torch.Tensor, verification_features: torch.Tensor, num_matches: int
) -> ReTraceConditioning | None:
    """Aligns the rejected suffix of round r with the mask slots of round r+1.

    Args:
        draft_hidden_states (`torch.Tensor` of shape `(batch, B, hidden)`): drafter final states of round r, slot 0
            being the anchor. `B` here is the verified length: the block, or its first `k+1` slots when only `k`
            drafts were verified (`config.num_assistant_tokens`).
        verification_features (`torch.Tensor` of shape `(batch, B, num_features)`): target features of the B
            verification inputs `[a, d1 .. d_{B-1}]` (block position i = absolute position p+i).
        num_matches (`int`): accepted drafts n, in `[0, B-1]`.
    Returns:
        [`ReTraceConditioning`] in the inference layout (`L` slots, `slot_mask=None`), or `None` when nothing is
        retained (`L = B-2-n <= 0`).

    Worked example, B = 8, n = 2: c replaces d3 at p+3 and anchors round r+1. Retained slots j = 4..7 (L = 4) sit at
    p+4..p+7, which are next slots 1..4. Their features come from verification positions j-1 = 3..6.
    """
    block_size = draft_hidden_states.shape[1]
    retained = block_size - 2 - num_matches
    if retained <= 0:
        return None
    first = num_matches + 2  # first retained slot j
    # views, no copies: next-round slot s = 1..L holds h_{s+n+1} and the features of verification position s+n
    return ReTraceConditioning(
        hidden_states=draft_hidden_states[:, first:block_size],
        target_features=verification_features[:, first - 1 : block_size - 1],
    )


@dataclass
class ReTraceGenerationStats:
    """Per-generate bookkeeping. One entry per verification cycle of a drafted block (prefill excluded).

    Attributes:
        acceptance_lengths (`list[int]`): tokens committed per cycle, bonus/correction included (1..B).
        retained_lengths (`list[int]`): `L` handed to the NEXT round after each cycle (0 = no conditioning).
        num_conditioned_rounds (`int`): drafted rounds that received a rejected trajectory.
        num_drafter_forwards (`int`): drafter forward passes.
        num_lookup_cycles (`int`): cycles that verified prompt-lookup candidates instead of a drafted block
            (`config.prompt_lookup_num_tokens`); they are in `acceptance_lengths` too.
        num_datastore_cycles (`int`): cycles that verified datastore-lookup candidates instead of a drafted block
            (`config.datastore_num_tokens`); they are in `acceptance_lengths` too.
    """

    acceptance_lengths: list[int] = field(default_factory=list)
    retained_lengths: list[int] = field(default_factory=list)
    num_conditioned_rounds: int = 0
    num_drafter_forwards: int = 0
    num_lookup_cycles: int = 0
    num_datastore_cycles: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification cycle (DESIGN §4)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def mean_retained_length(self) -> float:
        """Mean `L` over the rounds that were conditioned."""
        used = [x for x in self.retained_lengths if x > 0]
        return sum(used) / max(len(used), 1)


class _ConditionedDrafterCall:
    """Stands in for the drafter inside the parent's `get_candidates`: adds the pending rejected trajectory to the
    call and keeps the output states, so the in-tree drafting loop is reused unchanged. It hands the parent only the
    anchor and the first `k = num_assistant_tokens` slots, so the parent scores and proposes `k` drafts."""

    def __init__(self, drafter, generator: "ReTraceCandidateGenerator"):
        self.drafter, self.generator = drafter, generator
        self.config, self.device = drafter.config, drafter.device

    def __call__(self, **kwargs):
        gen = self.generator
        outputs = self.drafter(**kwargs, rejected_trajectory=gen.pending_trajectory)
        gen.stats.num_drafter_forwards += 1
        gen.stats.num_conditioned_rounds += gen.pending_trajectory is not None
        gen.last_draft_hidden_states = outputs.last_hidden_state  # [1, B, H]
        outputs.last_hidden_state = outputs.last_hidden_state[:, : gen.num_assistant_tokens + 1]  # [1, k+1, H]
        return outputs


class ReTraceCandidateGenerator(DFlashTokenCandidateGenerator):
    """DFlash candidate generator that conditions each block on the previous round's rejected suffix.

    Per cycle it (1) reads `n` and the verification hidden states of ALL verified block positions from the outputs
    `_assisted_decoding` hands over (plain DFlash crops the rejected ones away), (2) builds the aligned suffix with
    [`build_rejected_trajectory`], (3) drafts through the parent with that conditioning. Verification is untouched.

    With `config.num_assistant_tokens = k < B-1` the drafter still runs its whole block (its trained shape), and the
    target verifies `[a, d1 .. dk]`: `k+1` tokens instead of `B`. The drafts are the same tokens, so greedy output
    is unchanged; ReTrace then retains slots `n+2 .. k`, the ones with verification features.

    With `config.prompt_lookup_num_tokens` (or `generate(prompt_lookup_num_tokens=...)`), a cycle whose context ends
    in an n-gram seen earlier verifies [`prompt_lookup_candidates`] instead, and the drafter does not run. The target
    features of the tokens such cycles commit are kept, and the next drafted cycle feeds them all to the drafter, so
    its context is the same as if it had drafted every cycle. With `config.datastore_num_tokens`, a cycle prompt lookup
    leaves to the drafter first tries the drafter's datastore ([`NgramDatastore`], REST) the same way.
    """

    def __init__(self, assistant_model, main_model_input_embeddings, main_model_output_embeddings, generation_config,
                 logits_processor=None, **kwargs):  # fmt: skip
        super().__init__(assistant_model, main_model_input_embeddings, main_model_output_embeddings,
                         generation_config, logits_processor, **kwargs)  # fmt: skip
        self.num_assistant_tokens, self.confidence_threshold = _verification_limits(assistant_model.config)
        self.lookup_num_tokens, self.lookup_ngram_sizes = _lookup_settings(assistant_model.config, generation_config)
        self.datastore = _datastore_index(assistant_model)
        self.assistant_model = _ConditionedDrafterCall(assistant_model, self)
        self.uses_trajectory = assistant_model.config.retrace_mode != "off"
        self.stats = ReTraceGenerationStats()
        assistant_model.last_generation_stats = self.stats
        self.pending_trajectory: ReTraceConditioning | None = None
        self.last_draft_hidden_states: torch.Tensor | None = None
        # what the last target forward verified: "draft", "lookup" (prompt lookup), "datastore" or None (neither)
        self._cycle: str | None = None
        self._verified = 0  # tokens in the last verification forward: the anchor and the drafts proposed
        # Target features of committed positions 0 .. `_num_featured - 1`; those the drafter has not consumed yet
        # (the prefill's, then those of lookup cycles) wait in `_unseen_features`, [1, U_i, F] each.
        self._num_featured = 0
        self._unseen_features: list[torch.Tensor] = []
        # The parent concatenates `hidden_states[i + 1]` over `target_layer_ids` for the accepted context, and
        # ReTrace needs the same layers at the rejected positions too. `get_candidates` concatenates once and hands
        # the parent that tensor as a single "layer" 0 (`hidden_states[1]`), so it only slices it.
        self.feature_layer_ids = list(self.target_layer_ids)
        self.target_layer_ids = [0]

    def get_candidates(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs):
        self.pending_trajectory = None
        if model_outputs is not None and not is_first_iteration:
            self._collect_features(input_ids, self._concatenated_features(model_outputs), int(n_last_matches))
        self._cycle = None
        lookup = None if is_first_iteration else self._lookup(input_ids)
        if lookup is not None:
            if self.pending_trajectory is not None:  # the suffix was drafted for this anchor, and nothing uses it
                self.stats.retained_lengths[-1] = 0
                self.pending_trajectory = None
            kind, lookup_ids = lookup
            self._cycle, self._verified = kind, lookup_ids.shape[1] - input_ids.shape[1] + 1
            return lookup_ids, None
        if self._unseen_features:  # the parent reads the first `n_last_matches + 1` positions of `hidden_states[1]`
            unseen = self._unseen_features  # [1, U, F]: every committed position it has not seen
            context = unseen[0] if len(unseen) == 1 else torch.cat(unseen, dim=1)
            model_outputs, n_last_matches = _ConcatenatedFeatures(hidden_states=(None, context)), context.shape[1] - 1
        forwards = self.stats.num_drafter_forwards
        candidate_ids, candidate_logits = super().get_candidates(
            input_ids,
            model_kwargs=model_kwargs,
            model_outputs=model_outputs,
            is_first_iteration=is_first_iteration,
            n_last_matches=n_last_matches,
            **kwargs,
        )
        if self.stats.num_drafter_forwards == forwards:  # the first iteration, or no room left for a draft
            return candidate_ids, candidate_logits
        self._unseen_features = []
        if candidate_logits is not None and self.confidence_threshold is not None:
            candidate_ids, candidate_logits = stop_at_low_confidence(
                input_ids.shape[1], candidate_ids, candidate_logits, self.confidence_threshold
            )
        # a cycle is one drafter forward, even when no draft was confident enough to verify (then it commits 1 token)
        self._cycle, self._verified = "draft", candidate_ids.shape[1] - input_ids.shape[1] + 1
        return candidate_ids, candidate_logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self._cycle is not None:  # a verification cycle (prefill and final plain steps excluded)
            n = int(num_matches)
            self.stats.acceptance_lengths.append(n + 1)
            drafted = self._cycle == "draft" and self.uses_trajectory
            self.stats.retained_lengths.append(max(self._verified - 2 - n, 0) if drafted else 0)
            self.stats.num_lookup_cycles += self._cycle == "lookup"
            self.stats.num_datastore_cycles += self._cycle == "datastore"

    def _collect_features(self, input_ids: torch.LongTensor, features: torch.Tensor, num_matches: int) -> None:
        """Builds the pending trajectory of a drafted cycle, and keeps the features of the newly committed positions.

        Args:
            input_ids (`torch.LongTensor` of shape `(1, T)`): the committed tokens; the last one (the bonus or
                correction) has not been through the target yet.
            features (`torch.Tensor` of shape `(1, T_last, F)`): the last target forward's features: the prompt
                after prefill, `[a, d1 .. dk]` after a cycle (`T_last = k+1`).
            num_matches (`int`): drafts the last cycle accepted.
        """
        if self._cycle == "draft" and self.uses_trajectory:
            verified = self._verified
            self.pending_trajectory = build_rejected_trajectory(
                self.last_draft_hidden_states[:, :verified], features[:, -verified:], num_matches
            )
        # the target has run every committed position but the newest token; the last forward ran the `new` ones not
        # featured yet: the whole prompt after prefill, the anchor and the n accepted drafts after a cycle
        new = input_ids.shape[1] - 1 - self._num_featured
        self._unseen_features.append(features[:, :new])
        self._num_featured += new

    def _lookup(self, input_ids: torch.LongTensor) -> tuple[str, torch.LongTensor] | None:
        """`("lookup" | "datastore", [1, T + m])`: the context and `m` candidates of prompt lookup, else of the
        datastore; `None` when both are off or find nothing, or there is no room left."""
        room = self.main_model_max_length - input_ids.shape[1] - 1
        if room <= 0:
            return None
        tokens, kind = None, "lookup"
        if self.lookup_num_tokens is not None:
            num_tokens = min(self.lookup_num_tokens, room)
            tokens = prompt_lookup_candidates(input_ids[0], num_tokens, *self.lookup_ngram_sizes)
        if tokens is None and self.datastore is not None:
            tokens, kind = self.datastore.candidates(input_ids[0], room), "datastore"
        return None if tokens is None else (kind, torch.cat([input_ids, tokens[None].to(input_ids.device)], dim=1))

    def _concatenated_features(self, model_outputs) -> torch.Tensor:
        """`[1, T_last, len(ids) * H]`: target features of the last target forward's `T_last` inputs (the prompt
        after prefill, the B verification inputs afterwards), concatenated once per cycle."""
        if model_outputs is None or model_outputs.hidden_states is None:
            raise ValueError("ReTrace needs the target's hidden states from the verification pass; got none.")
        feats = [model_outputs.hidden_states[i + 1] for i in self.feature_layer_ids]
        return torch.cat(feats, dim=-1).to(self.device)


def stop_at_low_confidence(
    context_length: int, candidate_ids: torch.LongTensor, candidate_logits: torch.Tensor, threshold: float
) -> tuple[torch.LongTensor, torch.Tensor | None]:
    """Keeps the drafts before the first slot whose draft distribution peaks below `threshold` (transformers'
    `assistant_confidence_threshold`), so a cycle verifies no more tokens than its drafter believes in.

    The confidence of slot `j` is the drafter's top-1 probability there: for greedy drafts, the drafted token's
    probability. Under sampling it does not depend on the sampled token (DFlash computes every slot's distribution in
    one forward), which keeps speculative sampling exact; a stop that looked at the sampled token's own probability
    would bias it.

    Args:
        context_length (`int`): `T`, the committed tokens that `candidate_ids` starts with.
        candidate_ids (`torch.LongTensor` of shape `(1, T + k)`): the context, then `k` drafts.
        candidate_logits (`torch.Tensor` of shape `(1, k, vocab_size)`): the draft logits the drafts came from.
        threshold (`float`): in `(0, 1]`.
    Returns:
        `(candidate_ids[:, : T + j], candidate_logits[:, :j])` for the `j` leading confident slots; `None` logits
        when `j = 0`, which transformers runs as a plain target step.
    """
    confidence = candidate_logits.float().softmax(-1).amax(-1)  # [1, k]
    keep = int((confidence >= threshold).int().cumprod(dim=-1).sum())  # one host sync per cycle: the verified length
    if keep == 0:
        return candidate_ids[:, :context_length], None
    return candidate_ids[:, : context_length + keep], candidate_logits[:, :keep]


def prompt_lookup_candidates(
    input_ids: torch.LongTensor, num_tokens: int, max_ngram_size: int, min_ngram_size: int = 1
) -> torch.LongTensor | None:
    """Prompt lookup (Saxena, 2023; transformers' `PromptLookupCandidateGenerator`): the tokens that followed the
    earliest earlier occurrence of the context's last n-gram, trying `n = max_ngram_size` down to `min_ngram_size`.

    transformers' own generator always goes down to `n = 1`; a minimum is vLLM's `prompt_lookup_min`. Candidates are
    not cropped at EOS or checked against logits processors: `_assisted_decoding` crops what it commits at EOS, and
    the target rejects any token its processors forbid.

    Args:
        input_ids (`torch.LongTensor` of shape `(T,)`): the committed tokens, prompt and output.
        num_tokens (`int`): most candidates returned.
        max_ngram_size (`int`), min_ngram_size (`int`): n-gram sizes tried, longest first.
    Returns:
        `torch.LongTensor` of shape `(m,)`, `1 <= m <= num_tokens`, or `None` when no n-gram recurs.
    """
    length = input_ids.shape[0]
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = input_ids.unfold(0, n, 1)[:-1]  # [T - n, n]: window i is ids[i : i+n], all but the last n-gram
        matches = (windows == input_ids[-n:]).all(dim=1).nonzero()  # [M, 1]
        if len(matches):  # window i ends at i+n-1 <= T-2, so at least one token follows it
            start = int(matches[0, 0]) + n
            return input_ids[start : start + num_tokens]
    return None


def _lookup_settings(config, generation_config) -> tuple[int | None, tuple[int, int]]:
    """`(num_tokens, (max_ngram_size, min_ngram_size))` of prompt lookup: the drafter config's, overridden by
    `generate`'s `prompt_lookup_num_tokens` and `max_matching_ngram_size` when given."""
    num_tokens = generation_config.prompt_lookup_num_tokens
    num_tokens = config.prompt_lookup_num_tokens if num_tokens is None else num_tokens
    max_size = generation_config.max_matching_ngram_size or config.prompt_lookup_max_ngram_size
    min_size = min(config.prompt_lookup_min_ngram_size, max_size)  # a smaller max given to `generate` lowers the min
    config.check_prompt_lookup(num_tokens, max_size, min_size)
    return num_tokens, (max_size, min_size)


def _datastore_index(drafter):
    """The drafter's [`NgramDatastore`] under its config's datastore-lookup settings, or `None` when they are off."""
    config = drafter.config
    sizes = (config.datastore_max_ngram_size, config.datastore_min_ngram_size)
    config.check_datastore(config.datastore_num_tokens, *sizes, config.datastore_size)  # the config may have changed
    return None if config.datastore_num_tokens is None else drafter.datastore(config.datastore_num_tokens, *sizes)


def _verification_limits(config) -> tuple[int, float | None]:
    """`(k, t)`: the drafts verified per block (`config.num_assistant_tokens`, or all `B-1` when unset) and the
    confidence stop (`config.assistant_confidence_threshold`). Checked here too, since they may be set on a loaded
    drafter's config (the config checks them only when built)."""
    k, drafted, t = config.num_assistant_tokens, config.block_size - 1, config.assistant_confidence_threshold
    if k is not None and not 1 <= k <= drafted:
        raise ValueError(
            f"num_assistant_tokens must be in [1, block_size - 1 = {drafted}] (drafts verified per block) or None "
            f"(all of them), got {k}"
        )
    if t is not None and not 0.0 < t <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be in (0, 1] or None (no confidence stop), got {t}")
    return (drafted if k is None else k), t


@dataclass
class _ConcatenatedFeatures:
    """What the parent `get_candidates` reads of the target outputs: `hidden_states[1]` is the layers already
    concatenated (see `ReTraceCandidateGenerator.__init__`)."""

    hidden_states: tuple


def validate_drafter_for_target(target, drafter) -> None:
    """Raises `ValueError` with the fix when `drafter` was not built for `target` (sizes, vocabulary, depth)."""
    tcfg, dcfg = target.config.get_text_config(), drafter.config
    if dcfg.hidden_size != tcfg.hidden_size or dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(
            f"Drafter (hidden_size={dcfg.hidden_size}, vocab_size={dcfg.vocab_size}) does not match the target "
            f"(hidden_size={tcfg.hidden_size}, vocab_size={tcfg.vocab_size}); use a drafter built for this target, "
            "e.g. `ReTraceDrafterModel.from_target(target)`."
        )
    if max(dcfg.target_layer_ids) >= tcfg.num_hidden_layers:
        raise ValueError(
            f"Drafter target_layer_ids {dcfg.target_layer_ids} must be < the target's num_hidden_layers "
            f"({tcfg.num_hidden_layers}); this drafter was built for a deeper target."
        )


def check_batch_size(batch_size: int) -> None:
    if batch_size != 1:
        raise ValueError(
            f"ReTrace speculative decoding supports batch size 1 only, got {batch_size}: each sequence accepts a "
            "different number of drafts per round, so target and drafter caches would diverge (transformers' "
            "assisted decoding has the same limit). Call `generate` once per prompt."
        )


def is_retrace_drafter(model) -> bool:
    """True for ReTrace drafters, whether from this package or loaded with `trust_remote_code`."""
    config = getattr(model, "config", None)
    return config is not None and config.model_type == "retrace_drafter"


def make_candidate_generator(target, drafter, input_ids, generation_config, logits_processor):
    """Builds the ReTrace generator of `drafter`'s own code copy (package or remote code) for `target`."""
    validate_drafter_for_target(target, drafter)
    check_batch_size(input_ids.shape[0])
    generator_cls = _generator_class_of(drafter)
    return generator_cls(
        assistant_model=drafter,
        main_model_input_embeddings=target.get_input_embeddings(),
        main_model_output_embeddings=draft_lm_head(
            target.get_output_embeddings(), drafter.config.draft_logits_dtype, getattr(drafter, "draft_vocab_ids", None)
        ),
        generation_config=generation_config,
        logits_processor=logits_processor,
    )


class DraftLMHead(nn.Module):
    """A copy of the target's lm head that scores drafts only: cast to `config.draft_logits_dtype` and/or restricted
    to the `K` rows of the reduced draft vocabulary (`draft_vocab_ids`).

    Logits come back in the target head's dtype over the FULL vocabulary (`-inf` outside the draft vocabulary), so
    the candidate sampler and the speculative-sampling acceptance test read the very same draft distribution `q`,
    which is 0 outside the draft vocabulary and positive on every drafted token (any such `q` keeps speculative
    sampling exact; the residual `max(p - q, 0)` spans the full vocabulary).
    """

    def __init__(self, lm_head: nn.Linear, dtype: torch.dtype, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.out_dtype = lm_head.weight.dtype
        self.vocab_size = lm_head.weight.shape[0]
        weight, bias = lm_head.weight.detach(), getattr(lm_head, "bias", None)
        if vocab_ids is not None:
            vocab_ids = vocab_ids.to(weight.device)
            weight, bias = weight[vocab_ids], None if bias is None else bias.detach()[vocab_ids]
        self.register_buffer("vocab_ids", vocab_ids, persistent=False)  # [K] or None
        # The weight is kept as `weight_t`, [H, K or V]. fp32 stores it contiguous: a few rows times it is a plain
        # GEMM, which MKL runs faster than `linear`'s per-row products on a [K, H] weight (3 rows of an
        # 8192-row head: 2.7 ms against 4.7 ms, 1 thread; `benchmarks/draft_logits_cost.py`). Other dtypes keep
        # [K, H] contiguous and use `linear`: on CPUs without bf16 units its bf16 path is slow, and the transposed
        # product ~25x slower still.
        weight = weight.to(dtype)
        weight_t = weight.T.contiguous() if dtype == torch.float32 else weight.T  # [H, K or V]
        self.register_buffer("weight_t", weight_t, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """`[K or V, H]` (a view of `weight_t`)."""
        return self.weight_t.T

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[b, q, H]` drafter states -> `[b, q, V]` draft logits."""
        # 2-D on purpose: the generator passes `last_hidden_state[:, 1:]`, and a bf16 cast of that slice keeps its
        # 3-D strides, which took a slow CPU matmul path (136 ms vs 8 ms for 15 rows of SmolLM2's 49152 x 576 head,
        # 1 thread, session 5; on an AVX2 CPU without bf16 units both take ~113 ms, and the fp32 head ~35 ms:
        # `benchmarks/draft_logits_cost.py`).
        flat = hidden_states.reshape(-1, hidden_states.shape[-1]).to(self.weight_t.dtype)  # [b*q, H]
        if self.weight_t.dtype == torch.float32:  # x @ W^T as a plain GEMM on the contiguous [H, K]
            logits = flat @ self.weight_t if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
        else:
            logits = nn.functional.linear(flat, self.weight, self.bias)
        logits = logits.to(self.out_dtype)  # [b*q, K or V]
        if self.vocab_ids is not None:  # scatter the K draft-vocabulary logits into a -inf full-vocabulary row
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.vocab_ids, logits)
        return logits.view(*hidden_states.shape[:-1], -1)


_DRAFT_HEADS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def draft_lm_head(lm_head: nn.Module, dtype_name: str | None, vocab_ids: torch.Tensor | None = None) -> nn.Module:
    """`lm_head` itself, or a cached [`DraftLMHead`] in `dtype_name` restricted to `vocab_ids` (rebuilt when the
    weights or the ids change)."""
    if getattr(lm_head, "weight", None) is None:
        if vocab_ids is not None:
            raise ValueError("a reduced draft vocabulary needs a target lm head with a `weight` (an nn.Linear)")
        return lm_head
    dtype = getattr(torch, dtype_name) if dtype_name is not None else lm_head.weight.dtype
    if lm_head.weight.dtype == dtype and vocab_ids is None:
        return lm_head
    ids_key = None if vocab_ids is None else (vocab_ids.data_ptr(), vocab_ids._version, len(vocab_ids))
    key = (dtype, lm_head.weight.data_ptr(), lm_head.weight._version, ids_key)
    cached = _DRAFT_HEADS.get(lm_head)
    if cached is None or cached[0] != key:
        cached = (key, DraftLMHead(lm_head, dtype, vocab_ids))
        _DRAFT_HEADS[lm_head] = cached
    return cached[1]


def unwrap_drafter(model):
    """The drafter inside `torch.compile` (`_orig_mod`) and PEFT (`get_base_model()`) wrappers, in any nesting."""
    for _ in range(8):  # wrappers nest a few levels at most
        inner = getattr(model, "_orig_mod", None)
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if inner is None or inner is model:
            return model
        model = inner
    return model


def _generator_class_of(drafter):
    """The candidate generator of the drafter's own code copy (this package, or a `trust_remote_code` module), found
    from the drafter's class hierarchy rather than the wrapper's module name (`torch._dynamo`, `peft`, ...)."""
    for cls in type(unwrap_drafter(drafter)).__mro__:
        if cls.__module__.rsplit(".", 1)[-1] == "modeling_retrace":
            package = cls.__module__.rsplit(".", 1)[0]
            return importlib.import_module(f"{package}.generation_retrace").ReTraceCandidateGenerator
    raise TypeError(f"{type(drafter).__name__} wraps no ReTrace drafter (no modeling_retrace class in its hierarchy)")


def install_generate_hook() -> bool:
    """Makes `target.generate(..., assistant_model=retrace_drafter)` use [`ReTraceCandidateGenerator`].

    transformers 5.24 has no public hook for an assistant to supply its candidate generator. This wraps the two
    `GenerationMixin` methods that decide it: `_validate_generation_mode` (so a mismatched drafter gets our error,
    not the universal-assisted-decoding one) and `_get_candidate_generator` (the dispatch); every other assistant
    falls through. Called when this file is imported (by the package or as remote code). Each wrapper is installed
    at most once across the package and remote-code copies (the marker lives on the wrapper), so calling this again
    changes nothing.

    On a transformers version outside `SUPPORTED_TRANSFORMERS` (the private methods may have changed) it wraps
    nothing and warns: the drafter still loads, and `speculation_type="dflash"` runs it through transformers' own
    DFlash path (plain DFlash drafts, lossless, no ReTrace conditioning).

    Returns:
        `bool`: whether the hook is installed.
    """
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", transformers.__version__).groups())
    if not SUPPORTED_TRANSFORMERS[0] <= installed < SUPPORTED_TRANSFORMERS[1]:
        warnings.warn(
            f"hf_retrace's generate hook supports transformers >=5.24,<6; found {transformers.__version__}, so it is "
            "not installed. Pass `speculation_type=\"dflash\"` to run ReTrace drafters through transformers' own "
            "DFlash path (plain DFlash drafts, no ReTrace conditioning), or install `transformers>=5.24,<6`.",
            stacklevel=2,
        )
        return False
    GenerationMixin._validate_generation_mode = _wrap_once(GenerationMixin._validate_generation_mode, _wrap_validation)
    GenerationMixin._get_candidate_generator = _wrap_once(GenerationMixin._get_candidate_generator, _wrap_dispatch)
    return True


def _wrap_once(method, wrap):
    """`wrap(method)` marked as ours, or `method` itself when it already is one of our wrappers (from this copy of
    the file or another: package and remote-code copies share the marker attribute, not the function objects)."""
    if getattr(method, "_retrace_hook", False):
        return method
    wrapped = wrap(method)
    wrapped._retrace_hook = True
    return wrapped


def _wrap_validation(original):
    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        if is_retrace_drafter(generation_mode_kwargs.get("assistant_model")):
            validate_drafter_for_target(self, generation_mode_kwargs["assistant_model"])
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _wrap_dispatch(original):
    @functools.wraps(original)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, **kwargs):  # fmt: skip
        if is_retrace_drafter(assistant_model) and generation_config.speculation_type in (None, "retrace"):
            return make_candidate_generator(self, assistant_model, input_ids, generation_config, logits_processor)
        return original(
            self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
            assistant_model=assistant_model, **kwargs,
        )  # fmt: skip

    return _get_candidate_generator


class _TargetWithCandidateGenerator:
    """A view of the target whose `_get_candidate_generator` returns a fixed generator; everything else is the
    target's own. Lets [`retrace_generate`] reuse `_assisted_decoding` without patching any class."""

    def __init__(self, target, candidate_generator):
        self._target, self._candidate_generator = target, candidate_generator

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        return self._target(*args, **kwargs)

    def _get_candidate_generator(self, *args, **kwargs):
        return self._candidate_generator


def retrace_generate(
    model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, drafter=None,
    **model_kwargs,
):  # fmt: skip
    """`custom_generate` callable: `target.generate(**inputs, custom_generate=retrace_generate, drafter=drafter)`.

    Runs transformers' assisted-decoding loop with the ReTrace generator and patches nothing.
    (transformers does not forward `streamer` to custom callables; use `assistant_model=` for streaming.)
    """
    if drafter is None:
        raise ValueError("retrace_generate needs `drafter=`: a ReTrace drafter built for this target.")
    generator = make_candidate_generator(model, drafter, input_ids, generation_config, logits_processor)
    view = _TargetWithCandidateGenerator(model, generator)
    return GenerationMixin._assisted_decoding(
        view, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        generation_config=generation_config, synced_gpus=synced_gpus, **model_kwargs,
    )  # fmt: skip


__all__ = [
    "DraftLMHead",
    "ReTraceConditioning",
    "ReTraceCandidateGenerator",
    "ReTraceGenerationStats",
    "build_rejected_trajectory",
    "draft_lm_head",
    "install_generate_hook",
    "prompt_lookup_candidates",
    "retrace_generate",
    "stop_at_low_confidence",
    "validate_drafter_for_target",
]


# Installed on import, not in the model constructor: `import hf_retrace`, and loading the drafter with
# `trust_remote_code=True` (its modeling file imports this one), both make `assistant_model=drafter` work.
install_generate_hook()

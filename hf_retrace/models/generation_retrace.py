# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch, transformers and the Hub files `.sources_retrace`, `.policy_settings_retrace`,
# `.speculation_retrace`, `.speculation_state_retrace`, `.decoding_retrace`, `.draft_head_retrace` only, so
# `trust_remote_code=True` loads it. The generate hook is in `hook_retrace`.
"""ReTrace speculative decoding on top of transformers' in-tree DFlash candidate generator.

Round r drafts the block `[a, d1 .. d_{B-1}]` at positions `p .. p+B-1`; the target accepts `d1..dn` and commits
its correction `c` at `p+n+1`, the next anchor. ReTrace keeps the drafter states of slots `j = n+2 .. B-1`
(`L = B-2-n` of them) and feeds them to the next round's mask slots `1 .. L` (same absolute positions), together
with the target features of verification position `j-1`, the one that scored draft `d_j` (`docs/design.md`, "A
cycle").
"""

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from .decoding_retrace import ReTraceDecodingSettings
from .draft_head_retrace import draft_lm_head
from .policy_settings_retrace import num_confident
from .sources_retrace import candidate_sources
from .speculation_retrace import SpeculationPolicy
from .speculation_state_retrace import profile_cost_model, speculation_state, time_target_step, transformers_host_key


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
            drafts were verified (`num_assistant_tokens`).
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
    """Per-generate bookkeeping. One entry per step the policy planned (prefill and forced plain steps at the length
    limit excluded): a drafted block, a source's candidates, or (under `"goodput"`) a plain target step.

    Attributes:
        acceptance_lengths (`list[int]`): tokens committed per cycle, bonus/correction included (1..B).
        retained_lengths (`list[int]`): `L` handed to the NEXT round after each cycle (0 = no conditioning).
        num_conditioned_rounds (`int`): drafted rounds that received a rejected trajectory.
        num_drafter_forwards (`int`): drafter forward passes.
        source_cycles (`dict[str, int]`): per candidate source (its `name`), the cycles that verified its candidates
            instead of a drafted block; they are in `acceptance_lengths` too.
        num_empty_steps (`int`): planned steps that verified no proposed token (one plain target row): the policy
            proposed nothing, or a drafted block had no draft worth verifying.
        predicted_seconds (`list[float]`), measured_seconds (`list[float]`): per goodput step, the cost model's
            `t(R) + d(S)` and the measured target plus drafter time.
    """

    acceptance_lengths: list[int] = field(default_factory=list)
    retained_lengths: list[int] = field(default_factory=list)
    num_conditioned_rounds: int = 0
    num_drafter_forwards: int = 0
    source_cycles: dict[str, int] = field(default_factory=dict)
    num_empty_steps: int = 0
    predicted_seconds: list[float] = field(default_factory=list)
    measured_seconds: list[float] = field(default_factory=list)

    @property
    def num_lookup_cycles(self) -> int:
        """Cycles that verified prompt-lookup candidates (`prompt_lookup_num_tokens`)."""
        return self.source_cycles.get("prompt_lookup", 0)

    @property
    def num_datastore_cycles(self) -> int:
        """Cycles that verified datastore-lookup candidates (`datastore_num_tokens`)."""
        return self.source_cycles.get("datastore", 0)

    @property
    def num_online_datastore_cycles(self) -> int:
        """Cycles that verified online-datastore candidates (`online_datastore_num_tokens`)."""
        return self.source_cycles.get("online_datastore", 0)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification cycle, the bonus or correction token included."""
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

    Its settings are the drafter's `generation_config` with the call's overrides ([`ReTraceDecodingSettings`]).
    With `num_assistant_tokens = k < B-1` the drafter still runs its whole block (its trained shape), and the target
    verifies `[a, d1 .. dk]`: `k+1` tokens instead of `B`. The drafts are the same tokens, so greedy output is
    unchanged; ReTrace then retains slots `n+2 .. k`, the ones with verification features.

    Each cycle asks the shared [`SpeculationPolicy`] (`speculation_policy`): candidate sources' tokens (prompt
    lookup, the datastores; the drafter does not run), a drafted block with `k` of its drafts verified (`0 <= k`), or,
    under `"goodput"`, a plain target step. The target features of the tokens that cycles without the drafter commit
    are kept, and the next drafted cycle feeds them all to the drafter, so its context is the same as if it had
    drafted every cycle. The policy's memory (acceptance estimates, online datastore, step costs) lives on the
    drafter (`speculation_state_retrace`), and one `generate` call is one request of it.

    Args:
        settings ([`ReTraceDecodingSettings`], *optional*): the settings to run with; by default
            `assistant_model.decoding_settings(generation_config)`.
        target (`PreTrainedModel`, *optional*): the target, profiled for the step costs under `"goodput"`.
        main_model_output_embeddings (`nn.Module`): the target's lm head; drafts are scored with
            [`draft_lm_head`] of it (`draft_logits_dtype`, the reduced draft vocabulary).
    """

    def __init__(self, assistant_model, main_model_input_embeddings, main_model_output_embeddings, generation_config,
                 logits_processor=None, settings: ReTraceDecodingSettings | None = None, target=None,
                 **kwargs):  # fmt: skip
        settings = settings or assistant_model.decoding_settings(generation_config)
        vocab_ids = assistant_model.draft_vocab_ids
        head = draft_lm_head(main_model_output_embeddings, settings.draft_logits_dtype, vocab_ids)
        super().__init__(assistant_model, main_model_input_embeddings, head, generation_config, logits_processor,
                         **kwargs)  # fmt: skip
        self.settings = settings
        self.num_assistant_tokens = settings.num_assistant_tokens
        self.confidence_threshold = settings.assistant_confidence_threshold
        state = speculation_state(assistant_model)
        self.sources = candidate_sources(settings, _SourceResources(assistant_model, state))
        cost_model = None
        if settings.speculation_policy == "goodput":
            cost_model = self._cost_model(state, target, assistant_model, head)
        self.policy = SpeculationPolicy(settings, self.sources, self.block_size, cost_model, state.estimator)
        self.request_id = state.new_request(self.policy)  # the previous call's request is finished here
        self._committed = 0  # tokens handed to `policy.commit` so far
        self._step: str | None = None  # the planned step being verified: "draft", "lookup", "none"; None otherwise
        self._verify_start, self._drafter_seconds = 0.0, 0.0
        self.assistant_model = _ConditionedDrafterCall(assistant_model, self)
        self.uses_trajectory = assistant_model.config.retrace_mode != "off"
        self.stats = ReTraceGenerationStats()
        assistant_model.last_generation_stats = self.stats
        self.pending_trajectory: ReTraceConditioning | None = None
        self.last_draft_hidden_states: torch.Tensor | None = None
        # What the last target forward verified: a drafted block (`_drafted`), the candidates of the source named
        # `_cycle_source`, or neither (prefill, a plain step)
        self._drafted, self._cycle_source = False, None
        self._verified = 0  # tokens in the last verification forward: the anchor and the drafts proposed
        # Target features of committed positions 0 .. `_num_featured - 1`; those the drafter has not consumed yet
        # (the prefill's, then those of source cycles and plain steps) wait in `_unseen_features`, [1, U_i, F] each.
        self._num_featured = 0
        self._unseen_features: list[torch.Tensor] = []
        # The parent concatenates `hidden_states[i + 1]` over `target_layer_ids` for the accepted context, and
        # ReTrace needs the same layers at the rejected positions too. `get_candidates` concatenates once and hands
        # the parent that tensor as a single "layer" 0 (`hidden_states[1]`), so it only slices it.
        self.feature_layer_ids = list(self.target_layer_ids)
        self.target_layer_ids = [0]

    def _cost_model(self, state, target, drafter, head):
        """The step-cost model of this target and drafter on this host: cached, or profiled now (once)."""
        if target is None:
            raise ValueError('speculation_policy="goodput" needs the target to profile step costs: build the '
                             "generator with `target=` (as `generate` does) or set `speculation_state(drafter)"
                             ".cost_model`")  # fmt: skip
        return state.cost_model_for(
            transformers_host_key(target, drafter),
            lambda: profile_cost_model(target, drafter, head, dict(self.model_kwargs_overrides)),
            lambda: time_target_step(target, dict(self.model_kwargs_overrides)),
        )

    def get_candidates(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs):
        self.pending_trajectory = None
        if model_outputs is not None and not is_first_iteration:
            self._collect_features(input_ids, self._concatenated_features(model_outputs), int(n_last_matches))
        self._drafted, self._cycle_source, self._step = False, None, None
        if is_first_iteration:  # the parent skips it: the target's prefill comes first
            self.policy.start(self.request_id, input_ids[0].tolist())
            self._committed = input_ids.shape[1]
            return input_ids, None
        # the policy is host-side bookkeeping on numpy (the same code the vLLM plugin runs): one copy of the ids
        tokens = input_ids[0].cpu().numpy()
        self.policy.commit(self.request_id, tokens[self._committed :])
        self._committed = tokens.shape[0]
        room = self.main_model_max_length - input_ids.shape[1] - 1
        plan = self.policy.plan([(self.request_id, tokens, max(room, 0))])
        action = plan.action(self.request_id)
        self._step = action[0] if room > 0 else None  # at the length limit: a forced plain step, not a planned one
        if action[0] != "draft":
            if self.pending_trajectory is not None and room > 0:  # drafted for this anchor, and nothing uses it
                self.stats.retained_lengths[-1] = 0
                self.pending_trajectory = None
            candidate_ids = input_ids
            if action[0] == "lookup":
                self._cycle_source = action[2]
                candidates = torch.tensor([action[1]], dtype=input_ids.dtype, device=input_ids.device)  # [1, m]
                candidate_ids = torch.cat([input_ids, candidates], dim=1)
            self._verified = candidate_ids.shape[1] - input_ids.shape[1] + 1
            return self._verify_from_here(candidate_ids, None)
        # "fixed" verifies all k drafts even past the length limit, as it always did (`_assisted_decoding` trims)
        self.num_assistant_tokens = self.settings.num_assistant_tokens if self.policy.kind == "fixed" else action[1]
        plan.actions[self.request_id] = ("draft", self.num_assistant_tokens)
        return self._draft(input_ids, model_kwargs, model_outputs, n_last_matches, plan, **kwargs)

    def _draft(self, input_ids, model_kwargs, model_outputs, n_last_matches, plan, **kwargs):
        """A drafted cycle: the parent drafts the block (ReTrace-conditioned), the policy picks how many to verify."""
        if self._unseen_features:  # the parent reads the first `n_last_matches + 1` positions of `hidden_states[1]`
            unseen = self._unseen_features  # [1, U, F]: every committed position it has not seen
            context = unseen[0] if len(unseen) == 1 else torch.cat(unseen, dim=1)
            model_outputs, n_last_matches = _ConcatenatedFeatures(hidden_states=(None, context)), context.shape[1] - 1
        forwards = self.stats.num_drafter_forwards
        start = time.perf_counter()
        candidate_ids, candidate_logits = super().get_candidates(
            input_ids, model_kwargs=model_kwargs, model_outputs=model_outputs, is_first_iteration=False,
            n_last_matches=n_last_matches, **kwargs,
        )  # fmt: skip
        if self.stats.num_drafter_forwards == forwards:  # no room left for a draft
            self._step = None
            return candidate_ids, candidate_logits
        self._unseen_features = []
        keep = candidate_logits.shape[1]
        if self.policy.kind == "goodput" or self.confidence_threshold is not None:
            confidence = candidate_logits.float().softmax(-1).amax(-1)  # [1, k]: top-1 draft probability per slot
            keep = self.policy.num_drafts(plan, {self.request_id: confidence[0].cpu().numpy()})[self.request_id]
        self._drafter_seconds = time.perf_counter() - start  # the drafter, its lm head and the host sync above
        candidate_ids, candidate_logits = _keep_drafts(input_ids.shape[1], candidate_ids, candidate_logits, keep)
        # a cycle is one drafter forward, even when no draft was worth verifying (then it commits 1 token)
        self._drafted, self._verified = True, keep + 1
        return self._verify_from_here(candidate_ids, candidate_logits)

    def _verify_from_here(self, candidate_ids, candidate_logits):
        self._verify_start = time.perf_counter()  # the target's verification runs until `update_candidate_strategy`
        return candidate_ids, candidate_logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self._step is None:  # prefill, or a plain step at the length limit: not a planned step
            return
        target_seconds = time.perf_counter() - self._verify_start
        n = int(num_matches)
        self.stats.acceptance_lengths.append(n + 1)
        retained = max(self._verified - 2 - n, 0) if self._drafted and self.uses_trajectory else 0
        self.stats.retained_lengths.append(retained)
        if self._cycle_source is not None:
            self.stats.source_cycles[self._cycle_source] = self.stats.source_cycles.get(self._cycle_source, 0) + 1
        self.stats.num_empty_steps += self._verified == 1
        self.policy.outcome(self.request_id, n)
        drafter_seconds = self._drafter_seconds if self._drafted else None
        # `input_ids` holds the `n + 1` new tokens: the verified rows sat at positions L - 1 .. L - 2 + rows of the
        # L tokens before them, and the row at position p read p + 1: L for the first, L + 1 .. L + rows - 1 after
        rows, before = self._verified, input_ids.shape[1] - n - 1
        context = (before, (rows - 1) * before + rows * (rows - 1) // 2)
        slots = self.block_size if self._drafted else 0
        self.policy.step_time(rows, slots, target_seconds, drafter_seconds, context, (1, rows - 1))
        if self.policy.last_step is not None:
            self.stats.predicted_seconds.append(self.policy.last_step.expected_seconds)
            self.stats.measured_seconds.append(target_seconds + (drafter_seconds or 0.0))

    def _collect_features(self, input_ids: torch.LongTensor, features: torch.Tensor, num_matches: int) -> None:
        """Builds the pending trajectory of a drafted cycle, and keeps the features of the newly committed positions.

        Args:
            input_ids (`torch.LongTensor` of shape `(1, T)`): the committed tokens; the last one (the bonus or
                correction) has not been through the target yet.
            features (`torch.Tensor` of shape `(1, T_last, F)`): the last target forward's features: the prompt
                after prefill, `[a, d1 .. dk]` after a cycle (`T_last = k+1`).
            num_matches (`int`): drafts the last cycle accepted.
        """
        if self._drafted and self.uses_trajectory:
            verified = self._verified
            self.pending_trajectory = build_rejected_trajectory(
                self.last_draft_hidden_states[:, :verified], features[:, -verified:], num_matches
            )
        # the target has run every committed position but the newest token; the last forward ran the `new` ones not
        # featured yet: the whole prompt after prefill, the anchor and the n accepted drafts after a cycle
        new = input_ids.shape[1] - 1 - self._num_featured
        self._unseen_features.append(features[:, :new])
        self._num_featured += new

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
    `assistant_confidence_threshold`): the rule is [`num_confident`], shared with the vLLM plugin.

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
    keep = int(num_confident(confidence[0].cpu().numpy(), threshold))  # one host sync per cycle: the verified length
    return _keep_drafts(context_length, candidate_ids, candidate_logits, keep)


def _keep_drafts(context_length: int, candidate_ids: torch.LongTensor, candidate_logits: torch.Tensor, keep: int):
    """The first `keep` drafts of `candidate_ids` `(1, T + k)` and `candidate_logits` `(1, k, V)`; `None` logits when
    `keep = 0`, which transformers runs as a plain target step."""
    if keep == 0:
        return candidate_ids[:, :context_length], None
    return candidate_ids[:, : context_length + keep], candidate_logits[:, :keep]


class _SourceResources:
    """What the candidate sources get from the transformers side: the drafter's datastore and its online datastore,
    which lives on the drafter (`speculation_state`), so it learns across `generate` calls."""

    def __init__(self, drafter, state):
        self.drafter, self.state = drafter, state

    def datastore(self, *args):
        return self.drafter.datastore(*args)

    def online_datastore(self, max_bytes: int):
        return self.state.online_datastore(max_bytes)


@dataclass
class _ConcatenatedFeatures:
    """What the parent `get_candidates` reads of the target outputs: `hidden_states[1]` is the layers already
    concatenated (see `ReTraceCandidateGenerator.__init__`)."""

    hidden_states: tuple


__all__ = [
    "ReTraceConditioning",
    "ReTraceCandidateGenerator",
    "ReTraceGenerationStats",
    "build_rejected_trajectory",
    "stop_at_low_confidence",
]

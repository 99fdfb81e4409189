"""The hf-retrace drafting policy as a vLLM proposer, built on vLLM's DFlash proposer.

Each engine step, for every request in the batch (in this order):
1. Bookkeeping of the cycle just verified: the target ran `[a, d1 .. dm]` (padded mode keeps the rows of rejected
   drafts), `n` drafts were accepted. If the `m` drafts came from the drafter and ReTrace is on, the retained
   rejected suffix (slots `j = n+2 .. m`, `L = m-1-n` of them) and the target's features at verification rows
   `j-1` become the next block's conditioning of mask slots `1..L` (the same slots as the transformers
   side's `build_rejected_trajectory`, with `B` there being the verified length `m+1`).
2. The shared speculation step (`SpeculationPolicy`, docs/cost-aware-speculation.md) learns from it: the outcome of
   the request's previous proposal, the tokens just committed (the online datastore indexes them), the end of the
   requests that left the runner. Then it plans the batch from the committed contexts: per request a lookup's
   tokens, the drafter, or nothing (`speculation_policy`: `"goodput"` weighs the step-cost model, `costs.py`,
   against calibrated acceptance, with the prompt rows still to prefill, which the next step carries within
   `max_num_batched_tokens`; `"fixed"` takes the first source that proposes, else the drafter). Under goodput, at
   a load where plain steps measured faster than speculating ones, the step runs plain: no lookups, no plan, nothing
   verified (`LoadFallback`, fallback.py).
3. One drafter forward for the batch when any request drafts: the full trained block (anchor + `B-1` masks); the
   policy then picks how many of a request's drafts are verified from their top-1 probabilities (`num_drafts`).
   The target's features of every verified row go to the drafter's context K/V cache, lookup cycles included, so a
   lookup never leaves a hole in its context: kept while no request drafts, written in one call before the next
   block forward or when a request leaves (`DeferredContextKV`, context_kv.py).

`propose()` runs these as steps: bookkeeping and plan (`_bookkeep`, `_plan`; bookkeeping.py), conditioning
(`_conditioning`), the drafter run (`_run_drafter`; drafter_run.py), each timed into a `StepRecord` (steps.py) that
refreshes the step-cost model (`costs.py`: this host's cache file, the start-up profile, profile.py, or a prior).

A request verifies at most `min(K, room)` tokens (`K`: vLLM's `num_speculative_tokens`; room: before `max_tokens`
and `max_model_len`); drafter cycles at most `num_assistant_tokens` of them, a source at most its `*_num_tokens`.
"""

import os

import numpy as np
import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from .bookkeeping import (
    Pending, StepBatch, block_conditioning, committed_tokens, drop_finished, prefill_left, read_step_batch,
    retained_suffix, verifies_previous,
)  # fmt: skip
from . import scheduler_queue
from .context_kv import DeferredContextKV
from .contract import check_attributes
from .costs import EngineCosts, key_from_vllm_config, step_costs
from .drafter_run import block_forward, context_rows, greedy_drafts, prepare_block_inputs
from .fallback import FALLBACK_ENV, PLAIN, LoadFallback
from .logs import get_logger
from .policy import DRAFTER, STATS_NAMES, DraftPolicy, check_token_budget, policy_sources
from .profile import StartupProfile
from .shared.online_datastore_retrace import OnlineDatastore
from .shared.speculation_retrace import SpeculationPlan, SpeculationPolicy
from .stats import STATS_ENV, ProposerStats
from .steps import PlannedStep, PredictionLedger, StepClock, StepLog, StepRecord


logger = get_logger(__name__)


class ReTraceDFlashProposer(DFlashProposer):
    """vLLM's `DFlashProposer` with the hf-retrace policy in front and ReTrace conditioning (module docstring)."""

    def __init__(self, vllm_config, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        check_attributes(self, "DFlashProposer")  # a renamed vLLM attribute fails here, at start-up
        check_attributes(runner, "GPUModelRunner")
        check_attributes(runner.input_batch, "InputBatch")
        self.runner = runner
        self.policy = DraftPolicy.from_hf_config(self.draft_model_config.hf_config)
        self.max_verified = self.speculative_config.num_speculative_tokens  # K
        if self.speculative_config.disable_padded_drafter_batch:
            raise ValueError(
                "hf-retrace drafters need vLLM's padded drafter batch (it keeps the target's features of rejected "
                "drafts, which ReTrace and the bookkeeping read): drop disable_padded_drafter_batch from "
                "speculative_config"
            )
        scheduler = vllm_config.scheduler_config
        check_token_budget(scheduler.max_num_batched_tokens, scheduler.max_num_seqs, self.policy.block_size)
        self.block_drafts = self.policy.block_size - 1
        if self.max_verified > self.block_drafts:
            raise ValueError(
                f"num_speculative_tokens {self.max_verified} is more than this drafter's block has drafts "
                f"(block_size - 1 = {self.block_drafts}); pass at most {self.block_drafts} (the folder's policy "
                f"verifies {self.policy.num_assistant_tokens})"
            )
        if self.max_verified != self.policy.num_assistant_tokens:
            logger.warning(
                "hf-retrace: num_speculative_tokens %d differs from the folder's num_assistant_tokens %d; drafter "
                "cycles verify %d drafts", self.max_verified, self.policy.num_assistant_tokens,
                min(self.max_verified, self.policy.num_assistant_tokens),
            )  # fmt: skip
        self.num_drafts_verified = min(self.max_verified, self.policy.num_assistant_tokens)
        if not self.speculative_config.use_eagle_block_drop():  # patches.py, hook point 6
            logger.info(
                "hf-retrace: prefix-cache hits keep their last block (vLLM's warning that disabling the EAGLE "
                "trailing block drop may affect acceptance does not apply: this drafter's context comes from its "
                "own K/V cache, written from the target's states of every computed row)"
            )
        self._size_for_block()
        vocab_size = self.draft_model_config.hf_config.vocab_size
        self.sources = policy_sources(self.policy, self.draft_model_config.model, vocab_size)  # index built here
        self.uses_retrace = self.policy.retrace_mode != "off"
        self.pending: dict[str, Pending] = {}  # by request id; dropped when the request leaves the runner
        self.committed: dict[str, int] = {}  # tokens the policy has seen committed, by running request id
        self.stats = ProposerStats()
        self.clock = StepClock()
        self.step_log = StepLog()  # off unless HF_RETRACE_VLLM_STEP_LOG names a file
        self.last_step: StepRecord | None = None  # the step-cost model's input: R, S and the parts' seconds
        self.startup_profile: StartupProfile | None = None  # set after vLLM's warm-up (profile.py)
        self.costs = EngineCosts(key_from_vllm_config(vllm_config))  # t(R), d(S): cache file, profile or prior
        # the drafter's forward runs for the whole padded batch when any request drafts: charged as such; a step's
        # rows are capped by the scheduler's token budget, which verification takes before prefill chunks do
        self.speculation = SpeculationPolicy(
            self.policy.settings, self.sources, self.policy.block_size, self.costs.model,
            max_rows=scheduler.max_num_scheduled_tokens or scheduler.max_num_batched_tokens, whole_batch_drafter=True,
        )  # fmt: skip
        self._logged = 0  # hundreds of cycles already logged
        self.prediction = PredictionLedger()  # goodput: predicted beside measured steps
        self._planned: PlannedStep | None = None  # the last plan's prediction of the step that verifies it
        self._step_committed = 0  # tokens this step committed, over its requests
        self._request_ended = False
        self._writes_stats = bool(os.environ.get(STATS_ENV))  # fixed for the engine process's life
        self.context_kv = DeferredContextKV(self.max_num_tokens)  # the drafter's context rows, written when due
        # prompt rows of the scheduler's waiting requests the next step may admit, from this step's SchedulerOutput
        # (patches.py sets it before the step runs; scheduler_queue.py)
        self.waiting_prefill_rows = 0
        self._counted_waiting = 0  # what of it the last plan counted (competing_rows): for the step log
        # goodput: plain steps at a load where speculating measured slower (fallback.py); FALLBACK_ENV=0 turns it off
        off = os.environ.get(FALLBACK_ENV, "1") == "0"
        self.fallback = LoadFallback() if self.speculation.kind == "goodput" and not off else None
        self._plain = False  # the plan made at this step was a plain one (the fallback's)

    def _size_for_block(self) -> None:
        """Re-sizes the DFlash query buffers for `B` query slots a request (the parent sized them for `1 + K`)."""
        self.num_speculative_tokens = self.block_drafts
        self.max_query_tokens = self.max_batch_size * (1 + self.block_drafts)
        self.max_padded_query_tokens = max(
            self.max_query_tokens, self.vllm_config.compilation_config.max_cudagraph_capture_size or 0
        )
        self.max_positions = self.max_num_tokens + self.max_padded_query_tokens
        self._slot_mapping_buffer = torch.zeros(self.max_padded_query_tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(self.max_padded_query_tokens, dtype=torch.int64, device=self.device)
        self.arange = torch.arange(self.max_positions + 1, device=self.device, dtype=torch.int32)

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        check_attributes(self.model, "DFlashQwen3ForCausalLM")
        check_attributes(self.model.model, "DFlashQwen3Model")

    @property
    def online_datastore(self) -> OnlineDatastore | None:
        """The online datastore's index (`None` when `online_datastore_num_tokens` is off)."""
        return next((s.store for s in self.sources if s.name == "online_datastore"), None)

    @property
    def step_records(self):
        """The last engine steps' `StepRecord`s, oldest first (a bounded deque)."""
        return self.clock.records

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> list[list[int]]:
        """Same call as `SpecDecodeBaseProposer.propose`. Returns one list of proposed tokens per request (vLLM's
        runner and scheduler take lists of any length, as for its n-gram proposer)."""
        self.clock.start()
        self._last_draft_probs = None
        self._step_committed = 0
        self._request_ended = False  # a request reached its end this step: the stats file is written (stats.py)
        cad = common_attn_metadata
        max_verified = min(int(num_speculative_tokens), self.max_verified)
        context_features = self.model.combine_hidden_states(target_hidden_states)  # [R, H]: fc of the features
        step = read_step_batch(
            self.runner.input_batch, cad, target_token_ids, target_positions, next_token_ids, num_rejected_tokens_gpu
        )
        self._drop_finished()
        plan, proposals, drafting, retained = self._bookkeep_and_plan(step, context_features, max_verified)
        # `plan` is None for a plain step (the fallback's): `drafting` is then empty
        drafting = self._fit_block(drafting, cad, step.req_ids)
        conditioning = self._conditioning(retained, drafting)
        self.clock.lap("policy")
        step_inputs = {
            "target_token_ids": target_token_ids, "next_token_ids": next_token_ids,
            "target_positions": target_positions, "target_hidden_states": context_features, "cad": cad,
            "num_rejected_tokens_gpu": num_rejected_tokens_gpu,
        }  # fmt: skip
        drafter_slots = self._run_drafter(plan, drafting, proposals, conditioning, step.req_ids, step_inputs)
        self._finish_step(step, drafter_slots)
        return proposals

    def _bookkeep_and_plan(self, step: StepBatch, context_features, max_verified: int):
        """Per request: the bookkeeping of the cycle just verified and its newly committed tokens, then the policy's
        plan of the batch. Returns `(plan, proposals, drafting, retained)`: the [`SpeculationPlan`], a list per request
        (a lookup's tokens; empty for drafting ones, filled by the drafter run, and for those that propose nothing),
        `{batch row: most drafts}`, and the ReTrace suffixes kept."""
        proposals: list[list[int]] = [[] for _ in range(step.size)]
        retained, requests, anchors = [], [], {}
        for i, req_id in enumerate(step.req_ids):
            verified = self._bookkeep(step, i, context_features, retained)
            if verified is None:
                continue
            tokens = committed_tokens(self.runner.input_batch, step, i, *verified)
            self._commit(req_id, tokens)
            room = self._room(req_id, len(tokens))
            if self._writes_stats:  # whether a request ended only decides when the stats file is written
                self._request_ended |= room < 0 or self._stopped(req_id, tokens[-1 - verified[1] :])
            cap = min(room, max_verified)
            if cap > 0:
                requests.append((req_id, tokens, cap))
                anchors[req_id] = (i, len(tokens) - 1)
        ids = (req_id for req_id, _, _ in requests)  # a new request at a load running plain: it probes again soon
        self._plain = self.fallback is not None and self.fallback.choose(len(requests), ids) == PLAIN
        if self._plain:  # no lookups, no plan: every request verifies nothing
            self._counted_waiting = 0
            return None, proposals, {}, retained
        started = prefill_left(self.runner.input_batch, step)
        waiting = scheduler_queue.competing_rows(self.waiting_prefill_rows, started, step.size, max_verified,
                                                 self.speculation.max_rows)  # fmt: skip
        plan = self.speculation.plan(requests, started + waiting)
        self._counted_waiting = waiting
        if self.fallback is not None:  # where the plans expect little over a plain step, the fallback probes sooner
            self.fallback.expect(len(requests), plan.step.predicted_gain)
        drafting: dict[int, int] = {}  # batch index -> most drafts to verify
        for req_id, (i, anchor) in anchors.items():
            action = plan.action(req_id)
            if action[0] == "lookup":
                proposals[i] = list(action[1])
                self.pending[req_id] = Pending(STATS_NAMES.get(action[2], action[2]), anchor, len(action[1]))
            elif action[0] == "draft":
                drafting[i] = action[1]
                self.pending[req_id] = Pending(DRAFTER, anchor, 0)
        return plan, proposals, drafting, retained

    def _commit(self, req_id: str, tokens: np.ndarray) -> None:
        """Hands the policy `req_id`'s tokens committed since its last step (its prompt first, on first sight)."""
        seen = self.committed.get(req_id)
        if seen is None:
            seen = self.runner.requests[req_id].num_prompt_tokens
            self.speculation.start(req_id, tokens[:seen])
        self.speculation.commit(req_id, tokens[seen:])
        self.committed[req_id] = len(tokens)

    def _stopped(self, req_id: str, new_tokens: np.ndarray) -> bool:
        """Whether `req_id` committed one of its stop tokens (EOS included) among `new_tokens`."""
        stop = getattr(self.runner.requests[req_id].sampling_params, "all_stop_token_ids", None)
        return bool(stop) and any(int(t) in stop for t in new_tokens)

    def _drop_finished(self) -> None:
        """Frees the state of requests that left the runner (finished or aborted), the policy's included."""
        drop_finished(self.pending, self.runner.requests)
        for req_id in drop_finished(self.committed, self.runner.requests):
            self.speculation.finish(req_id)

    def _bookkeep(self, step: StepBatch, i: int, context_features, retained: list) -> tuple[int, int] | None:
        """Scores request `i`'s previous proposal if this step verified it, and appends the ReTrace suffix it keeps
        to `retained`. Returns `(committed, accepted)`: tokens committed through the cycle's first input, and drafts
        accepted (0 at a prefill); `None` for a prefill chunk that is not the last (its proposal would be dropped)."""
        input_batch = self.runner.input_batch
        rows = step.query_start[i + 1] - step.query_start[i]
        committed = int(input_batch.num_tokens_no_spec[i])  # through this cycle's first input
        computed = int(input_batch.num_computed_tokens_cpu[i])
        decoding = computed == committed - 1
        previous = self.pending.pop(step.req_ids[i], None)
        if not decoding and computed + rows < committed:
            return None
        accepted = rows - 1 - step.rejected[i] if decoding else 0
        self._step_committed += accepted + 1
        if verifies_previous(previous, step, i, decoding):
            self.stats.record(previous.source, accepted + 1)
            self.speculation.outcome(step.req_ids[i], accepted)
            kept = retained_suffix(previous, accepted, step, i, context_features)
            if kept is not None:
                retained.append(kept)
        return committed, accepted

    def _fit_block(self, drafting: dict, cad, req_ids) -> dict:
        """`drafting`, or none when the block would run past `max_model_len` (this step then verifies no drafts)."""
        if drafting and cad.max_seq_len + self.policy.block_size > self.max_model_len:
            for i in drafting:
                self.pending.pop(req_ids[i], None)
            return {}
        return drafting

    def _conditioning(self, retained: list, drafting: dict):
        """The ReTrace conditioning of this step's drafter forward, from the suffixes of the requests that draft."""
        conditioning = block_conditioning(retained, drafting, self.policy.block_size, self.device)
        if conditioning is not None:
            self.stats.conditioned_blocks += sum(r.index in drafting for r in retained)
            self.stats.retained_slots += len(conditioning.rows)
        return conditioning

    def _room(self, req_id: str, num_tokens: int) -> int:
        """Most tokens a cycle may propose so that what it commits fits `max_tokens` and `max_model_len` (the
        transformers side's `max_length - T - 1`)."""
        state = self.runner.requests[req_id]
        limit = self.max_model_len
        max_tokens = getattr(state.sampling_params, "max_tokens", None)
        if max_tokens is not None:
            limit = min(limit, state.num_prompt_tokens + max_tokens)
        return limit - num_tokens - 1

    def _run_drafter(self, plan: SpeculationPlan, drafting: dict, proposals, conditioning, req_ids,
                     step_inputs: dict) -> int:  # fmt: skip
        """Keeps or writes this step's context K/V (context_kv.py), and when a request drafts runs the block forward
        and fills its proposal (and keeps its states for ReTrace). Returns the drafter slots run, `S` (0 when the
        forward is skipped)."""
        if not drafting:  # no block forward: keep the rows (written before the next one, or when due)
            positions, slots = context_rows(self, step_inputs["cad"], step_inputs["target_positions"])
            self.context_kv.add(req_ids, step_inputs["target_hidden_states"], positions, slots)
            if self.context_kv.due(req_ids):
                self._write_kept_context()
            self.clock.lap("context_kv")
            return 0
        num_tokens, block_cad = prepare_block_inputs(self, step_inputs)
        self._write_kept_context()  # older rows first: the block forward writes this step's rows after them
        hidden = block_forward(self, num_tokens, block_cad, conditioning, self.clock.lap)
        self.stats.drafter_forwards += 1
        self._take_drafts(hidden, plan, drafting, proposals, req_ids)
        return num_tokens

    def _write_kept_context(self) -> None:
        """Writes the context rows kept since the last write to the drafter's K/V cache."""
        kept = self.context_kv.take()
        if kept is not None:
            self.model.precompute_and_store_context_kv(*kept)

    def _take_drafts(self, hidden: torch.Tensor, plan: SpeculationPlan, drafting: dict, proposals, req_ids) -> None:
        """Fills the drafting requests' proposals from the block forward's `[N, H]` states: the policy picks how many
        of each one's greedy drafts are verified from their top-1 probabilities."""
        order, drafts, confidence, states = greedy_drafts(
            self.model, hidden, drafting, len(req_ids), self.policy.block_size
        )
        self.clock.lap("drafter")
        counts = self.speculation.num_drafts(plan, {req_ids[i]: confidence[row] for row, i in enumerate(order)})
        for row, i in enumerate(order):
            count = counts[req_ids[i]]
            proposals[i] = drafts[row][:count]
            if count == 0:  # no draft verified: the next step commits 1 token, and counts as this drafter cycle
                self.pending.pop(req_ids[i], None)
                self.stats.record(DRAFTER, 1)  # as the transformers side counts it
                continue
            pending = self.pending[req_ids[i]]
            pending.num_proposed = count
            if self.uses_retrace:
                pending.states = states[row, :count].clone()
        self.clock.lap("policy")

    def _check_prediction(self, step: StepBatch) -> None:
        """Under goodput: the previous plan's prediction against this step, and the cost model's `d(S)` of this
        step's drafter forward beside its time (`S`: the slots that ran, the whole padded batch; an exploring forward,
        which no plan priced, included)."""
        if self.speculation.kind != "goodput":
            return
        model = self.costs.model
        if self._planned is not None:
            self.prediction.add(self._planned, self.last_step, step.req_ids, self._step_committed)
        final = None if self._plain else self.speculation.last_step  # a plain step planned nothing
        self._planned = None
        if final is not None and final.requests:
            planned_ids = frozenset(r.request_id for r in final.requests)
            predicted = final.expected_seconds - float(model.drafter_seconds(final.drafter_slots))
            self._planned = PlannedStep(planned_ids, final.rows, predicted,
                                        final.expected_tokens)  # fmt: skip
        if self.last_step.drafter_slots:  # the model's price of the forward that ran: exploring ones had no plan
            predicted = model.drafter_seconds(self.last_step.drafter_slots)
            self.prediction.add_drafter(predicted, self.last_step.drafter_seconds)
        self.stats.prediction = self.prediction.as_dict()
        self.stats.step_costs = {"source": self.costs.source, "context": list(model.context),
                                 "per_request": model.per_request}  # fmt: skip

    def _observe_fallback(self, decode_only: bool) -> None:
        """Gives the fallback this step's wall time and committed tokens (fallback.py); its state joins the stats
        when they are written (its medians are not worth computing every step)."""
        record = self.last_step
        seconds = (record.engine_seconds or 0.0) + record.propose_seconds
        self.fallback.observe(seconds, self._step_committed, record.decoding, decode_only)
        if self.stats.due(final=self._request_ended):
            self.stats.fallback = self.fallback.as_dict()

    def _finish_step(self, step: StepBatch, drafter_slots: int) -> None:
        """Records the step's `StepRecord`, writes the counters (when a request ended, else at most every
        `stats.WRITE_INTERVAL` seconds), logs every 200 cycles. The stats write is in neither the proposer's nor the
        engine's time."""
        context = step.context_tokens(1 + self.max_verified)  # the decoding requests' rows: prefill chunks left out
        split = step.row_split(1 + self.max_verified)  # (decoding requests, their verified rows, prefill rows)
        decode_rows = split[:2] if split[2] == 0 and split[0] > 0 else None
        self.last_step = self.clock.finish(step.num_rows, step.size, drafter_slots, context, decode_rows, split[0])
        self._check_prediction(step)  # before the model learns from this step: it predicted without it
        if self.step_log.enabled:
            predicted = float(self.costs.model.step_seconds(self.last_step.rows, 0, *context, split[0]))
            verifying = step.num_verifying(1 + self.max_verified)
            self.step_log.write(self.last_step, split, step_costs(self.last_step), predicted, self._step_committed,
                                verifying, self._counted_waiting, self._plain)  # fmt: skip
        counted = self.costs.observe(self.last_step, self.speculation.step_time)  # False: the first or an idle step
        if self.fallback is not None:
            self._observe_fallback(counted and split[2] == 0)
        self.stats.record_step(self.last_step.timings())
        if self.online_datastore is not None and self.stats.due(final=self._request_ended):  # a walk of every index
            self.stats.record_online_datastore_bytes(self.online_datastore.nbytes())
        self.stats.write(final=self._request_ended)
        if sum(self.stats.cycles.values()) // 200 != self._logged:
            self._logged = sum(self.stats.cycles.values()) // 200
            logger.info(self.stats.log_line())
        self.clock.close()

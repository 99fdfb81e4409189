"""The hf-retrace drafting policy as a vLLM proposer, built on vLLM's DFlash proposer.

Each engine step, for every request in the batch (in this order):
1. Bookkeeping of the cycle just verified: the target ran `[a, d1 .. dm]` (padded mode keeps the rows of rejected
   drafts), `n` drafts were accepted. If the `m` drafts came from the drafter and ReTrace is on, the retained
   rejected suffix (slots `j = n+2 .. m`, `L = m-1-n` of them) and the target's features at verification rows
   `j-1` become the next block's conditioning of mask slots `1..L` (the same slots as the transformers
   side's `build_rejected_trajectory`, with `B` there being the verified length `m+1`).
2. Proposal from the committed context: the candidate sources in registry order (prompt lookup, else the datastore
   walk: `policy.lookup`), else the drafter.
3. One drafter forward for the batch when any request drafts: the full trained block (anchor + `B-1` masks), of
   which the first `k` drafts are proposed. The target's features of every committed position are written to the
   drafter's context K/V cache every step, lookup cycles included, so a lookup never leaves a hole in its context.

`num_speculative_tokens` (vLLM's `K`) is the most tokens a cycle verifies: drafter cycles verify
`min(K, num_assistant_tokens)` drafts, lookups at most `K` tokens.
"""

from dataclasses import dataclass

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer

from .model import BlockConditioning
from .policy import DraftPolicy, lookup, policy_sources
from .stats import ProposerStats


logger = init_logger(__name__)


@dataclass
class _Pending:
    """What a request was proposed at its last step, to score it when the target has verified it."""

    source: str  # "lookup" | "datastore" | "draft"
    anchor_position: int  # position of the cycle's first verification input (the committed token)
    num_proposed: int  # m
    states: torch.Tensor | None = None  # [m, H] post-norm drafter states of mask slots 1..m (ReTrace on, drafts)


class ReTraceDFlashProposer(DFlashProposer):
    """vLLM's `DFlashProposer` with the hf-retrace policy in front and ReTrace conditioning (module docstring)."""

    def __init__(self, vllm_config, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        self.policy = DraftPolicy.from_hf_config(self.draft_model_config.hf_config)
        self.max_verified = self.speculative_config.num_speculative_tokens  # K
        if self.speculative_config.disable_padded_drafter_batch:
            raise ValueError(
                "hf-retrace drafters need vLLM's padded drafter batch (it keeps the target's features of rejected "
                "drafts, which ReTrace and the bookkeeping read): drop disable_padded_drafter_batch from "
                "speculative_config"
            )
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
        self._size_for_block()
        vocab_size = self.draft_model_config.hf_config.vocab_size
        self.sources = policy_sources(self.policy, self.draft_model_config.model, vocab_size)  # index built here
        self.uses_retrace = self.policy.retrace_mode != "off"
        self.pending: dict[str, _Pending] = {}  # by request id; dropped when the request leaves the runner
        self.stats = ProposerStats()

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
        self._last_draft_probs = None
        cad = common_attn_metadata
        batch = cad.batch_size()
        max_verified = min(int(num_speculative_tokens), self.max_verified)
        context_features = self.model.combine_hidden_states(target_hidden_states)  # [C, H]: fc of the features
        query_start = cad.query_start_loc_cpu[: batch + 1].tolist()
        rejected = [0] * batch if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:batch].tolist()
        positions = target_positions.cpu()
        token_ids = target_token_ids.cpu()
        next_ids = next_token_ids[:batch].tolist()
        input_batch = self.runner.input_batch
        req_ids = input_batch.req_ids[:batch]
        for req_id in [r for r in self.pending if r not in self.runner.requests]:  # finished or aborted
            del self.pending[req_id]

        proposals: list[list[int]] = [[] for _ in range(batch)]
        drafting: dict[int, int] = {}  # batch index -> drafts to propose
        cond_rows, cond_states, cond_targets = [], [], []
        for i, req_id in enumerate(req_ids):
            start, rows = query_start[i], query_start[i + 1] - query_start[i]
            committed = int(input_batch.num_tokens_no_spec[i])  # through this cycle's first input
            computed = int(input_batch.num_computed_tokens_cpu[i])
            decoding = computed == committed - 1
            previous = self.pending.pop(req_id, None)
            if not decoding and computed + rows < committed:
                continue  # a prefill chunk that is not the last: its proposal would be dropped
            accepted = rows - 1 - rejected[i] if decoding else 0
            if (
                decoding and previous is not None and previous.num_proposed == rows - 1
                and previous.anchor_position == int(positions[start])
            ):  # fmt: skip
                self.stats.record(previous.source, accepted + 1)
                retained = previous.num_proposed - 1 - accepted  # L
                if previous.states is not None and retained > 0:
                    # next slot s = 1..L holds slot s+n+1's state and the features of verification row s+n
                    cond_rows.append((i, retained))
                    cond_states.append(previous.states[accepted + 1 : previous.num_proposed])
                    first = start + accepted + 1
                    cond_targets.append(context_features[first : first + retained])
            tokens = np.concatenate([
                input_batch.token_ids_cpu[i, :committed],
                token_ids[start + 1 : start + 1 + accepted].numpy(),
                [next_ids[i]],
            ]).astype(np.int64)  # fmt: skip
            room = self._room(req_id, len(tokens))
            if room <= 0:
                continue
            anchor = len(tokens) - 1
            proposal, source = self._lookup(tokens, min(room, max_verified))
            if proposal is not None:
                proposals[i] = proposal
                self.pending[req_id] = _Pending(source, anchor, len(proposal))
            else:
                drafting[i] = min(room, max_verified, self.num_drafts_verified)
                self.pending[req_id] = _Pending("draft", anchor, 0)

        if drafting and cad.max_seq_len + self.policy.block_size > self.max_model_len:
            for i in drafting:  # the block would run past max_model_len: this step verifies no drafts
                self.pending.pop(req_ids[i], None)
            drafting = {}
        keep = {i for i, _ in cond_rows} & set(drafting)
        conditioning = None
        if keep:
            block = self.policy.block_size
            rows = [i * block + s for (i, length) in cond_rows if i in keep for s in range(1, length + 1)]
            states = [s for (i, _), s in zip(cond_rows, cond_states) if i in keep]
            targets = [t for (i, _), t in zip(cond_rows, cond_targets) if i in keep]
            conditioning = BlockConditioning(
                rows=torch.tensor(rows, dtype=torch.long, device=self.device),
                states=torch.cat(states), target_context=torch.cat(targets),
            )  # fmt: skip
            self.stats.conditioned_blocks += len(keep)
            self.stats.retained_slots += len(rows)
        self._run_block(
            drafting, proposals, conditioning, req_ids, target_token_ids, next_token_ids, target_positions,
            context_features, cad, num_rejected_tokens_gpu,
        )  # fmt: skip
        self.stats.write()
        if sum(self.stats.cycles.values()) // 200 != getattr(self, "_logged", 0):
            self._logged = sum(self.stats.cycles.values()) // 200
            logger.info(self.stats.log_line())
        return proposals

    def _room(self, req_id: str, num_tokens: int) -> int:
        """Most tokens a cycle may propose so that what it commits fits `max_tokens` and `max_model_len` (the
        transformers side's `max_length - T - 1`)."""
        state = self.runner.requests[req_id]
        limit = self.max_model_len
        max_tokens = getattr(state.sampling_params, "max_tokens", None)
        if max_tokens is not None:
            limit = min(limit, state.num_prompt_tokens + max_tokens)
        return limit - num_tokens - 1

    def _lookup(self, tokens: np.ndarray, max_tokens: int) -> tuple[list[int] | None, str]:
        return lookup(self.sources, tokens, max_tokens)  # the shared candidate sources, vLLM-free (policy.py)

    def _run_block(
        self, drafting, proposals, conditioning, req_ids, target_token_ids, next_token_ids, target_positions,
        context_features, cad, num_rejected_tokens_gpu,
    ) -> None:  # fmt: skip
        """Writes this step's context K/V, and when a request drafts runs the block forward and fills its
        proposal (and keeps its states for ReTrace)."""
        self.num_speculative_tokens = self.block_drafts
        num_tokens, _, block_cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids, target_positions=target_positions,
            target_hidden_states=context_features, token_indices_to_sample=None, cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )  # fmt: skip
        if not drafting:  # lookup cycles only: keep the drafter's context complete, skip its forward
            num_context = self._dflash_num_context
            self.model.precompute_and_store_context_kv(
                context_features, self._context_positions_buffer[:num_context],
                self._context_slot_mapping_buffer[:num_context],
            )  # fmt: skip
            return
        _, per_layer = self.build_per_group_and_layer_attn_metadata(block_cad)
        mode, num_input_tokens, across_dp = self._determine_batch_execution_and_padding(num_tokens)
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(num_tokens, num_input_tokens, None)
        self.model.conditioning = conditioning
        try:
            with set_forward_context(
                per_layer, self.vllm_config, num_tokens=num_input_tokens, num_tokens_across_dp=across_dp,
                cudagraph_runtime_mode=mode,
                slot_mapping=self._get_slot_mapping(slot_mapping_size, block_cad.slot_mapping),
            ):  # fmt: skip
                hidden = self.model(**model_kwargs)
        finally:
            self.model.conditioning = None
        self.stats.drafter_forwards += 1
        block = self.policy.block_size
        blocks = hidden[: len(req_ids) * block].view(len(req_ids), block, -1)  # [b, B, H]
        order = sorted(drafting)
        k_max = max(drafting.values())
        states = blocks[order, 1 : 1 + k_max]  # [d, k, H]: mask slots 1..k
        logits = self.model.compute_logits(states.reshape(-1, states.shape[-1]))  # [d * k, V]
        logits = logits.view(len(order), k_max, -1)
        drafts = logits.argmax(dim=-1).tolist()  # greedy drafts (exact for sampling too: q is one-hot)
        keep = [k_max] * len(order)
        if self.policy.confidence_threshold is not None:
            confident = logits.float().softmax(-1).amax(-1) >= self.policy.confidence_threshold  # [d, k]
            keep = confident.int().cumprod(dim=-1).sum(dim=-1).tolist()
        for row, i in enumerate(order):
            count = min(drafting[i], keep[row])
            proposals[i] = drafts[row][:count]
            if count == 0:  # no confident draft: the next step commits 1 token, and counts as this drafter cycle
                self.pending.pop(req_ids[i], None)
                self.stats.record("draft", 1)  # as the transformers side counts it
                continue
            pending = self.pending[req_ids[i]]
            pending.num_proposed = count
            if self.uses_retrace:
                pending.states = states[row, :count].clone()

"""Bookkeeping of the cycles the target verified, and the ReTrace state the next drafter block is conditioned on.

Every engine step the proposer reads, per request, what the target just verified (`[a, d1 .. dm]`, `n` drafts
accepted: padded mode keeps the rows of rejected drafts), scores the proposal it made at the previous step, and
keeps the retained rejected suffix of a drafted block (slots `j = n+2 .. m`, `L = m-1-n` of them) with the target's
features at verification rows `j-1`: the conditioning of the next block's mask slots `1..L` (the same slots as the
transformers side's `build_rejected_trajectory`, with `B` there being the verified length `m+1`).

These functions read vLLM's runner state (`input_batch`, `requests`); `contract.PRIVATE_ATTRIBUTES` lists every name
they read, checked when the proposer is built.
"""

from dataclasses import dataclass

import numpy as np
import torch

from .model import BlockConditioning


@dataclass
class Pending:
    """What a request was proposed at its last step, to score it when the target has verified it."""

    source: str  # "lookup" | "datastore" | "draft"
    anchor_position: int  # position of the cycle's first verification input (the committed token)
    num_proposed: int  # m
    states: torch.Tensor | None = None  # [m, H] post-norm drafter states of mask slots 1..m (ReTrace on, drafts)


@dataclass
class Retained:
    """The rejected suffix of request `index`'s last drafted block, kept for its next block (`L` slots).

    Attributes:
        index (`int`): the request's row in this step's batch.
        states (`torch.Tensor` of shape `(L, hidden)`): post-norm drafter states of slots `n+2 .. m`.
        target_context (`torch.Tensor` of shape `(L, hidden)`): `fc` of the target's features at rows `n+1 .. m-1`.
    """

    index: int
    states: torch.Tensor
    target_context: torch.Tensor


@dataclass
class StepBatch:
    """Host copies of one engine step's verification inputs (vLLM's padded drafter batch).

    Attributes:
        req_ids (`list[str]`): the batch's requests, in row order.
        query_start (`list[int]`): `batch + 1` offsets of each request's verification rows in the step's `R` rows.
        rejected (`list[int]`): drafts the target rejected, per request.
        positions (`torch.LongTensor` of shape `(R,)`): positions of the verification rows.
        token_ids (`torch.LongTensor` of shape `(R,)`): tokens of the verification rows.
        next_ids (`list[int]`): the token each request commits after its accepted drafts (bonus or correction).
    """

    req_ids: list
    query_start: list
    rejected: list
    positions: torch.Tensor
    token_ids: torch.Tensor
    next_ids: list

    @property
    def size(self) -> int:
        return len(self.req_ids)

    @property
    def num_rows(self) -> int:
        """`R`: the rows the target verified this step."""
        return int(self.query_start[-1]) if self.query_start else 0

    def context_tokens(self, max_query_rows: int) -> tuple[int, int]:
        """`(K, X)`: the context tokens the decoding requests' rows read (a row at position `p` reads `p + 1`), summed
        over each request's first row and over its verified rows. A request of more than `max_query_rows` rows
        (`1 + num_speculative_tokens`) is prefilling and left out: a prompt chunk's attention grows with its rows,
        which `t(R)` prices, and its huge `X` would drown the decoding rows' signal."""
        first = other = 0
        positions = self.positions.tolist()
        for start, end in zip(self.query_start[:-1], self.query_start[1:]):
            if end - start <= max_query_rows:
                first += positions[start] + 1
                other += sum(positions[start + 1 : end]) + (end - start - 1)
        return first, other

    def row_split(self, max_query_rows: int) -> tuple[int, int, int]:
        """`(n, V, P)`: the decoding requests (at most `max_query_rows` rows each), their rows beyond the first (their
        verified tokens), and the rows of the requests still prefilling (their prompt chunks)."""
        n = other = prefill = 0
        for start, end in zip(self.query_start[:-1], self.query_start[1:]):
            if end - start <= max_query_rows:
                n, other = n + 1, other + end - start - 1
            else:
                prefill += end - start
        return n, other, prefill

    def num_verifying(self, max_query_rows: int) -> int:
        """Decoding requests (at most `max_query_rows` rows) that verify at least one proposed token (two rows or
        more)."""
        rows = (end - start for start, end in zip(self.query_start[:-1], self.query_start[1:]))
        return sum(1 for r in rows if 1 < r <= max_query_rows)


def read_step_batch(
    input_batch, cad, target_token_ids, target_positions, next_token_ids, num_rejected_tokens_gpu
) -> StepBatch:
    """Copies to host what the bookkeeping reads of `propose()`'s arguments and the runner's `input_batch`."""
    batch = cad.batch_size()
    rejected = [0] * batch if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:batch].tolist()
    return StepBatch(
        req_ids=input_batch.req_ids[:batch], query_start=cad.query_start_loc_cpu[: batch + 1].tolist(),
        rejected=rejected, positions=target_positions.cpu(), token_ids=target_token_ids.cpu(),
        next_ids=next_token_ids[:batch].tolist(),
    )  # fmt: skip


def drop_finished(states: dict, requests) -> list:
    """Frees the state (`{request id: ...}`) of requests that left the runner (finished or aborted). Returns their
    ids."""
    gone = [r for r in states if r not in requests]
    for req_id in gone:
        del states[req_id]
    return gone


def prefill_left(input_batch, step: StepBatch) -> int:
    """Prompt rows still to prefill after this step, over the requests whose chunk this step was not their last: the
    prefill the next step carries at least (requests still waiting in the scheduler are not in the runner's batch).

    A request prefills when it has computed fewer than all but its last committed token; after this step's rows it
    has `num_tokens_no_spec - num_computed - rows` prompt tokens left.
    """
    left = 0
    for i in range(step.size):
        rows = step.query_start[i + 1] - step.query_start[i]
        committed = int(input_batch.num_tokens_no_spec[i])
        computed = int(input_batch.num_computed_tokens_cpu[i])
        if computed < committed - 1:
            left += max(committed - computed - rows, 0)
    return left


def verifies_previous(previous: Pending | None, step: StepBatch, i: int, decoding: bool) -> bool:
    """Whether this step verified request `i`'s previous proposal (not a prefill, nor a proposal vLLM dropped, nor
    one of another length or anchor)."""
    if not decoding or previous is None:
        return False
    start, rows = step.query_start[i], step.query_start[i + 1] - step.query_start[i]
    return previous.num_proposed == rows - 1 and previous.anchor_position == int(step.positions[start])


def retained_suffix(previous: Pending, accepted: int, step: StepBatch, i: int, context_features) -> Retained | None:
    """The ReTrace state request `i` keeps for its next block after `accepted` of `previous`'s drafts: next slot
    `s = 1..L` holds slot `s+n+1`'s state and the features of verification row `s+n`."""
    retained = previous.num_proposed - 1 - accepted  # L
    if previous.states is None or retained <= 0:
        return None
    first = step.query_start[i] + accepted + 1
    return Retained(
        i, previous.states[accepted + 1 : previous.num_proposed], context_features[first : first + retained]
    )


def committed_tokens(input_batch, step: StepBatch, i: int, committed: int, accepted: int) -> np.ndarray:
    """`[T]` request `i`'s tokens once this step commits: the context through the cycle's first input, the accepted
    drafts, then the bonus/correction token."""
    start = step.query_start[i]
    return np.concatenate([
        input_batch.token_ids_cpu[i, :committed],
        step.token_ids[start + 1 : start + 1 + accepted].numpy(),
        [step.next_ids[i]],
    ]).astype(np.int64)  # fmt: skip


def block_conditioning(retained: list[Retained], drafting, block_size: int, device) -> BlockConditioning | None:
    """Gathers the retained suffixes of the requests that draft this step into one drafter forward's conditioning
    (rows block-major, `i * B + s`), or `None` when none does."""
    kept = [r for r in retained if r.index in drafting]
    if not kept:
        return None
    rows = [r.index * block_size + s for r in kept for s in range(1, len(r.states) + 1)]
    return BlockConditioning(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        states=torch.cat([r.states for r in kept]), target_context=torch.cat([r.target_context for r in kept]),
    )  # fmt: skip

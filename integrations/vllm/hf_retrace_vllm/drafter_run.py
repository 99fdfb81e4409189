"""The drafter's part of an engine step, on vLLM's DFlash machinery: the inputs of the step's `R` context rows,
and the block forward (anchor + `B-1` mask slots a request) with its greedy drafts.

The context rows of steps without a block forward are kept and written later (context_kv.py). `contract.HOOKS` and
`contract.PRIVATE_ATTRIBUTES` list the vLLM methods and buffers used here.
"""

import numpy as np
import torch
from vllm.forward_context import set_forward_context


def prepare_block_inputs(proposer, step_inputs: dict):
    """Fills the proposer's query buffers for one block a request (`B` query slots each) from the step's verified
    rows. Returns `(num_query_tokens, block_cad)` (vLLM's `DFlashProposer.set_inputs_first_pass`)."""
    proposer.num_speculative_tokens = proposer.block_drafts  # the parent sizes blocks by it
    num_tokens, _, block_cad = proposer.set_inputs_first_pass(token_indices_to_sample=None, **step_inputs)
    return num_tokens, block_cad


def context_rows(proposer, cad, target_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(positions [R], slots [R])` of the step's `R` context rows in the drafter's K/V cache, as vLLM's input kernel
    (`_copy_and_expand_dflash_inputs`, from `set_inputs_first_pass`) writes them to its context buffers: a row of
    request `i` at position `p` goes to slot `block_table[i, p // block_size] * block_size + p % block_size` (the block
    index clamped to the table). A step with no block forward needs these alone, not the kernel's query buffers.
    In numpy on the host tensors' memory: a dozen small torch calls cost as much as the kernel."""
    batch = cad.batch_size()
    starts = cad.query_start_loc_cpu[: batch + 1].numpy()
    request = np.repeat(np.arange(batch), np.diff(starts))  # [R]: each row's request
    positions = target_positions[: request.shape[0]].numpy().astype(np.int64)
    table, block_size = cad.block_table_tensor.numpy(), proposer.block_size
    block = np.minimum(positions // block_size, table.shape[1] - 1)
    slots = table[request, block].astype(np.int64) * block_size + positions % block_size
    return (torch.from_numpy(positions).to(proposer._context_positions_buffer.dtype),
            torch.from_numpy(slots).to(proposer._context_slot_mapping_buffer.dtype))  # fmt: skip


def block_forward(proposer, num_tokens: int, block_cad, conditioning, timer) -> torch.Tensor:
    """Writes the context K/V (`build_model_inputs_first_pass` does), then runs the block forward with the ReTrace
    `conditioning` (or `None`). Returns `[num_tokens, H]` post-norm drafter states. `timer(part)` is called after
    the context write (`"context_kv"`) and after the forward (`"drafter"`)."""
    _, per_layer = proposer.build_per_group_and_layer_attn_metadata(block_cad)
    mode, num_input_tokens, across_dp = proposer._determine_batch_execution_and_padding(num_tokens)
    model_kwargs, slot_mapping_size = proposer.build_model_inputs_first_pass(num_tokens, num_input_tokens, None)
    timer("context_kv")
    proposer.model.conditioning = conditioning
    try:
        with set_forward_context(
            per_layer, proposer.vllm_config, num_tokens=num_input_tokens, num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=proposer._get_slot_mapping(slot_mapping_size, block_cad.slot_mapping),
        ):  # fmt: skip
            return proposer.model(**model_kwargs)
    finally:
        proposer.model.conditioning = None


def greedy_drafts(model, hidden: torch.Tensor, drafting: dict, batch: int, block_size: int):
    """The greedy drafts of the requests that draft, with their top-1 probabilities (what the policy sizes the
    verification by: the confidence stop, or the goodput rule).

    Args:
        model: the drafter (`greedy_top1` maps states to greedy target token ids and their probabilities).
        hidden (`torch.Tensor` of shape `(N, H)`): the block forward's states, `batch` blocks of `block_size` first.
        drafting (`dict[int, int]`): batch row -> most drafts to propose.

    Returns:
        `(order, drafts, confidence, states)`: the drafting rows in order, their `k_max` greedy drafts each,
        `np.ndarray` of shape `(d, k_max)` the drafter's top-1 probability per draft, and `[d, k_max, H]` the states
        of mask slots `1..k_max`.
    """
    blocks = hidden[: batch * block_size].view(batch, block_size, -1)  # [b, B, H]
    order = sorted(drafting)
    k_max = max(drafting.values())
    states = blocks[order, 1 : 1 + k_max]  # [d, k, H]: mask slots 1..k
    drafts, confidence = model.greedy_top1(states.reshape(-1, states.shape[-1]))  # [d * k] each
    drafts = drafts.view(len(order), k_max).tolist()  # greedy drafts (exact for sampling too: q is one-hot)
    confidence = confidence.view(len(order), k_max).cpu().numpy()  # [d, k]
    return order, drafts, confidence, states

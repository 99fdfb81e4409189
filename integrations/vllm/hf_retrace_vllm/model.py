"""`DFlashReTraceDraftModel`: vLLM's DFlash Qwen3 drafter plus the hf-retrace terms on the mask-slot inputs.

- anchor term (`anchor_broadcast.weight`, `W_a`): every mask slot of a block gets `+ W_a e_0`, `e_0` the block's
  anchor embedding (transformers side: `AnchorBroadcast`);
- ReTrace conditioning (`retrace.correction.weight` `W_c`, `retrace.gate` `g`, `retrace.value_proj.weight` `W_v`):
  mask slots `1..L` of a block get the previous cycle's retained drafter states `h_j`, corrected with the target's
  verification features `t_j` (`docs/design.md`; transformers side: `ReTraceTrajectoryEncoder`):

      h~_j = h_j + W_c([h_j ; t_j])     (mode "corrected" only)
      e'_j = e_j + g * W_v(h~_j)        (mode "overwrite": e'_j = h_j)

The reduced draft vocabulary (`draft_vocab_size`, `lm_head.weight` `[K, H]`, `d2t`) is vLLM's own
(`DFlashQwen3ForCausalLM.compute_logits`); the drafts and their probabilities are read over its `K` logits
(`greedy_top1`).
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from .policy import DraftPolicy


DATASTORE_TENSOR = "token_ids"  # the one tensor of datastore.safetensors (`docs/formats.md`)


@dataclass
class BlockConditioning:
    """ReTrace inputs of one drafter forward, gathered over the batch.

    Attributes:
        rows (`torch.LongTensor` of shape `(M,)`): query rows (block-major: request `i`'s slot `s` is `i * B + s`).
        states (`torch.Tensor` of shape `(M, hidden)`): retained post-norm drafter states `h_j`.
        target_context (`torch.Tensor` of shape `(M, hidden)`): `fc` of the target's verification features `t_j`
            (before `hidden_norm`, which the model applies).
    """

    rows: torch.Tensor
    states: torch.Tensor
    target_context: torch.Tensor


class DFlashReTraceDraftModel(DFlashQwen3ForCausalLM):
    """vLLM DFlash drafter with the anchor term and ReTrace modules of an hf-retrace export (`docs/formats.md`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.policy = DraftPolicy.from_hf_config(self.config)
        hidden, dtype = self.config.hidden_size, vllm_config.model_config.dtype
        self.block_size = self.policy.block_size
        self.retrace_mode = self.policy.retrace_mode

        def param(*shape):
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.anchor_weight = param(hidden, hidden) if self.policy.anchor_broadcast else None  # W_a [H_out, H_in]
        if self.retrace_mode != "off":
            self.retrace_correction = param(hidden, 2 * hidden)  # W_c
            self.retrace_gate = param(hidden)  # g
            self.retrace_value_proj = param(hidden, hidden)  # W_v
        self._extra_weights = {
            "anchor_broadcast.weight": self.anchor_weight,
            "retrace.correction.weight": getattr(self, "retrace_correction", None),
            "retrace.gate": getattr(self, "retrace_gate", None),
            "retrace.value_proj.weight": getattr(self, "retrace_value_proj", None),
        }
        self.conditioning: BlockConditioning | None = None  # set by the proposer around one forward

    def greedy_top1(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[N, hidden]` drafter states -> `([N]` greedy drafts as target token ids, `[N]` their probabilities`)`.

        With a reduced draft vocabulary both are taken over its `K` logits: `compute_logits` spreads them into the
        target's `V` with `-inf` elsewhere, which moves neither the argmax nor the softmax's top probability, and
        costs a `[N, V]` fill and a softmax `V / K` times wider (6x for the shipped cards). Draft id `i` is target
        id `i + d2t[i]`, increasing in `i` (the export sorts the ids), so ties resolve alike."""
        logits = self.logits_processor(self.lm_head, states)  # [N, K]
        drafts = logits.argmax(dim=-1)
        if self.draft_id_to_target_id is not None:
            drafts = drafts + self.draft_id_to_target_id[drafts]
        return drafts, logits.float().softmax(-1).amax(-1)

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`[N]` query tokens (whole blocks of `B`, anchor first, from the proposer; other `N` in dummy runs) ->
        `[N, hidden]` post-norm drafter states."""
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_input_ids(input_ids)
        inputs_embeds = self.block_inputs(inputs_embeds)
        return self.model(input_ids, positions, inputs_embeds)

    def block_inputs(self, embeds: torch.Tensor) -> torch.Tensor:
        """Adds the anchor term, then the ReTrace conditioning, to `[N, hidden]` query embeddings."""
        rows, hidden = embeds.shape
        block = self.block_size
        if self.anchor_weight is not None and rows % block == 0:  # dummy runs may not be whole blocks
            blocks = embeds.view(rows // block, block, hidden)
            anchor = nn.functional.linear(blocks[:, :1], self.anchor_weight)  # [n, 1, H]
            slot_is_mask = (torch.arange(block, device=embeds.device) > 0).view(1, block, 1)
            embeds = (blocks + anchor * slot_is_mask).view(rows, hidden)
        cond = self.conditioning
        if cond is not None and self.retrace_mode != "off" and cond.rows.numel():
            states = cond.states.to(embeds.dtype)
            if self.retrace_mode == "overwrite":
                new_rows = states
            else:
                if self.retrace_mode == "corrected":
                    target = self.model.hidden_norm(cond.target_context.to(embeds.dtype))
                    states = states + nn.functional.linear(torch.cat([states, target], dim=-1), self.retrace_correction)
                new_rows = embeds[cond.rows] + self.retrace_gate * nn.functional.linear(states, self.retrace_value_proj)
            embeds = embeds.index_copy(0, cond.rows, new_rows)
        return embeds

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Loads the hf-retrace tensors here and hands the rest to vLLM's DFlash loader."""
        seen = set()

        def backbone():
            for name, tensor in weights:
                if name == DATASTORE_TENSOR:
                    continue  # vLLM loads every *.safetensors of the folder, datastore.safetensors included
                if name in self._extra_weights:
                    target = self._extra_weights[name]
                    if target is None:
                        continue  # e.g. retrace.* of a folder whose config says retrace_mode off
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ValueError(
                            f"{name} has shape {tuple(tensor.shape)}, the drafter config needs {tuple(target.shape)}"
                        )
                    target.data.copy_(tensor.to(target.dtype))
                    seen.add(name)
                else:
                    yield name, tensor

        loaded = super().load_weights(backbone())
        missing = [name for name, param in self._extra_weights.items() if param is not None and name not in seen]
        if missing:
            raise ValueError(
                f"the drafter folder lacks {missing}, which its config.json's hf_retrace block needs "
                "(anchor_broadcast / retrace_mode); export it again with `hf-retrace export --format vllm`"
            )
        if hasattr(self, "has_own_embed_tokens") and not self.has_own_embed_tokens and get_pp_group().world_size == 1:
            self._release_own_embedding()  # the cases in which vLLM's proposer shares the target's embedding
        return loaded

    def _release_own_embedding(self) -> None:
        """Turns this model's own embedding table into a meta tensor (no storage) before vLLM post-processes weights.

        An export carries no `embed_tokens`: right after loading, vLLM's proposer replaces this module by the
        target's embedding. On CPU, vLLM's weight post-processing would first build a oneDNN GEMM
        handle for the table (it doubles as an LM head there). The replaced module sits in a reference cycle, so the
        handle is freed by the garbage collector at some later allocation, and when that lands inside
        torch.compile's tracing its `__del__` (`handler_tensor.item()`) recurses without end: "Fatal Python error:
        _Py_CheckRecursiveCall" when an engine restarts on its compile cache. A meta weight gets no handle (vLLM
        skips them), frees the table's memory, and keeps the shape that vLLM's sharing check compares.
        """
        embed = self.model.embed_tokens
        embed.weight = nn.Parameter(torch.empty_like(embed.weight, device="meta"), requires_grad=False)

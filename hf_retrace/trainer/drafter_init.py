# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Warm start of a fresh drafter from its target (`drafter_init="target"` in [`ReTraceConfig`]).

A random drafter starts far from anything useful: its residual stream carries the block's input embeddings straight
to the tied lm head, so step 0 predicts the input token itself with huge confidence (loss ~50 on SmolLM2). On a small
compute budget, starting from the target's own top of stack converges much faster:

- `layers[i]` <- the target's last `num_hidden_layers` decoder layers, parameter by parameter where names and shapes
  match (q/k/v/o, MLP, both layer norms); modules the target lacks (Llama has no QK-norm) keep their fresh init;
- `norm` <- the target's final norm, so logits start at the target's own scale;
- `fc` <- a selector of the deepest target layer read (identity on its slice, zero on the others), so the drafter's
  context starts as that layer's (normalised) hidden states, the nearest thing to the target's final state.
"""

import torch
from torch import nn


@torch.no_grad()
def init_drafter_from_target(drafter: nn.Module, target: nn.Module) -> list[str]:
    """Copies the target's top layers, final norm and a deepest-layer selector into a fresh `drafter`, in place.

    Args:
        drafter ([`ReTraceDrafterModel`]): fresh drafter sized for `target` (same hidden size).
        target (`PreTrainedModel`): the target `*ForCausalLM`.
    Returns:
        `list[str]`: drafter parameter names that were copied (the rest keep their init).
    Raises:
        ValueError: if the hidden sizes differ or the target has fewer layers than the drafter.
    """
    config = drafter.config
    decoder = target.get_decoder()
    target_layers = getattr(decoder, "layers", None)
    hidden = target.config.get_text_config().hidden_size
    if hidden != config.hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} != target hidden_size {hidden}")
    if target_layers is None or len(target_layers) < config.num_hidden_layers:
        raise ValueError("drafter_init='target' needs a target with at least as many decoder layers as the drafter")
    copied = []
    offset = len(target_layers) - config.num_hidden_layers  # drafter layer i <- target layer offset + i
    for i, layer in enumerate(drafter.layers):
        source = dict(target_layers[offset + i].named_parameters())
        for name, param in layer.named_parameters():
            if name in source and source[name].shape == param.shape:
                param.copy_(source[name].to(param.dtype))
                copied.append(f"layers.{i}.{name}")
    final_norm = getattr(decoder, "norm", None)
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(final_norm.weight.to(drafter.norm.weight.dtype))
        copied.append("norm.weight")
    deepest = config.target_layer_ids.index(max(config.target_layer_ids))
    drafter.fc.weight.zero_()  # [H, K*H]: slice k of the input is target layer target_layer_ids[k]
    drafter.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden, dtype=drafter.fc.weight.dtype)
    copied.append("fc.weight")
    return copied


__all__ = ["init_drafter_from_target"]

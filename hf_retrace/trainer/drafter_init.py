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

A trained drafter can also be made deeper without losing what it learned ([`grow_drafter_depth`]): each new layer
is a copy of its last one with both residual-branch output projections zeroed, so it adds exactly zero to the
residual stream and the grown drafter computes the same function until training moves it. It can likewise read
more target layers ([`add_target_layers`]): the new layers' columns of `fc` start at zero.
"""

import copy

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


@torch.no_grad()
def grow_drafter_depth(drafter: nn.Module, num_new_layers: int) -> list[str]:
    """Appends `num_new_layers` function-preserving decoder layers to a trained `drafter`, in place.

    A new layer is a copy of the last one (its attention and MLP start from weights that already read this residual
    stream) with `self_attn.o_proj` and `mlp.down_proj` zeroed: both residual branches then add exactly 0, so logits
    are unchanged at step 0. Gradients still reach the new layer: `d loss / d o_proj` is the attention output, which
    is not zero, and once `o_proj` moves the rest of the layer receives gradient too (LoRA's `B = 0` trick).

    Args:
        drafter ([`ReTraceDrafterModel`]): a loaded drafter; `config.num_hidden_layers` and `config.layer_types`
            are updated, so `save_pretrained` writes the grown shape.
        num_new_layers (`int`): layers to append (>= 1).
    Returns:
        `list[str]`: names of the new layers' parameters.
    """
    if num_new_layers < 1:
        raise ValueError(f"num_new_layers must be >= 1, got {num_new_layers}")
    config, first = drafter.config, len(drafter.layers)
    for index in range(first, first + num_new_layers):
        layer = copy.deepcopy(drafter.layers[-1])
        layer.self_attn.layer_idx = index  # the drafter's context cache is indexed by layer
        for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
            projection.weight.zero_()
            if projection.bias is not None:
                projection.bias.zero_()
        drafter.layers.append(layer)
    config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * num_new_layers
    config.num_hidden_layers = len(drafter.layers)
    return [f"layers.{i}.{name}" for i in range(first, config.num_hidden_layers) for name, _ in drafter.layers[i].named_parameters()]


@torch.no_grad()
def add_target_layers(drafter: nn.Module, target_layer_ids: list[int]) -> list[int]:
    """Makes a trained `drafter` read `target_layer_ids`, a superset of its own, without changing its outputs.

    `fc` maps the concatenated features `[f_{l_1}, .., f_{l_K}]` (`K * H`) to the drafter's context; the new `fc` has a
    `[H, H]` slice per layer of `target_layer_ids`, each old layer's slice copied to its new place and each new layer's
    zero, so the context is unchanged at step 0 while the new slices still get gradient (the features are not zero).

    Args:
        drafter ([`ReTraceDrafterModel`]): a loaded drafter; `config.target_layer_ids` is updated.
        target_layer_ids (`list[int]`): the layers to read, in the order their features are concatenated.
    Returns:
        `list[int]`: the layers added.
    Raises:
        ValueError: if `target_layer_ids` drops one of the drafter's layers, repeats one, or exceeds the target.
    """
    config, hidden = drafter.config, drafter.config.hidden_size
    old = list(config.target_layer_ids)
    new = list(target_layer_ids)
    if len(set(new)) != len(new) or not set(old) <= set(new) or max(new) >= config.num_target_layers or min(new) < 0:
        raise ValueError(
            f"drafter_target_layer_ids {new} must list each of the loaded drafter's target layers {old} once, plus "
            f"the layers to add, all in [0, {config.num_target_layers}); a trained drafter can read more layers, "
            "not fewer"
        )
    weight = drafter.fc.weight  # [H, K*H]: slice k reads target layer old[k]
    grown = weight.new_zeros(hidden, len(new) * hidden)
    for k, layer in enumerate(old):
        j = new.index(layer)
        grown[:, j * hidden : (j + 1) * hidden] = weight[:, k * hidden : (k + 1) * hidden]
    drafter.fc = nn.Linear(len(new) * hidden, hidden, bias=False, device=weight.device, dtype=weight.dtype)
    drafter.fc.weight.copy_(grown)
    config.target_layer_ids = new
    return [layer for layer in new if layer not in old]


__all__ = ["add_target_layers", "grow_drafter_depth", "init_drafter_from_target"]

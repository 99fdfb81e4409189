# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""The frozen target's DFlash context features and block input embeddings: what the pool's feature cache stores
(`hf_retrace.data.pool`) and what training reads (`hf_retrace.trainer.objective`).

The features are exactly what inference reads (`outputs.hidden_states[k + 1]` for `k in target_layer_ids`), but the
target forward stops after the deepest needed layer, so a drafter that reads the middle of the target costs half a
target forward per step.
"""

import torch
from torch import nn


class _StopForward(Exception):
    """Raised by the hook on the deepest needed layer: the rest of the target is not needed."""


def _decoder_layers(target: nn.Module) -> nn.ModuleList | None:
    layers = getattr(target.get_decoder(), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def _partitioned_by_zero3(layers: nn.ModuleList) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the layers: its forward hooks push and pop a module stack, which an
    exception raised mid-forward (the early stop below) would leave unbalanced, so such a forward runs to the end."""
    return hasattr(next(layers.parameters(), None), "ds_id")


@torch.no_grad()
def compute_target_features(
    target: nn.Module,
    input_ids: torch.LongTensor,
    layer_ids: list[int],
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    use_cache: bool = False,
) -> torch.Tensor:
    """Concatenated target features `concat_k hidden_states[k + 1]`, `k in layer_ids` (`docs/design.md`).

    Args:
        target (`PreTrainedModel`): the frozen target (a `*ForCausalLM`; its base decoder is run, never the lm head).
        input_ids (`torch.LongTensor` of shape `(batch, T)`).
        layer_ids (`list[int]`): 0-based target layers, e.g. the drafter's `target_layer_ids`.
        attention_mask (`torch.Tensor`, *optional*): 2D padding mask `(batch, past + T)` or a custom 4D mask.
        position_ids (`torch.LongTensor` of shape `(batch, T)`, *optional*).
        cache (`Cache`, *optional*): a cache holding a prefix (for the faithful verification forward).
        use_cache (`bool`): fill `cache` (or a new `DynamicCache`, returned in `cache` semantics of transformers).
    Returns:
        `torch.Tensor` of shape `(batch, T, len(layer_ids) * hidden)` in the target's dtype.
    """
    decoder = target.get_decoder()
    num_layers = target.config.get_text_config().num_hidden_layers
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    kwargs.update(cache=cache, use_cache=use_cache)
    layers = _decoder_layers(target)
    if layers is None or max(layer_ids) >= num_layers - 1 or _partitioned_by_zero3(layers):
        # The last hidden state is post-norm in `hidden_states`; let transformers produce it as inference does
        # (and run a ZeRO-3 forward to its end).
        out = decoder(**kwargs, output_hidden_states=[k + 1 for k in layer_ids])
        return torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)

    captured: dict[int, torch.Tensor] = {}
    deepest = max(layer_ids)

    def make_hook(k):
        def hook(module, args, output):
            captured[k] = output[0] if isinstance(output, tuple) else output
            if k == deepest:
                raise _StopForward

        return hook

    handles = [layers[k].register_forward_hook(make_hook(k)) for k in sorted(set(layer_ids))]
    try:
        decoder(**kwargs)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([captured[k] for k in layer_ids], dim=-1)


@torch.no_grad()
def final_hidden_states(
    target: nn.Module, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, features: torch.Tensor,
    layer_ids: list[int],
) -> torch.Tensor:  # fmt: skip
    """The target's post-norm last hidden state (its lm head's input), resumed from cached features.

    Only the layers after the deepest layer in `features` run (2 of 30 for SmolLM2 read at layer 27): the decoder is
    called with its layer list cut to them, and a pre-hook hands the first of them the cached features in place of
    the (embedded, possibly scaled) input, so the decoder's own RoPE, mask and final norm apply. The result equals a
    full forward up to the features' dtype (bf16 in a feature cache).

    Args:
        input_ids (`torch.LongTensor` of shape `(batch, T)`), attention_mask (`(batch, T)`, *optional*): the sequence.
        features (`torch.Tensor` of shape `(batch, T, len(layer_ids) * hidden)`): [`compute_target_features`].
        layer_ids (`list[int]`): the layers of `features`, in its column order.
    Returns:
        `torch.Tensor` of shape `(batch, T, hidden)` in the target's dtype.
    """
    deepest = max(layer_ids)
    width = features.shape[-1] // len(layer_ids)
    column = layer_ids.index(deepest) * width
    hidden = features[..., column : column + width].to(target.get_input_embeddings().weight.dtype)
    num_layers = target.config.get_text_config().num_hidden_layers
    if deepest == num_layers - 1:  # `hidden_states[-1]` is already post-norm
        return hidden
    decoder, layers = target.get_decoder(), _decoder_layers(target)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no `layers` list to resume after layer {deepest} from.")

    def feed_features(module, args, kwargs):
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    positions = token_positions(attention_mask, input_ids.shape).to(input_ids.device)
    handle = layers[deepest + 1].register_forward_pre_hook(feed_features, with_kwargs=True)
    decoder.layers = layers[deepest + 1 :]  # the same modules; the full list is put back below
    try:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).last_hidden_state
    finally:
        decoder.layers = layers
        handle.remove()


def token_positions(attention_mask: torch.Tensor | None, shape: tuple[int, int]) -> torch.LongTensor:
    """RoPE positions `[b, T]` of a padded batch: 0, 1, ... over real tokens whatever the padding side (padding
    slots get clamped values; they are masked everywhere). No mask: `0 .. T-1`."""
    if attention_mask is None:
        return torch.arange(shape[1]).expand(shape[0], -1)
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)


def embed_tokens(target: nn.Module, input_ids: torch.LongTensor) -> torch.Tensor:
    """Target input embeddings WITHOUT an optional `embed_norm`, as transformers' DFlash generator builds
    `noise_embeds` (`DFlashTokenCandidateGenerator._get_noise_embeds`)."""
    embedding = target.get_input_embeddings()
    embed_norm = getattr(embedding, "embed_norm", None)
    if embed_norm is None:
        return embedding(input_ids)
    try:  # same bypass as the in-tree generator, so training and inference see identical block inputs
        embedding.embed_norm = nn.Identity()
        return embedding(input_ids)
    finally:
        embedding.embed_norm = embed_norm


__all__ = ["compute_target_features", "embed_tokens", "final_hidden_states", "token_positions"]

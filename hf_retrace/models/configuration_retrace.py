# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports transformers and `.policy_settings_retrace` only, so `trust_remote_code=True` loads it without
# hf_retrace installed.
"""Configuration of the ReTrace drafter: a DFlash block drafter plus rejected-trajectory conditioning."""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

from .policy_settings_retrace import RETRACE_MODES


LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """The DFlash rule: `num_ids` layer ids evenly spaced from layer 1 to layer `num_target_layers - 3`, rounded.

    Example: 36 target layers, 5 ids -> `[1, 9, 17, 25, 33]`. A single id takes the middle layer.
    """
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, max(num_target_layers - 3, 1)
    return [int(round(start + i * (end - start) / (num_ids - 1))) for i in range(num_ids)]


@strict
class ReTraceDrafterConfig(PreTrainedConfig):
    r"""
    Configuration of [`ReTraceDrafterModel`]: a Qwen3-style DFlash drafter (no embedding table, no lm head: both are
    the target's) and the ReTrace modules that condition a block on the previous round's rejected suffix.

    The backbone is transformers' reference DFlash drafter (`MuseGlimmerAssistantDecoderLayer`), so the
    attention fields are the ones it reads.

    Args:
        vocab_size (`int`): vocabulary size of the TARGET; drafts are scored with the target's lm head.
        hidden_size (`int`): must equal the target's hidden size (the drafter consumes target embeddings).
        attention_bias (`bool`, defaults to `False`): kept for z-lab/Qwen3 `config.json` compatibility; must be
            `False` (the in-tree attention has no projection biases).
        layer_types (`list[str]`, *optional*): `"full_attention"` or `"sliding_attention"` per drafter layer;
            defaults to all `"full_attention"` (what z-lab DFlash checkpoints are trained with).
        sliding_window (`int`, *optional*): window of the `"sliding_attention"` layers, in key positions (context
            and block alike); required when one layer slides.
        block_size (`int`, defaults to 16): slots per draft block; slot 0 is the anchor, slots `1..B-1` are drafted.
        mask_token_id (`int`): target token whose embedding fills the mask slots.
        target_layer_ids (`list[int]`): 0-based target layers whose outputs are concatenated as drafter context.
        num_target_layers (`int`): depth of the target, used to validate `target_layer_ids`.
        retrace_mode (`str`, defaults to `"corrected"`): `off` (plain DFlash), `overwrite` (mask input replaced by
            the raw retained state), `gated` (raw state through the gated residual), `corrected` (full ReTrace).
        retrace_gate_init (`float`, defaults to 1.0): initial value of the vector gate `g`. Must be non-zero: with
            the zero-initialised value projection, a zero gate would block the gradient of both.
        anchor_broadcast (`bool`, defaults to `False`): add `W_a e_anchor` (zero-initialised `anchor_proj`) to the
            input of every mask slot of a block. Plain DFlash (`False`) lets mask slots learn the anchor only through
            attention; trained from scratch on a small budget, that routing never forms (mask queries attend to the
            other identical mask slots), so every slot predicts the same frequent token. Not part of public DFlash
            checkpoints; with `W_a = 0` the drafter equals its DFlash backbone.
        draft_vocab_size (`int`, *optional*): `K`, the size of the reduced draft vocabulary (EAGLE-3's idea). The
            drafter then scores only the `K` rows `draft_vocab_ids` (a buffer saved with the weights: the `K` most
            frequent tokens of the training responses) of the target's lm head, in training and at inference; the
            draft logits are scattered back to the full vocabulary with `-inf` elsewhere, so greedy verification and
            speculative sampling stay exact (a target token outside the draft vocabulary is simply a rejection).
            Unset: the full vocabulary (z-lab DFlash checkpoints).

    Decoding settings (`num_assistant_tokens`, the confidence stop, prompt and datastore lookup, `draft_logits_dtype`)
    are not part of this config: they live in the drafter's `generation_config` (`generation_config.json`, see
    `decoding_retrace`), and the datastore in `datastore.safetensors`.
    """

    model_type = "retrace_drafter"

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    block_size: int = 16
    mask_token_id: int = 151669
    target_layer_ids: list[int] | None = None
    num_target_layers: int = 36
    retrace_mode: str = "corrected"
    retrace_gate_init: float = 1.0
    anchor_broadcast: bool = False
    draft_vocab_size: int | None = None

    default_theta = 1000000.0

    def __post_init__(self, **kwargs):
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self._check_values()
        super().__post_init__(**kwargs)

    def _check_values(self):
        if self.retrace_mode not in RETRACE_MODES:
            raise ValueError(f"retrace_mode must be one of {RETRACE_MODES}, got {self.retrace_mode!r}")
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (an anchor and at least one drafted slot), got {self.block_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}")
        if len(self.target_layer_ids) == 0:
            raise ValueError("target_layer_ids must name at least one target layer, got []")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids must be in [0, num_target_layers={self.num_target_layers}), "
                f"got {self.target_layer_ids}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        self._check_attention()
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}] or None, got {self.draft_vocab_size}"
            )
        if self.retrace_gate_init == 0.0:
            raise ValueError("retrace_gate_init must be non-zero: with W_v = 0 a zero gate gets no gradient")

    def _check_attention(self):
        if self.attention_bias:
            raise ValueError(
                "attention_bias=True is not supported: the drafter's attention is transformers' "
                "MuseGlimmerAssistantAttention, whose q/k/v/o projections have no bias."
            )
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must give one of {LAYER_TYPES} per layer ({self.num_hidden_layers} layers), "
                f"got {self.layer_types}"
            )
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError(
                f"sliding_window must be a positive int when a layer is sliding_attention, got {self.sliding_window}"
            )


__all__ = ["ReTraceDrafterConfig", "default_target_layer_ids", "RETRACE_MODES"]

# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch/transformers only, so `trust_remote_code=True` loads it without hf_retrace installed.
"""Configuration of the ReTrace drafter: a DFlash block drafter plus rejected-trajectory conditioning."""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig


RETRACE_MODES = ("off", "overwrite", "gated", "corrected")
LAYER_TYPES = ("full_attention", "sliding_attention")
DRAFT_LOGITS_DTYPES = (None, "float32", "bfloat16", "float16")


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
        draft_logits_dtype (`str`, *optional*): dtype of the target lm-head copy that scores DRAFTS (`"bfloat16"`,
            `"float16"`, `"float32"`); unset uses the target's lm head as is. Verification always uses the target's
            own lm head, so output stays exactly the target's: only which tokens are proposed can change (near-ties).
            On CPU with an fp32 target, `"bfloat16"` makes the 15-row draft lm head ~5x cheaper.
        draft_vocab_size (`int`, *optional*): `K`, the size of the reduced draft vocabulary (EAGLE-3's idea). The
            drafter then scores only the `K` rows `draft_vocab_ids` (a buffer saved with the weights: the `K` most
            frequent tokens of the training responses) of the target's lm head, in training and at inference; the
            draft logits are scattered back to the full vocabulary with `-inf` elsewhere, so greedy verification and
            speculative sampling stay exact (a target token outside the draft vocabulary is simply a rejection).
            Unset: the full vocabulary (z-lab DFlash checkpoints).
        num_assistant_tokens (`int`, *optional*): `k`, how many of the `B-1` drafts of a block the target verifies
            (the first `k`); unset verifies all. The drafter still runs its whole block, so the first `k` drafts are
            exactly those of the full block; only the verification forward shrinks to `k+1` tokens. Named after
            transformers' assistant setting of the same meaning (set it on the drafter's config, as transformers
            reads it from the assistant's). Worth it where a verification forward costs more per token than the
            drafts beyond `k` get accepted (on CPU, `benchmarks/verification_cost.py`).
        assistant_confidence_threshold (`float`, *optional*): verify only the drafts before the first slot whose
            draft distribution peaks below this value (the drafter's top-1 probability; for greedy drafts, that of the
            drafted token); a block whose first slot is below it is not verified at all, and the cycle is a plain
            target step. Named after transformers' assistant setting of the same purpose. Unset: no confidence stop.
            Lossless either way, and speculative sampling stays exact: the stop depends on the draft distributions
            only, never on the sampled drafts or the target.
        prompt_lookup_num_tokens (`int`, *optional*): turn on prompt lookup in front of the drafter. Each cycle first
            looks for the context's last n-gram earlier in the context (prompt and output). Where it finds one, the
            target verifies up to this many tokens that followed it, and the drafter skips the cycle. Where it finds
            none, the drafter drafts as usual; its context then catches up on the target features of the skipped
            cycles. Named after transformers' generation setting; passing `prompt_lookup_num_tokens` to `generate`
            overrides it. Unset: the drafter drafts every cycle.
        prompt_lookup_max_ngram_size (`int`, defaults to 3): longest n-gram looked up (tried first). Passing
            `max_matching_ngram_size` to `generate` overrides it.
        prompt_lookup_min_ngram_size (`int`, defaults to 2): shortest n-gram looked up. transformers' prompt lookup
            goes down to single tokens. Behind a drafter, a one-token match proposes worse drafts than the drafter.
        datastore_size (`int`, *optional*): tokens in the `datastore_token_ids` buffer, a corpus of the target's own
            responses saved with the weights (`ReTraceDrafterModel.set_datastore`, `hf-retrace datastore`). Unset: no
            datastore.
        datastore_num_tokens (`int`, *optional*): turn on datastore lookup (REST) behind prompt lookup and in front of
            the drafter. A cycle that prompt lookup leaves to the drafter first looks for the context's last n-gram
            in the datastore; where it finds one, the target verifies up to this many tokens, each the one that most
            often followed the longest n-gram the context ends with once the tokens before it are appended, and the
            drafter skips the cycle. Needs `datastore_size`. Unset: no datastore lookup.
        datastore_max_ngram_size (`int`, defaults to 6), datastore_min_ngram_size (`int`, defaults to 3): n-gram sizes
            looked up in the datastore, longest first.
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
    draft_logits_dtype: str | None = None
    draft_vocab_size: int | None = None
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    prompt_lookup_num_tokens: int | None = None
    prompt_lookup_max_ngram_size: int = 3
    prompt_lookup_min_ngram_size: int = 2
    datastore_size: int | None = None
    datastore_num_tokens: int | None = None
    datastore_max_ngram_size: int = 6
    datastore_min_ngram_size: int = 3

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
            raise ValueError(f"block_size must be >= 2 (an anchor and at least one drafted slot), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}")
        if len(self.target_layer_ids) == 0:
            raise ValueError("target_layer_ids must name at least one target layer, got []")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids must be in [0, num_target_layers={self.num_target_layers}), got {self.target_layer_ids}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        self._check_attention()
        if self.draft_logits_dtype not in DRAFT_LOGITS_DTYPES:
            raise ValueError(f"draft_logits_dtype must be one of {DRAFT_LOGITS_DTYPES}, got {self.draft_logits_dtype!r}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}] or None, got {self.draft_vocab_size}"
            )
        if self.num_assistant_tokens is not None and not 1 <= self.num_assistant_tokens < self.block_size:
            raise ValueError(
                f"num_assistant_tokens must be in [1, block_size - 1 = {self.block_size - 1}] or None (all drafts), "
                f"got {self.num_assistant_tokens}"
            )
        if self.assistant_confidence_threshold is not None and not 0.0 < self.assistant_confidence_threshold <= 1.0:
            raise ValueError(
                f"assistant_confidence_threshold must be in (0, 1] or None, got {self.assistant_confidence_threshold}"
            )
        self.check_prompt_lookup(
            self.prompt_lookup_num_tokens, self.prompt_lookup_max_ngram_size, self.prompt_lookup_min_ngram_size
        )
        if self.datastore_size is not None and self.datastore_size < 1:
            raise ValueError(f"datastore_size must be >= 1 or None (no datastore), got {self.datastore_size}")
        datastore_sizes = (self.datastore_max_ngram_size, self.datastore_min_ngram_size)
        self.check_datastore(self.datastore_num_tokens, *datastore_sizes, self.datastore_size)
        if self.retrace_gate_init == 0.0:
            raise ValueError("retrace_gate_init must be non-zero: with W_v = 0 a zero gate gets no gradient")

    @staticmethod
    def check_prompt_lookup(num_tokens: int | None, max_ngram_size: int, min_ngram_size: int) -> None:
        """Raises `ValueError` on prompt-lookup settings that cannot work. Also called by the candidate generator,
        since `generate`'s `prompt_lookup_num_tokens` and `max_matching_ngram_size` override the config's."""
        _check_ngram_lookup("prompt_lookup", num_tokens, max_ngram_size, min_ngram_size,
                            " (or max_matching_ngram_size passed to generate)")  # fmt: skip

    @staticmethod
    def check_datastore(num_tokens: int | None, max_ngram_size: int, min_ngram_size: int, size: int | None) -> None:
        """Raises `ValueError` on datastore-lookup settings that cannot work. Also called by the candidate generator,
        since the config may have changed since it was built."""
        _check_ngram_lookup("datastore", num_tokens, max_ngram_size, min_ngram_size)
        if num_tokens is not None and size is None:
            raise ValueError(
                "datastore_num_tokens is set but the drafter has no datastore (datastore_size is None): attach one "
                "with `drafter.set_datastore(responses)` or `hf-retrace datastore`, or unset datastore_num_tokens"
            )

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


def _check_ngram_lookup(prefix: str, num_tokens: int | None, max_size: int, min_size: int, hint: str = "") -> None:
    """The checks prompt lookup and datastore lookup share; `prefix` names their config fields."""
    if num_tokens is not None and num_tokens < 1:
        raise ValueError(f"{prefix}_num_tokens must be >= 1 or None (turned off), got {num_tokens}")
    if not 1 <= min_size <= max_size:
        raise ValueError(
            f"{prefix.replace('_', ' ')} needs 1 <= {prefix}_min_ngram_size <= {prefix}_max_ngram_size{hint}, got min "
            f"{min_size} and max {max_size}"
        )


__all__ = ["ReTraceDrafterConfig", "default_target_layer_ids", "RETRACE_MODES"]

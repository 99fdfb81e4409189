# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch, transformers and the other Hub files of `hf_retrace.models` only, so
# `trust_remote_code=True` loads it (transformers copies and fetches the files it imports, transitively).
"""The ReTrace drafter: a DFlash block drafter (weight-compatible with z-lab DFlash checkpoints) plus the
rejected-trajectory conditioning modules of ReTrace (arXiv 2608.29748, Sec. 3)."""

import json
import os

import torch
from torch import nn
from transformers.cache_utils import Cache, DFlashCache
from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
    MuseGlimmerAssistantDecoderLayer,
    MuseGlimmerAssistantPreTrainedModel,
    MuseGlimmerAssistantRMSNorm,
    MuseGlimmerAssistantRotaryEmbedding,
    apply_rotary_pos_emb,  # noqa: F401  (re-exported: RoPE where keys span `[context ; block]`, queries the block)
)
from transformers.utils import cached_file

from .configuration_retrace import RETRACE_MODES, ReTraceDrafterConfig, default_target_layer_ids
from .decoding_retrace import drafter_generation_config
from .drafter_files_retrace import ReTraceDrafterFilesMixin
from .generation_retrace import ReTraceConditioning
from .hook_retrace import install_generate_hook  # noqa: F401  (importing the hook file installs the generate hook)
from .lookup_retrace import NgramDatastore


class ReTraceDrafterDecoderLayer(MuseGlimmerAssistantDecoderLayer):
    """transformers' reference DFlash decoder layer (`MuseGlimmerAssistantDecoderLayer`): pre-norm, QK-norm attention
    whose queries are the block rows and whose keys/values are `[context ; block rows]`, through the attention
    interface (eager, sdpa, flex, flash) with the sliding window of `config.layer_types`. The subclass only gives it
    the name `_no_split_modules` and the FSDP wrap policy (`training/accelerate_configs/fsdp2.yaml`) refer to."""


class ReTraceTrajectoryEncoder(nn.Module):
    """Turns retained rejected states into an additive input for the mask slots (paper Sec. 3; `docs/design.md`, "A
    cycle").

        t_j  = ctx_proj(target_features_j)            # the drafter's own fc + hidden_norm
        h~_j = h_j + beta * W_c([h_j ; t_j])          # target-aware correction (mode `corrected` only)
        e'_j = e_j + g * W_v(h~_j)                    # gated residual; W_v = 0 at init, so e' = e

    `beta` is a plain float (not a buffer, so loading never leaves it uninitialised): 1 at inference, warmed up
    linearly from 0 by the trainer.
    """

    def __init__(self, config: ReTraceDrafterConfig):
        super().__init__()
        self.config = config  # the mode is read at call time, so `set_retrace_mode` takes effect everywhere
        self.correction = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)  # W_c
        self.value_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)  # W_v
        self.gate = nn.Parameter(torch.full((config.hidden_size,), float(config.retrace_gate_init)))  # g
        self.beta = 1.0

    def forward(
        self, inputs_embeds: torch.Tensor, states: torch.Tensor, target_context: torch.Tensor | None
    ) -> torch.Tensor:
        """Runs on the conditioned slots only, so the cost scales with `L`, not `B`. `(...)` is `(M,)` for the `M`
        rows the training layout gathers, `(batch, L)` for the inference slice.

        Args:
            inputs_embeds (`torch.Tensor` of shape `(..., hidden)`): mask-slot input embeddings `e_j`.
            states (`torch.Tensor` of shape `(..., hidden)`): retained drafter states `h_j`.
            target_context (`torch.Tensor` of shape `(..., hidden)`, *optional*): projected target features `t_j`;
                needed for mode `corrected`.
        Returns: `torch.Tensor` of shape `(..., hidden)`, the new input embeddings `e'_j`.
        """
        states = states.to(inputs_embeds.dtype)
        mode = self.config.retrace_mode
        if mode == "overwrite":
            return states
        if mode == "corrected":
            states = states + self.beta * self.correction(torch.cat([states, target_context], dim=-1))
        return inputs_embeds + self.gate * self.value_proj(states)


class AnchorBroadcast(nn.Module):
    """`config.anchor_broadcast`: adds `W_a e_0` (the block's anchor embedding through a zero-initialised linear) to
    every mask slot, a direct path for the one token slot 1 depends on most (see [`ReTraceDrafterConfig`])."""

    def __init__(self, config: ReTraceDrafterConfig):
        super().__init__()
        self.config = config  # its `block_size` is read per call: a drafter may run a block shorter than trained
        # W_a [H_out, H_in], a direct parameter (not an nn.Linear): transformers skips `_init_weights` on custom-code
        # modules without direct parameters, which would leave a child Linear at its random init instead of zero
        self.weight = nn.Parameter(torch.zeros(config.hidden_size, config.hidden_size))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def forward(self, noise_embeds: torch.Tensor) -> torch.Tensor:
        """`e_j + W_a e_0` on every mask slot `j >= 1` of each block; the anchor slot 0 is untouched.

        Args:
            noise_embeds (`torch.Tensor` of shape `(batch, N * B, hidden)`): `N` blocks of `B` slots, anchor first
                (one block at inference; `N` sampled blocks in training).
        """
        batch, rows, hidden = noise_embeds.shape
        block_size = self.block_size
        if rows % block_size:
            raise ValueError(f"anchor_broadcast needs whole blocks: {rows} rows is not a multiple of B={block_size}")
        blocks = noise_embeds.view(batch, rows // block_size, block_size, hidden)  # [b, N, B, H]
        is_mask_slot = (torch.arange(block_size, device=noise_embeds.device) > 0).view(1, 1, -1, 1)
        anchor = nn.functional.linear(blocks[:, :, :1], self.weight)  # [b, N, 1, H]
        blocks = blocks + anchor * is_mask_slot  # W_a e_0 broadcast over slots 1..B-1
        return blocks.view(batch, rows, hidden)


class ReTraceDrafterPreTrainedModel(MuseGlimmerAssistantPreTrainedModel):
    """Inherits the in-tree drafter's support flags (sdpa, flash, flex, attention backends, compile)."""

    config: ReTraceDrafterConfig
    base_model_prefix = "model"
    main_input_name = "noise_embeds"
    _no_split_modules = ["ReTraceDrafterDecoderLayer"]
    _can_record_outputs = {"hidden_states": ReTraceDrafterDecoderLayer}

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, ReTraceTrajectoryEncoder):
            # W_v = 0 makes a fresh ReTrace drafter equal to its DFlash backbone; the gate stays non-zero so that
            # W_v receives a gradient (with both at zero neither would).
            torch.nn.init.zeros_(module.value_proj.weight)
            torch.nn.init.constant_(module.gate, self.config.retrace_gate_init)
        if isinstance(module, AnchorBroadcast):
            torch.nn.init.zeros_(module.weight)  # W_a = 0: starts as the DFlash backbone


class ReTraceDrafterModel(ReTraceDrafterFilesMixin, ReTraceDrafterPreTrainedModel):
    """DFlash drafter + ReTrace conditioning. The backbone is transformers' reference DFlash drafter
    (`transformers.models.muse_glimmer_assistant`: decoder layers, RMSNorm, rotary embedding, mask builders), so
    `attn_implementation` eager/sdpa/flex/flash and sliding-window `layer_types` work. State-dict keys of the backbone
    match public DFlash checkpoints: `fc`, `hidden_norm`, `norm`, `layers.{i}.*`; the ReTrace modules live under
    `retrace.*`.

    Example:

    ```python
    >>> drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=8)
    >>> out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64)
    >>> drafter.last_generation_stats.tau
    ```
    """

    def __init__(self, config: ReTraceDrafterConfig):
        super().__init__(config)
        self.generation_config = drafter_generation_config()  # `from_pretrained` reads generation_config.json over it
        ctx_dim = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(ctx_dim, config.hidden_size, bias=False)
        # `fc` + `hidden_norm` compute what the in-tree `MuseGlimmerAssistantContextProjection` does, under the
        # z-lab key names (`fc`, `hidden_norm`) rather than its `encoder.fc`, `encoder.output_norm_enc`: see README
        # "Design notes" for why a rename on load does not fit
        self.hidden_norm = MuseGlimmerAssistantRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            [ReTraceDrafterDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = MuseGlimmerAssistantRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MuseGlimmerAssistantRotaryEmbedding(config=config)
        self.retrace = ReTraceTrajectoryEncoder(config)
        # `config.anchor_broadcast`; absent otherwise, so DFlash state dicts keep their exact keys
        self.anchor_broadcast = AnchorBroadcast(config) if config.anchor_broadcast else None
        if config.draft_vocab_size is not None:  # `[K]` target token ids the drafter scores; set by `set_draft_vocab`
            self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab_ids = None
        # `[S]` int32 CPU response tokens for datastore lookup, SEPARATOR between responses (`set_datastore`,
        # datastore.safetensors); not a buffer, so it stays out of model.safetensors
        self.datastore_tokens: torch.Tensor | None = None
        self._datastore_index: NgramDatastore | None = None
        self.last_generation_stats = None
        self.post_init()

    # Set by `import hf_retrace` to `hf_retrace.hub.publish.push_to_hub` (card + custom_generate/ recipe). Remote-code
    # copies loaded without the package keep transformers' own push_to_hub, which still ships the code files via
    # auto_map.
    hub_publisher = None

    def push_to_hub(self, repo_id: str, **kwargs):
        """Publishes the drafter; with hf_retrace installed the upload includes the model card and recipe."""
        publisher = type(self).hub_publisher
        return super().push_to_hub(repo_id, **kwargs) if publisher is None else publisher(self, repo_id, **kwargs)

    def set_retrace_mode(self, mode: str) -> None:
        """Switches the conditioning mode (`off | overwrite | gated | corrected`) of this drafter in place."""
        if mode not in RETRACE_MODES:
            raise ValueError(f"retrace_mode must be one of {RETRACE_MODES}, got {mode!r}")
        self.config.retrace_mode = mode

    def set_draft_vocab(self, token_ids) -> None:
        """Sets the reduced draft vocabulary: `token_ids` (`K` distinct target ids, e.g. the most frequent tokens of
        the training responses), stored sorted in the `draft_vocab_ids` buffer; `config.draft_vocab_size = K`.
        `None` goes back to the full vocabulary. The ids only select rows of the target's frozen lm head, so a trained
        drafter's vocabulary can be re-ranked or enlarged for new data without retraining."""
        if token_ids is None:
            if isinstance(self.draft_vocab_ids, torch.Tensor):
                del self._buffers["draft_vocab_ids"]
                self.draft_vocab_ids = None
            self.config.draft_vocab_size = None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        if len(ids) != len(token_ids) or len(ids) == 0:
            raise ValueError(f"draft vocabulary ids must be distinct and non-empty, got {len(token_ids)} ids")
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, vocab_size={self.config.vocab_size})")
        self.config.draft_vocab_size = len(ids)
        if isinstance(self.draft_vocab_ids, torch.Tensor):
            del self._buffers["draft_vocab_ids"]
        else:
            del self.draft_vocab_ids  # the plain `None` attribute of a full-vocabulary drafter
        self.register_buffer("draft_vocab_ids", ids.to(self.fc.weight.device), persistent=True)

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """`[b, T, len(target_layer_ids) * H]` concatenated target features -> `[b, T, H]` drafter context."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        rejected_trajectory: ReTraceConditioning | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        Args:
            noise_embeds (`torch.Tensor` of shape `(batch, Q, hidden)`): target embeddings of the block inputs
                (anchor then mask tokens); in training, several blocks concatenated.
            context_hidden_states (`torch.Tensor` of shape `(batch, C, len(target_layer_ids) * hidden)`): target
                features of context positions not yet in `cache`.
            attention_mask (`torch.Tensor`, *optional*): 2D padding mask of shape `(batch, past + C + Q)`, or a 4D
                mask of shape `(batch, 1, Q, C + Q)` (bool: True = attend), as the training block mask.
            position_ids (`torch.LongTensor` of shape `(batch, C + Q)`, *optional*): positions of context then block.
            cache (`Cache`, *optional*): the `DFlashCache` the in-tree generator passes.
            rejected_trajectory ([`ReTraceConditioning`], *optional*): previous round's retained suffix, aligned
                with `noise_embeds`. Ignored when `config.retrace_mode == "off"`.
        Returns:
            [`BaseModelOutputWithPast`] whose `last_hidden_state` `(batch, Q, hidden)` is post-norm: the states the
            target's lm head turns into draft logits, and the ones ReTrace retains.
        """
        context = self.project_context(context_hidden_states)
        noise_embeds = noise_embeds.to(context.dtype)
        if self.anchor_broadcast is not None:
            noise_embeds = self.anchor_broadcast(noise_embeds)
        if rejected_trajectory is not None and self.config.retrace_mode != "off":
            noise_embeds = self.apply_rejected_trajectory(noise_embeds, rejected_trajectory)

        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            total = context.shape[1] + noise_embeds.shape[1]
            position_ids = torch.arange(past, past + total, device=noise_embeds.device).unsqueeze(0)
        masks = self._attention_masks(noise_embeds, attention_mask, cache, context.shape[1])
        position_embeddings = self.rotary_emb(noise_embeds, position_ids)

        hidden_states = noise_embeds
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden_states = layer(hidden_states, context, position_embeddings, masks[layer_type], cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)

    def apply_rejected_trajectory(self, noise_embeds: torch.Tensor, conditioning: ReTraceConditioning) -> torch.Tensor:
        """`noise_embeds` `(batch, Q, hidden)` with the conditioned slots replaced by `e'_j`; the anchor and the
        unconditioned slots are returned untouched."""
        corrected = self.config.retrace_mode == "corrected"
        if conditioning.slot_mask is None:  # inference layout: slots 1..L, so slices
            end = 1 + conditioning.hidden_states.shape[1]
            target_context = self.project_context(conditioning.target_features) if corrected else None  # [b, L, H]
            rows = self.retrace(noise_embeds[:, 1:end], conditioning.hidden_states, target_context)
            return torch.cat([noise_embeds[:, :1], rows.to(noise_embeds.dtype), noise_embeds[:, end:]], dim=1)
        slot_mask = conditioning.slot_mask  # [b, Q]
        target_context = None
        if corrected:
            target_context = self.project_context(conditioning.target_features[slot_mask])  # [M, H]
        rows = self.retrace(noise_embeds[slot_mask], conditioning.hidden_states[slot_mask], target_context)
        return noise_embeds.index_put((slot_mask,), rows)

    def _attention_masks(self, noise_embeds, attention_mask, cache, context_length: int) -> dict:
        """`{layer type: mask}` for the types in `config.layer_types`, as the in-tree drafter builds them."""
        layer_types = set(self.config.layer_types)
        if attention_mask is not None and attention_mask.dim() == 4:
            if "sliding_attention" in layer_types:
                raise ValueError(
                    "a 4D attention_mask (the training block mask) with sliding_attention layers is not supported: "
                    "the window would be ignored; train with layer_types all 'full_attention'."
                )
            if attention_mask.dtype == torch.bool:  # the additive form works for eager, sdpa and flex alike
                zero = torch.zeros((), dtype=noise_embeds.dtype, device=noise_embeds.device)
                attention_mask = torch.where(attention_mask, zero, torch.finfo(noise_embeds.dtype).min)
            return dict.fromkeys(layer_types, attention_mask)
        # Block rows see every context position and each other: bidirectional, padding (and window) aside.
        builders = {
            "full_attention": create_bidirectional_mask,
            "sliding_attention": create_bidirectional_sliding_window_mask,
        }
        if cache is None:
            # The builders size the keys from the cache; without one they would take the keys to be the `Q` block rows
            # alone (a flex BlockMask of `Q x Q`, a window counted from query 0). An empty DFlashCache told to expect
            # the `C` context rows gives keys `C + Q` and queries offset `C`, as in generation. The layers get `None`.
            cache = DFlashCache(config=self.config)
            cache.set_previous_accepted_tokens(context_length)
        inputs = {"config": self.config, "inputs_embeds": noise_embeds, "attention_mask": attention_mask}
        return {layer_type: builders[layer_type](**inputs, cache=cache) for layer_type in layer_types}

    @classmethod
    def from_target(cls, target, **overrides) -> "ReTraceDrafterModel":
        """A fresh drafter sized for `target` (a model or its config).

        Defaults: hidden/intermediate/head sizes and `vocab_size` of the target; `num_hidden_layers=5`;
        `target_layer_ids` by the DFlash rule (one id per drafter layer, evenly spaced from layer 1 to `L-3`);
        `mask_token_id = vocab_size - 1`, the last vocabulary id (pass `mask_token_id=` to pick another token).
        """
        config = ReTraceDrafterConfig(**{**drafter_config_kwargs_for_target(target, overrides), **overrides})
        return cls(config).to(dtype=_dtype_of(target))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Loads a ReTrace drafter folder/repo, or a z-lab DFlash checkpoint (ReTrace modules then start fresh)."""
        path = str(pretrained_model_name_or_path)
        looks_local = os.path.isabs(path) or path.startswith(("./", "../", "~")) or path.count("/") > 1
        if looks_local and not os.path.exists(os.path.expanduser(path)):
            raise OSError(
                f"{path!r} does not exist: pass an existing drafter folder (one with config.json and the weights) "
                "or a Hub repo id of the form 'owner/name'."
            )
        if kwargs.get("config") is None:
            raw = _read_raw_config(pretrained_model_name_or_path, kwargs)
            if raw is not None and "dflash_config" in raw:
                kwargs["config"] = ReTraceDrafterConfig(**dflash_config_to_retrace_kwargs(raw))
        hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        try:
            model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised with what is wrong and how to fix it
            if "deserializ" in str(err) or "header" in str(err).lower() or "incomplete" in str(err).lower():
                raise OSError(
                    f"The weights file in {pretrained_model_name_or_path!r} is corrupt or truncated ({err}). "
                    "Re-save the drafter with `save_pretrained` or download it again."
                ) from err
            raise
        model._load_decoding_files(pretrained_model_name_or_path, hub_kwargs)
        return model


_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "subfolder")


def drafter_config_kwargs_for_target(target, overrides: dict) -> dict:
    """ReTraceDrafterConfig kwargs derived from a target model or config (see `ReTraceDrafterModel.from_target`)."""
    tcfg = (target.config if isinstance(target, nn.Module) else target).get_text_config()
    num_layers = overrides.get("num_hidden_layers", 5)
    heads = tcfg.num_attention_heads
    return {
        "vocab_size": tcfg.vocab_size,
        "hidden_size": tcfg.hidden_size,
        "intermediate_size": tcfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": tcfg.num_key_value_heads or heads,
        "head_dim": getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        "rms_norm_eps": getattr(tcfg, "rms_norm_eps", 1e-6),
        "num_target_layers": tcfg.num_hidden_layers,
        "target_layer_ids": default_target_layer_ids(tcfg.num_hidden_layers, num_layers),
        "mask_token_id": tcfg.vocab_size - 1,
    }


_DFLASH_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "block_size")


def dflash_config_to_retrace_kwargs(raw: dict) -> dict:
    """Maps a z-lab DFlash `config.json` (`architectures: [DFlashDraftModel]`, `dflash_config`) to our config."""
    missing = [k for k in _DFLASH_REQUIRED if k not in raw]
    missing += [f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in raw["dflash_config"]]
    if missing:
        raise ValueError(f"DFlash checkpoint config is missing required fields {missing}; cannot convert it.")
    keep = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
        "attention_bias", "block_size", "num_target_layers", "rope_parameters", "layer_types", "sliding_window",
    )  # fmt: skip
    kwargs = {k: raw[k] for k in keep if raw.get(k) is not None}
    if "rope_parameters" not in kwargs and "rope_theta" in raw:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    kwargs.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    kwargs["mask_token_id"] = raw["dflash_config"]["mask_token_id"]
    kwargs["target_layer_ids"] = list(raw["dflash_config"]["target_layer_ids"])
    kwargs.setdefault("num_target_layers", max(kwargs["target_layer_ids"]) + 4)
    return kwargs


def _read_raw_config(path, kwargs) -> dict | None:
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k != "subfolder" and k in kwargs}
    config_file = os.path.join(path, "config.json") if os.path.isdir(str(path)) else None
    if config_file is None:
        config_file = cached_file(path, "config.json", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    if config_file is None or not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        return json.load(f)


def _dtype_of(target) -> torch.dtype:
    if isinstance(target, nn.Module):
        return next(target.parameters()).dtype
    return torch.float32


__all__ = [
    "ReTraceDrafterModel",
    "ReTraceDrafterPreTrainedModel",
    "ReTraceTrajectoryEncoder",
    "drafter_config_kwargs_for_target",
    "dflash_config_to_retrace_kwargs",
]


# `save_pretrained` copies the Hub files (this one and its relative imports) and writes `auto_map`, so a saved
# drafter loads with `trust_remote_code=True` without hf_retrace installed.
ReTraceDrafterConfig.register_for_auto_class()
ReTraceDrafterModel.register_for_auto_class("AutoModel")

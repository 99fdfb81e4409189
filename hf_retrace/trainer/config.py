# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""`ReTraceConfig`: the training arguments of [`ReTraceTrainer`] (DFlash and ReTrace drafter training)."""

import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..models.configuration_retrace import RETRACE_MODES
from .losses import LOSS_TYPES, default_loss_decay_gamma
from .objective import VERIFICATION_FEATURES


TRAINING_MODES = ("dflash", "retrace", "retrace_modules_only")
TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFTER_INITS = ("random", "target")
FEATURE_SOURCES = ("online", "cached")


@dataclass
class ReTraceConfig(TrainingArguments):
    r"""
    Configuration class for [`ReTraceTrainer`].

    Only the parameters specific to drafter training are listed here; see [`~transformers.TrainingArguments`] for
    the rest. Using [`~transformers.HfArgumentParser`] (or TRL's `TrlParser` with `--config recipe.yaml`) this class
    becomes command-line arguments.

    Parameters:
        > Parameters that control the model

        target_model_name_or_path (`str`, *optional*, defaults to `"default"`):
            Frozen target (TRL's teacher-style argument): `"default"` (SmolLM2-135M-Instruct, offline),
            `"tiny-random-qwen3"` (seeded tiny Qwen3 for tests), or a path/Hub id for `AutoModelForCausalLM`.
        target_model_init_kwargs (`dict[str, Any]` or `str`, *optional*): keyword arguments of the target's
            `AutoModelForCausalLM.from_pretrained` (a JSON string on the command line), e.g.
            `{"revision": "main", "attn_implementation": "sdpa"}`. Its dtype is `target_dtype`.
        target_name_or_path (`str`, *optional*): deprecated alias of `target_model_name_or_path`.
        target_dtype (`str`, *optional*, defaults to `"bfloat16"`): dtype of the target.
        drafter_name_or_path (`str`, *optional*): drafter to start from (ReTrace folder or z-lab DFlash checkpoint).
            Unset: a fresh drafter sized from the target (`drafter_num_layers`, ...).
        drafter_num_layers (`int`, *optional*, defaults to `1`): layers of a fresh drafter.
        drafter_grow_layers (`int`, *optional*, defaults to `0`): layers appended to the loaded drafter
            ([`grow_drafter_depth`]: copies of its last layer with zeroed output projections, so the grown drafter
            starts as the trained one). A resumed run grows the same drafter again, then loads the checkpoint.
        drafter_target_layer_ids (`list[int]`, *optional*): target layers of a fresh drafter (DFlash rule if unset).
            For a loaded drafter, a superset of its layers: the new layers' `fc` columns start at zero
            ([`add_target_layers`]), so it starts as the trained one. A resumed run adds them again, then loads.
        drafter_mask_token_id (`int`, *optional*): mask token of a fresh drafter (last vocabulary id if unset).
        retrace_mode (`str`, *optional*): `off`, `overwrite`, `gated` or `corrected`; unset keeps the drafter's.
        drafter_draft_vocab_size (`int`, *optional*): give the drafter a reduced draft vocabulary of this many
            tokens, the most frequent of the training responses (`ReTraceDrafterConfig.draft_vocab_size`). A fresh
            drafter, or a loaded full-vocabulary one (its weights do not depend on the vocabulary: the head is the
            target's). A loaded drafter whose vocabulary has this size keeps it (e.g. resuming a run); one of another
            size is re-ranked on the training rows (the ids only pick rows of the target's frozen head, so a drafter
            continued on a grown pool can take a larger vocabulary without losing what it learned).

        > Parameters that control the data

        max_length (`int`, *optional*, defaults to `2048`): longest training sequence (prompt + response), tokens.
        num_anchors (`int`, *optional*, defaults to `512`): blocks sampled per sequence per step.
        feature_source (`str`, *optional*, defaults to `"online"`): where the target's context features come from.
            `online`: a no-grad target forward inside every step (large-scale runs whose features do not fit on
            disk). `cached`: the `features` column of the dataset (`hf_retrace.data.pool`), so the step never runs the
            target (except for ReTrace's `faithful` verification features, which depend on the drafts).
        completion_only_loss (`bool`, *optional*, defaults to `True`): anchor blocks in responses only (TRL's name).
            `False` also anchors them in prompts, whose human text is not what the target would say: slot `k` of a
            block at `p` is then labelled `target_ids[p + k - 1]` (the target's greedy token) and supervised only
            while the text `x_{p+1..p+k-1}` still follows the target's greedy chain, i.e. exactly the slots greedy
            verification could reach. Needs `target_ids` in the data (`hf-retrace build-pool --target-ids`);
            `training_mode="dflash"` only.

        > Parameters that control the training

        training_mode (`str`, *optional*, defaults to `"retrace"`): `dflash` (plain DFlash objective, ReTrace
            modules frozen), `retrace` (two-round simulation, everything trains) or `retrace_modules_only`
            (two-round simulation, backbone frozen).
        block_size (`int`, *optional*): block size `B`; unset uses the drafter's. Must match a loaded drafter.
        loss_decay_gamma (`float`, *optional*): slot-weight decay `exp(-(k-1)/gamma)`. Unset: `(B-2)/2`, i.e. 7 for
            `B = 16` (DFlash's value), 3 for `B = 8`; the last slot then always weighs `exp(-2)` of slot 1.
        beta_warmup_steps (`int`, *optional*): steps over which the correction coefficient `beta` rises linearly
            from 0 to 1. Unset: 10% of the training steps. `0`: `beta = 1` from the start.
        verification_features (`str`, *optional*, defaults to `"faithful"`): correction features of the simulated
            round. `faithful`: target features of the drafted block on the true prefix (what inference sees; one
            extra no-grad target forward over the rejected tails). `teacher_forced`: clean features of the true
            continuation (free, but a different signal).
        loss_type (`str`, *optional*, defaults to `"ce"`): `ce`, the decayed block cross-entropy, or `eal`, the
            expected accepted length under greedy verification (maximised; `../shared/paper/004_*`) plus
            `eal_ce_weight` times the CE.
        eal_ce_weight (`float`, *optional*, defaults to `0.1`): weight of the CE inside the `eal` loss.
        distillation_weight (`float`, *optional*, defaults to `0.0`): weight of a distillation term added to the
            loss: the decayed cross-entropy of the drafter against the target's whole next-token distribution over
            the draft vocabulary (a soft label), not only its greedy token. The target's final states come from the
            layers after the deepest feature layer (2 of 30 for SmolLM2 read at layer 27). `dflash` mode only.
        loss_chunk_rows (`int`, *optional*, defaults to `4096`): draft-logit rows materialised at a time.
        max_blocks_per_forward (`int`, *optional*, defaults to `64`): blocks per drafter forward; bounds the block
            mask at `(n * B, T + n * B)` per row whatever `num_anchors` is.
        retrace_learning_rate (`float`, *optional*): learning rate of the ReTrace modules (`W_c`, `W_v`, gate),
            which follows the same schedule as `learning_rate`. Unset: `learning_rate`. The modules start at
            `W_v = 0` on a trained backbone; with few steps a larger rate lets them move while the backbone stays
            close to the drafter it came from (PEFT's LoRA+ separates rates the same way).
        merge_adapter (`bool`, *optional*, defaults to `True`): with PEFT, the final `save_model` writes the merged
            drafter (loadable by `ReTraceDrafterModel.from_pretrained`) instead of the adapter.

    Note: overridden [`~transformers.TrainingArguments`] defaults: `learning_rate=6e-4`, `logging_steps=10`,
    `remove_unused_columns=False` (the collator needs `loss_mask`, which the drafter's forward does not take),
    `warmup_steps=0.04` (a ratio), `lr_scheduler_type="cosine"`, `ddp_find_unused_parameters=False` (the trainer
    freezes the parameters a mode does not use, so DDP needs no extra graph traversal).
    """

    # Parameters that control the model
    target_model_name_or_path: str = field(
        default="default",
        metadata={"help": "Frozen target: 'default' (SmolLM2-135M-Instruct), 'tiny-random-qwen3', or a path/Hub id."},
    )
    target_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "from_pretrained kwargs of the target (dict, or JSON string); its dtype is target_dtype."},
    )
    target_name_or_path: str | None = field(
        default=None, metadata={"help": "Deprecated: use target_model_name_or_path."}
    )
    target_dtype: str = field(default="bfloat16", metadata={"help": f"Target dtype, one of {TARGET_DTYPES}."})
    drafter_name_or_path: str | None = field(
        default=None, metadata={"help": "Drafter to start from (ReTrace folder or DFlash checkpoint); unset = fresh."}
    )
    drafter_num_layers: int = field(default=1, metadata={"help": "Decoder layers of a fresh drafter."})
    drafter_grow_layers: int = field(
        default=0,
        metadata={"help": "Function-preserving layers appended to a loaded drafter (copies of its last layer with "
                  "zeroed output projections), to train a deeper drafter from a trained one."},
    )
    drafter_target_layer_ids: list[int] | None = field(
        default=None,
        metadata={"help": "Target layers read by a fresh drafter (DFlash rule if unset), or by a loaded one: a "
                  "superset of its layers, the new ones starting with zero fc columns."},
    )
    drafter_init: str = field(
        default="random",
        metadata={"help": "Fresh-drafter init: 'random', or 'target' (copy the target's top layers and final norm)."},
    )
    drafter_anchor_broadcast: bool = field(
        default=False,
        metadata={"help": "Fresh drafter with anchor_broadcast (W_a e_anchor added to mask slots; see the config)."},
    )
    drafter_mask_token_id: int | None = field(
        default=None, metadata={"help": "Mask token of a fresh drafter (last vocabulary id if unset)."}
    )
    retrace_mode: str | None = field(
        default=None, metadata={"help": f"Conditioning mode, one of {RETRACE_MODES}; unset keeps the drafter's."}
    )
    drafter_draft_vocab_size: int | None = field(
        default=None, metadata={"help": "Reduced draft vocabulary of the K most frequent response tokens (full-vocabulary drafters)."}
    )
    # Parameters that control the data
    max_length: int = field(default=2048, metadata={"help": "Longest training sequence in tokens."})
    num_anchors: int = field(default=512, metadata={"help": "Blocks sampled per sequence per step."})
    feature_source: str = field(
        default="online", metadata={"help": f"Target features: one of {FEATURE_SOURCES} (cached = dataset column)."}
    )
    completion_only_loss: bool = field(
        default=True,
        metadata={
            "help": "Anchor blocks in responses only. False also anchors them in prompts, labelled by the target's "
            "greedy chain (needs `target_ids` in the data: `hf-retrace build-pool --target-ids`); dflash mode only."
        },
    )
    # Parameters that control the training
    training_mode: str = field(default="retrace", metadata={"help": f"One of {TRAINING_MODES}."})
    block_size: int | None = field(default=None, metadata={"help": "Block size B; unset uses the drafter's."})
    loss_decay_gamma: float | None = field(
        default=None, metadata={"help": "Slot weight exp(-(k-1)/gamma); unset = (B-2)/2 (7 for B=16)."}
    )
    beta_warmup_steps: int | None = field(
        default=None, metadata={"help": "Linear warmup of the correction beta 0->1; unset = 10%% of training steps."}
    )
    verification_features: str = field(
        default="faithful",
        metadata={"help": f"Correction features of the simulated round, one of {VERIFICATION_FEATURES}."},
    )
    loss_type: str = field(default="ce", metadata={"help": f"Block loss, one of {LOSS_TYPES}."})
    eal_ce_weight: float = field(default=0.1, metadata={"help": "Weight of the CE inside the `eal` loss."})
    distillation_weight: float = field(
        default=0.0,
        metadata={"help": "Weight of the soft-label term (the target's next-token distribution); 0 = off; dflash."},
    )
    loss_chunk_rows: int = field(default=4096, metadata={"help": "Draft-logit rows materialised at a time."})
    max_blocks_per_forward: int | None = field(
        default=64, metadata={"help": "Blocks per drafter forward (bounds the block mask); unset = all at once."}
    )
    retrace_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the ReTrace modules (W_c, W_v, gate); unset = learning_rate."}
    )
    merge_adapter: bool = field(
        default=True, metadata={"help": "With PEFT, save_model writes the merged drafter instead of the adapter."}
    )
    # Overridden TrainingArguments defaults
    learning_rate: float = field(default=6e-4, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X update steps (ratio if < 1)."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep dataset columns (loss_mask is needed by the trainer)."}
    )
    warmup_steps: float = field(
        default=0.04, metadata={"help": "Linear learning-rate warmup: steps, or a ratio of all steps if in [0, 1)."}
    )
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={
            "help": "DDP unused-parameter search; off because the trainer freezes every parameter a mode leaves unused."
        },
    )

    def __post_init__(self):
        self._resolve_target_arguments()
        self._check_choices()
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.loss_decay_gamma is not None and self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma must be > 0, got {self.loss_decay_gamma}")
        if self.beta_warmup_steps is not None and self.beta_warmup_steps < 0:
            raise ValueError(f"beta_warmup_steps must be >= 0, got {self.beta_warmup_steps}")
        if self.retrace_learning_rate is not None and self.retrace_learning_rate <= 0:
            raise ValueError(f"retrace_learning_rate must be > 0 (or unset), got {self.retrace_learning_rate}")
        if self.drafter_name_or_path is not None and (self.drafter_init != "random" or self.drafter_anchor_broadcast):
            raise ValueError(
                "drafter_init and drafter_anchor_broadcast configure a FRESH drafter, but drafter_name_or_path="
                f"{self.drafter_name_or_path!r} loads one; drop them (the loaded config decides) or drop the path."
            )
        if self.drafter_grow_layers < 0:
            raise ValueError(f"drafter_grow_layers must be >= 0, got {self.drafter_grow_layers}")
        if self.drafter_grow_layers and self.drafter_name_or_path is None:
            raise ValueError(
                f"drafter_grow_layers={self.drafter_grow_layers} deepens a trained drafter, but no "
                "drafter_name_or_path is set; size a fresh drafter with drafter_num_layers instead."
            )
        for name in ("loss_chunk_rows", "max_blocks_per_forward", "drafter_draft_vocab_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.eal_ce_weight < 0:
            raise ValueError(f"eal_ce_weight must be >= 0, got {self.eal_ce_weight}")
        if self.distillation_weight < 0:
            raise ValueError(f"distillation_weight must be >= 0, got {self.distillation_weight}")
        if self.distillation_weight > 0 and self.training_mode != "dflash":
            raise ValueError(
                f"distillation_weight={self.distillation_weight} is implemented for training_mode='dflash' only, not "
                f"{self.training_mode!r}; set it to 0 for ReTrace training."
            )
        if not self.completion_only_loss and self.training_mode != "dflash":
            raise ValueError(
                "completion_only_loss=False labels prompt blocks by the target's greedy chain, which the simulated "
                "ReTrace rounds cannot follow (their second anchor is a prompt token, not the target's correction); "
                "use training_mode='dflash' or completion_only_loss=True."
            )
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        super().__post_init__()

    def _resolve_target_arguments(self) -> None:
        """Maps the deprecated `target_name_or_path` onto `target_model_name_or_path` (with a warning) and reads
        `target_model_init_kwargs` given as a JSON string."""
        if self.target_name_or_path is not None:
            warnings.warn(
                "`target_name_or_path` is deprecated and will be removed; use `target_model_name_or_path`.",
                FutureWarning,
                stacklevel=3,
            )
            if self.target_model_name_or_path not in ("default", self.target_name_or_path):
                raise ValueError(
                    f"target_name_or_path={self.target_name_or_path!r} and target_model_name_or_path="
                    f"{self.target_model_name_or_path!r} disagree; set only target_model_name_or_path."
                )
            self.target_model_name_or_path, self.target_name_or_path = self.target_name_or_path, None
        if isinstance(self.target_model_init_kwargs, str):
            self.target_model_init_kwargs = json.loads(self.target_model_init_kwargs)
        if {"dtype", "torch_dtype"} & set(self.target_model_init_kwargs or {}):
            raise ValueError("set the target's dtype with target_dtype, not in target_model_init_kwargs")

    def _check_choices(self):
        choices = {
            "training_mode": (self.training_mode, TRAINING_MODES),
            "verification_features": (self.verification_features, VERIFICATION_FEATURES),
            "target_dtype": (self.target_dtype, TARGET_DTYPES),
            "drafter_init": (self.drafter_init, DRAFTER_INITS),
            "feature_source": (self.feature_source, FEATURE_SOURCES),
            "loss_type": (self.loss_type, LOSS_TYPES),
        }
        if self.retrace_mode is not None:
            choices["retrace_mode"] = (self.retrace_mode, RETRACE_MODES)
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    def resolved_loss_decay_gamma(self, block_size: int) -> float:
        """`loss_decay_gamma`, or the block-size rule of [`default_loss_decay_gamma`] when unset."""
        return self.loss_decay_gamma if self.loss_decay_gamma is not None else default_loss_decay_gamma(block_size)


__all__ = ["TRAINING_MODES", "ReTraceConfig"]

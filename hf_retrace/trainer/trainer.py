# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""`ReTraceTrainer`: trains a DFlash/ReTrace drafter against a frozen target with [`transformers.Trainer`]."""

import os
from collections import defaultdict
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import torch
from transformers import Trainer
from transformers.utils import logging

from ..data import IGNORE_INDEX
from ..models.hook_retrace import validate_drafter_for_target
from ..models.modeling_retrace import ReTraceDrafterModel, ReTraceTrajectoryEncoder
from .callbacks import BetaWarmupCallback
from .config import ReTraceConfig
from .draft_vocab import TrainingDraftHead
from .frozen_target import gathered_parameters, prepare_frozen_target
from .losses import loss_decay_weights
from .objective import LossSettings, dflash_training_step, retrace_training_step


logger = logging.get_logger(__name__)

# ReTrace parameters each conditioning mode uses (`docs/design.md`, "A cycle"); the others get no gradient and are frozen, so that
# DDP sees no unused parameter and "every trainable parameter changes" holds.
_USED_RETRACE_PARAMS = {
    "off": (),
    "overwrite": (),
    "gated": ("value_proj.weight", "gate"),
    "corrected": ("value_proj.weight", "gate", "correction.weight"),
}
DEFAULT_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ReTraceTrainer(Trainer):
    """Trains a drafter with the DFlash objective (`training_mode="dflash"`) or the ReTrace two-round objective
    (`docs/training.md`) against a frozen target, whose features are computed inside each step under `no_grad`.

    Args:
        model ([`ReTraceDrafterModel`]): the drafter (float32 master weights recommended).
        target (`PreTrainedModel`): the frozen target (embeddings, lm head and context features); frozen, put in eval
            mode and sharded (FSDP, ZeRO-3) or placed on the device by [`prepare_frozen_target`], in place.
        args ([`ReTraceConfig`], *optional*).
        train_dataset (`datasets.Dataset`): rows with `input_ids` and `loss_mask` (1 on response tokens), e.g. from
            `hf_retrace.data.responses.tokenize_conversations`.
        data_collator (*optional*): defaults to `hf_retrace.data.responses.DataCollatorForReTrace` (right padding).
        peft_config (`peft.PeftConfig`, *optional*): LoRA on the backbone; the ReTrace modules train fully
            (`modules_to_save=["retrace"]` is added when missing).

    Example:

    ```python
    >>> trainer = ReTraceTrainer(model=drafter, target=target, args=ReTraceConfig("out"), train_dataset=ds)
    >>> trainer.train()
    ```
    """

    _tag_names = ["hf_retrace", "retrace", "dflash"]

    def __init__(self, model, target, args: ReTraceConfig | None = None, train_dataset=None, data_collator=None,
                 peft_config=None, **kwargs):  # fmt: skip
        args = args if args is not None else ReTraceConfig("retrace-drafter")
        _validate_models(model, target, args)
        _validate_dataset(train_dataset)
        _configure_drafter(model, args)
        model.add_model_tags(self._tag_names)  # what transformers' own cards of this model carry
        if peft_config is not None:
            model = _wrap_peft(model, peft_config)
        if data_collator is None:
            from ..data.responses import DataCollatorForReTrace  # the data module pulls in `datasets`

            data_collator = DataCollatorForReTrace(pad_token_id=target.config.get_text_config().pad_token_id or 0)
        callbacks = [*(kwargs.pop("callbacks", None) or []), BetaWarmupCallback()]
        super().__init__(
            model=model, args=args, train_dataset=train_dataset, data_collator=data_collator, callbacks=callbacks,
            **kwargs,
        )  # fmt: skip
        self.model_accepts_loss_kwargs = False  # the loss is a per-batch mean: let Trainer scale by accumulation
        # Sharded under FSDP / ZeRO-3, placed on the device otherwise; `self.target` stays the unwrapped model whose
        # parts the objective calls, `_target_engine` the DeepSpeed engine that owns its ZeRO-3 partitions (or None).
        self.target, self._target_engine = prepare_frozen_target(target, self.accelerator)
        block_size = model.config.block_size
        self.decay_weights = loss_decay_weights(block_size, args.resolved_loss_decay_gamma(block_size))
        self.loss_settings = LossSettings(
            head=_draft_head(self.target, _draft_vocab_ids(model)), decay_weights=self.decay_weights,
            loss_type=args.loss_type, eal_ce_weight=args.eal_ce_weight, chunk_rows=args.loss_chunk_rows,
            distillation_weight=args.distillation_weight,
        )  # fmt: skip
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._micro_step = (-1, 0)  # (global step, micro-batch index within it) for the anchor seed
        self._eval_batches = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """One DFlash or ReTrace step on a padded batch (`input_ids`, `attention_mask`, `loss_mask`)."""
        args = self.args
        length = args.max_length
        input_ids, loss_mask = inputs["input_ids"][:, :length], inputs["loss_mask"][:, :length]
        attention_mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))[:, :length]
        mode = "train" if model.training else "eval"
        generator = self._anchor_generator() if mode == "train" else self._eval_generator()
        features = inputs.get("features")
        if args.feature_source == "cached" and features is None:
            raise ValueError(
                "feature_source='cached' but the batch has no `features`: train on a feature cache "
                "(`hf_retrace.data.pool.load_feature_dataset`, collated by `DataCollatorWithFeatures`)."
            )
        target_ids = None
        if not args.completion_only_loss:
            loss_mask, target_ids = _prompt_and_completion(inputs, attention_mask, length)
        common = dict(
            num_anchors=args.num_anchors, loss=self.loss_settings, generator=generator,
            features=features[:, :length] if args.feature_source == "cached" else None,
            max_blocks_per_forward=args.max_blocks_per_forward,
            config=self.accelerator.unwrap_model(model).config,  # DDP has no `.config`; PEFT forwards it
        )  # fmt: skip
        if args.training_mode == "dflash":
            out = dflash_training_step(
                model, self.target, input_ids, attention_mask, loss_mask, target_ids=target_ids, **common
            )
        else:
            out = retrace_training_step(
                model, self.target, input_ids, attention_mask, loss_mask,
                verification_features=args.verification_features, **common,
            )  # fmt: skip
            out.metrics.update(beta=self._beta(), gate_norm=self._gate_norm())
        for key, value in out.metrics.items():
            self._metrics[mode][key].append(value)
        return (out.loss, out) if return_outputs else out.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the same objective under `no_grad` (the drafter has no logits/labels of its own to return)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluate(self, *args, **kwargs):
        self._eval_batches = 0  # every evaluation samples the same anchors
        return super().evaluate(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the step metrics (means since the last log, averaged over processes) to the Trainer's logs.

        `train_acceptance` is the mean number of accepted drafts `n` per trained block (greedy, against the labels;
        `n + 1` tokens are committed per cycle), `accepted_ge_k` the share of blocks with `n >= k`,
        `round1_acceptance` the same mean for the simulated first round, `conditioned_share` the share of round-2
        blocks with a retained suffix (`L > 0`), `mean_retained` their mean `L`, `gate_norm` the norm of the gate `g`
        and `beta` the correction coefficient.
        """
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        metrics = self._metrics[mode]
        if metrics:
            keys = sorted(k for k in metrics if k != "loss")
            local = torch.tensor([sum(metrics[k]) / len(metrics[k]) for k in keys], device=self.args.device)
            gathered = self.accelerator.gather(local.unsqueeze(0)).mean(dim=0)
            prefix = "eval_" if mode == "eval" else ""
            logs.update(
                {(f"{mode}_{k}" if k == "acceptance" else prefix + k): float(v) for k, v in zip(keys, gathered)}
            )
            metrics.clear()
        super().log(logs, start_time)

    def create_optimizer(self, model=None):
        """[`Trainer.create_optimizer`], with the ReTrace modules in their own groups at `retrace_learning_rate`.

        Groups are (ReTrace module or not) x (weight decay or not); the scheduler scales every group's rate by the
        same factor, so the ratio of the two rates holds over training.
        """
        if self.args.retrace_learning_rate is None or self.optimizer is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        groups = defaultdict(list)
        for name, param in opt_model.named_parameters():
            if param.requires_grad:
                groups[(_is_retrace_parameter(name), name in decay)].append(param)
        param_groups = [
            {"params": params, "weight_decay": self.args.weight_decay if decays else 0.0}
            | ({"lr": self.args.retrace_learning_rate} if retrace else {})
            for (retrace, decays), params in groups.items()
        ]
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        return self.optimizer

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Checkpoints save the drafter folder (or the adapter with PEFT); the final `save_model` of a PEFT run with
        `merge_adapter=True` writes the merged drafter, loadable by `ReTraceDrafterModel.from_pretrained`. Every
        save also writes the model card ([`create_model_card`])."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call or not self.args.merge_adapter or not hasattr(self.model, "merge_and_unload"):
            super().save_model(output_dir, _internal_call=_internal_call)
        else:
            if self.accelerator.is_main_process:
                save_merged(self.accelerator.unwrap_model(self.model), output_dir)
            self.accelerator.wait_for_everyone()
        self.create_model_card(output_dir=output_dir)

    def create_model_card(self, model_name: str | None = None, tags: list[str] | None = None, output_dir=None,
                          **kwargs) -> None:  # fmt: skip
        """Writes `README.md` into `output_dir` (default `args.output_dir`), TRL-style, on the main process: the
        drafter card of `hf_retrace.hub.model_card` with metadata `base_model` (the target's `name_or_path` when it
        is a Hub id; `hf-retrace publish --base-model` sets it otherwise),
        tags [`CARD_TAGS`] + the trainer's `_tag_names` + `tags`, and the Usage snippet for `hub_model_id` (else
        `model_name`, else the folder name). `kwargs` (transformers' card fields) are not used."""
        if not self.args.should_save:
            return
        from ..hub.model_card import render_model_card  # the card needs huggingface_hub only

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        drafter = _base_drafter(self.accelerator.unwrap_model(self.model))
        card = render_model_card(
            drafter.config, drafter.decoding_settings(), datastore_size=drafter.datastore_size,
            repo_id=self.args.hub_model_id or model_name or Path(output_dir).name,
            base_model=_hub_id_of_target(self.target.name_or_path),
            num_parameters=drafter.num_parameters(), tags=[*self._tag_names, *(tags or [])],
        )  # fmt: skip
        os.makedirs(output_dir, exist_ok=True)
        card.save(os.path.join(output_dir, "README.md"))

    def _beta(self) -> float:
        """The correction coefficient the step runs with (set by [`BetaWarmupCallback`])."""
        return next(m.beta for m in self.model.modules() if isinstance(m, ReTraceTrajectoryEncoder))

    def _gate_norm(self) -> float:
        encoders = [m for m in self.model.modules() if isinstance(m, ReTraceTrajectoryEncoder)]
        trained = [m for m in encoders if m.gate.requires_grad] or encoders
        return float(trained[-1].gate.detach().float().norm())

    def _eval_generator(self) -> torch.Generator:
        self._eval_batches += 1
        return torch.Generator().manual_seed(
            self.args.seed * 1_000_003 + self._eval_batches * 257 + self.args.process_index
        )

    def _anchor_generator(self) -> torch.Generator:
        """A generator seeded by (seed, step, micro-batch, rank): anchors never depend on global RNG state, so a run
        resumed from a checkpoint samples exactly what an uninterrupted one would, and ranks sample differently."""
        step, micro = self._micro_step
        micro = micro + 1 if step == self.state.global_step else 0
        self._micro_step = (self.state.global_step, micro)
        seed = ((self.args.seed * 1_000_003 + self.state.global_step) * 1_009 + micro) * 257 + self.args.process_index
        return torch.Generator().manual_seed(seed % (2**63))


def _prompt_and_completion(inputs: dict, attention_mask: torch.Tensor, length: int):
    """`(loss_mask, target_ids)` of `completion_only_loss=False`: every real token with a greedy label can anchor a
    block (not position 0, which has no context, nor a preamble that the cache left unlabelled); labels come from the
    target's greedy chain."""
    if "target_ids" not in inputs:
        raise ValueError(
            "completion_only_loss=False needs the target's greedy ids (`target_ids`) in the batch to label prompt "
            "blocks; add them to the feature cache with `hf-retrace build-pool --target-ids` (or set "
            "completion_only_loss=True)."
        )
    target_ids = inputs["target_ids"][:, :length]
    loss_mask = attention_mask * (target_ids != IGNORE_INDEX)
    loss_mask[:, 0] = 0
    return loss_mask, target_ids


def _base_drafter(model) -> ReTraceDrafterModel:
    """The drafter under PEFT (`get_base_model`); accelerate's `unwrap_model` has already removed DDP/compile."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _draft_head(target, vocab_ids: torch.Tensor | None) -> TrainingDraftHead:
    """The frozen lm-head rows of the draft loss. Under ZeRO-3 a tied lm head is partitioned with the embeddings:
    its rows are gathered and copied once, as the loss reads all of them every step."""
    lm_head = target.get_output_embeddings()
    with gathered_parameters(lm_head) as partitioned:
        head = TrainingDraftHead.from_lm_head(lm_head, vocab_ids)
        return replace(head, weight=head.weight.clone()) if partitioned else head


def _draft_vocab_ids(drafter) -> torch.Tensor | None:
    """The drafter's reduced draft vocabulary (through PEFT), or `None` for the full vocabulary."""
    return getattr(_base_drafter(drafter), "draft_vocab_ids", None)


def _hub_id_of_target(name_or_path: str) -> str | None:
    """`name_or_path` when it is an `ORG/NAME` Hub id and not a local folder, else `None` (local, GGUF-converted
    or synthetic targets have no Hub id to name)."""
    from ..hub.validation import is_repo_id

    is_hub_id = "/" in name_or_path and is_repo_id(name_or_path) and not os.path.exists(name_or_path)
    return name_or_path if is_hub_id else None


def _is_retrace_parameter(name: str) -> bool:
    """Whether a parameter name (plain, DDP `module.` or PEFT `base_model.model.` prefixed) is a ReTrace module's."""
    return name.startswith("retrace.") or ".retrace." in name


def _validate_models(drafter, target, args: ReTraceConfig) -> None:
    """Raises `ValueError` with the fix when drafter, target and arguments do not fit together (before any compute)."""
    if not isinstance(drafter, ReTraceDrafterModel):
        raise TypeError(f"model must be a ReTraceDrafterModel, got {type(drafter).__name__}")
    validate_drafter_for_target(target, drafter)
    if args.block_size is not None and args.block_size != drafter.config.block_size:
        raise ValueError(
            f"block_size={args.block_size} but the drafter was built with block_size={drafter.config.block_size}; "
            "drop `block_size` to use the drafter's, or start from a drafter with that block size."
        )
    vocab = target.get_input_embeddings().weight.shape[0]
    if drafter.config.mask_token_id >= vocab:
        raise ValueError(
            f"mask_token_id={drafter.config.mask_token_id} has no row in the target's embeddings ({vocab})."
        )


def _validate_dataset(dataset) -> None:
    """The dataset must be tokenized (or a feature cache) and hold at least one anchor (two consecutive response
    tokens)."""
    if dataset is None:
        raise ValueError("ReTraceTrainer needs a train_dataset with `input_ids` and `loss_mask`.")
    columns = getattr(dataset, "column_names", None) or list(dataset[0].keys())
    if "prompt_length" in columns and "features" in columns:  # a feature cache: the response follows the prompt
        lengths = zip(dataset["input_ids"], dataset["prompt_length"]) if hasattr(dataset, "column_names") else []
        if any(len(ids) - int(start) >= 2 for ids, start in lengths):
            return
        raise ValueError("the feature cache has no row with two response tokens to train on.")
    missing = [c for c in ("input_ids", "loss_mask") if c not in columns]
    if missing:
        raise ValueError(
            f"train_dataset lacks {missing}; tokenize it first with "
            "`hf_retrace.data.responses.tokenize_conversations`."
        )
    for mask in dataset["loss_mask"] if hasattr(dataset, "column_names") else (row["loss_mask"] for row in dataset):
        if any(a and b for a, b in pairwise(mask)):
            return
    raise ValueError(
        "train_dataset has no response tokens to train on: no row has two consecutive loss_mask=1 positions "
        "(an anchor and its supervised next token). Check the chat template / response masking."
    )


def _configure_drafter(drafter: ReTraceDrafterModel, args: ReTraceConfig) -> None:
    """Applies `retrace_mode` and freezes what `training_mode` and the mode do not train."""
    if args.retrace_mode is not None and args.retrace_mode != drafter.config.retrace_mode:
        logger.info(f"Switching the drafter's retrace_mode {drafter.config.retrace_mode!r} -> {args.retrace_mode!r}")
        drafter.set_retrace_mode(args.retrace_mode)
    used = _USED_RETRACE_PARAMS[drafter.config.retrace_mode] if args.training_mode != "dflash" else ()
    for name, param in drafter.named_parameters():
        if name.startswith("retrace."):
            param.requires_grad_(name.removeprefix("retrace.") in used)
        elif args.training_mode == "retrace_modules_only":
            param.requires_grad_(False)
    if not any(p.requires_grad for p in drafter.parameters()):
        raise ValueError(
            f"Nothing to train: training_mode={args.training_mode!r} with "
            f"retrace_mode={drafter.config.retrace_mode!r} "
            "leaves no trainable parameter."
        )


def _wrap_peft(drafter: ReTraceDrafterModel, peft_config):
    """LoRA on the backbone; the ReTrace modules (`retrace.*`) stay fully trainable through `modules_to_save`."""
    from peft import get_peft_model

    if not peft_config.target_modules:
        peft_config.target_modules = list(DEFAULT_LORA_TARGET_MODULES)
    peft_config.modules_to_save = sorted(set(peft_config.modules_to_save or []) | {"retrace"})
    frozen_retrace = [n for n, p in drafter.retrace.named_parameters() if not p.requires_grad]
    model = get_peft_model(drafter, peft_config)
    for name, param in model.named_parameters():  # keep the mode's unused ReTrace params frozen
        if ".retrace.modules_to_save." in name and name.rsplit("default.", 1)[-1] in frozen_retrace:
            param.requires_grad_(False)
    return model


def save_merged(peft_model, output_dir: str) -> None:
    """Saves a PEFT drafter as a plain drafter folder with its LoRA merged, without copying the model.

    The adapters are merged into the base weights in place (`W += B A`), the drafter's state dict is saved under its
    own keys (`q_proj.base_layer.weight` -> `q_proj.weight`, the trained `modules_to_save` copy of `retrace.*`, no
    `lora_*` tensors), then the adapters are unmerged, so the live model trains on (its base weights back up to
    float rounding).
    """
    peft_model.merge_adapter()
    try:
        base = peft_model.get_base_model()
        base.save_pretrained(output_dir, state_dict=_plain_state_dict(base.state_dict()))
    finally:
        peft_model.unmerge_adapter()


def _plain_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of a LoRA-wrapped drafter under the plain drafter's keys (see [`save_merged`])."""
    plain = {}
    for key, value in state.items():
        if "lora_" in key or ".original_module." in key:
            continue
        key = key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        plain[key] = value
    return plain


__all__ = ["DEFAULT_LORA_TARGET_MODULES", "ReTraceTrainer", "save_merged"]

"""Export a drafter folder in the format vLLM's DFlash speculative decoding loads (`docs/formats.md`).

    hf-retrace export --format vllm --drafter model_cards/smollm2-135m-retrace --output /tmp/retrace-vllm

```python
from vllm import LLM

llm = LLM(
    model=TARGET_DIR,  # the target the drafter was trained for (`--target`, default SmolLM2-135M-Instruct)
    speculative_config={"method": "dflash", "model": "/tmp/retrace-vllm", "num_speculative_tokens": 3},
)
```

What the folder holds:
- `config.json`: a Qwen3 config with `dflash_config`. A plain drafter (no anchor term, full vocabulary, retrace_mode
  off) gets `architectures: ["DFlashDraftModel"]` and loads in vLLM as it is; any other gets
  `["DFlashReTraceDraftModel"]`, which needs the `hf-retrace-vllm` plugin (`integrations/vllm`). The `hf_retrace`
  block carries the decoding policy (verify `num_assistant_tokens` of each block's drafts, prompt lookup, datastore)
  for the plugin's proposer; plain vLLM ignores it.
- `model.safetensors`: the backbone under the drafter's own keys (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`); with
  a reduced vocabulary `lm_head.weight` (the target's head rows at `draft_vocab_ids`) and `d2t`; the anchor term
  `anchor_broadcast.weight`; the ReTrace modules `retrace.*` when retrace_mode is not off.
- `datastore.safetensors`: the drafter's, copied byte for byte.
- `model.safetensors.index.json`: names `model.safetensors` as the file of every weight. vLLM's loader reads every
  `*.safetensors` in a local folder unless an index says which hold weights, and would fail on the datastore's
  `token_ids` ("no module or parameter named 'token_ids'") in a plain `DFlashDraftModel` folder.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.utils import logging

from ..models.datastore_file_retrace import DATASTORE_FILE
from ..models.policy_settings_retrace import RETRACE_MODES, export_policy


logger = logging.get_logger(__name__)

PLAIN_ARCHITECTURE = "DFlashDraftModel"  # vLLM's own DFlash drafter (qwen3_dflash.py)
RETRACE_ARCHITECTURE = "DFlashReTraceDraftModel"  # registered by the hf-retrace-vllm plugin
# The modes the plugin implements: the shared `RETRACE_MODES`, which the plugin runs from its own copy of the file.
VLLM_RETRACE_MODES = RETRACE_MODES
_BACKBONE_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.")
_RETRACE_KEYS = ("retrace.correction.weight", "retrace.gate", "retrace.value_proj.weight")
_NOT_EXPORTED = ("draft_vocab_ids",)  # mapped to `d2t`


class ExportError(ValueError):
    """A drafter, target or output folder the export cannot use; the message says what is wrong and how to fix it
    (`hf-retrace export` prints it as one line)."""


def is_plain_dflash(drafter_config) -> bool:
    """Whether vLLM's own DFlash drafter computes this drafter: no anchor term, full vocabulary, retrace_mode off."""
    return (
        not drafter_config.anchor_broadcast
        and drafter_config.draft_vocab_size is None
        and drafter_config.retrace_mode == "off"
    )


def check_exportable(drafter_config) -> None:
    """Raises `ExportError` for a drafter that vLLM's DFlash Qwen3 drafter (and the plugin on top of it) cannot run."""
    if drafter_config.retrace_mode not in VLLM_RETRACE_MODES:
        raise ExportError(
            f"retrace_mode {drafter_config.retrace_mode!r} has no vLLM implementation (the hf-retrace-vllm plugin "
            f"runs {VLLM_RETRACE_MODES}); switch it with `drafter.set_retrace_mode(...)` and re-save, or serve the "
            "drafter with transformers"
        )
    if drafter_config.hidden_act != "silu":
        raise ExportError(
            f"hidden_act {drafter_config.hidden_act!r} is not supported by vLLM's DFlash drafter (its MLP is "
            "SiLU-gated only)"
        )
    sliding = [i for i, kind in enumerate(drafter_config.layer_types) if kind != "full_attention"]
    if sliding:
        # vLLM's qwen3_dflash makes a sliding layer causal, while the drafter's sliding layers see the whole block
        raise ExportError(
            f"layers {sliding} are {drafter_config.layer_types[sliding[0]]!r}: vLLM's DFlash drafter runs sliding "
            "layers causally, this drafter bidirectionally, so it would draft differently; only drafters whose "
            "layer_types are all 'full_attention' export"
        )


def check_target(drafter_config, target_config) -> None:
    """Raises `ExportError` when `target_config` (a target model's config) is not the target the drafter reads."""
    target_config = target_config.get_text_config()
    problems = []
    for name in ("hidden_size", "vocab_size"):
        if getattr(drafter_config, name) != getattr(target_config, name):
            problems.append(f"{name} {getattr(target_config, name)} (the drafter's: {getattr(drafter_config, name)})")
    deepest = max(drafter_config.target_layer_ids)
    if target_config.num_hidden_layers <= deepest:
        problems.append(
            f"{target_config.num_hidden_layers} layers, but the drafter reads layer {deepest} "
            f"(target_layer_ids {drafter_config.target_layer_ids})"
        )
    if problems:
        raise ExportError(
            f"the target does not match the drafter: it has {'; '.join(problems)}. Pass the target the drafter was "
            "trained for with --target DIR"
        )


def vllm_config(
    drafter_config, policy: dict, *, dtype: torch.dtype, num_target_layers: int | None = None,
    datastore_file: str | None = None, source_commit: str | None = None,
) -> dict:  # fmt: skip
    """The export's `config.json` (`docs/formats.md`).

    Args:
        drafter_config ([`ReTraceDrafterConfig`]): the drafter's config.
        policy (`dict`): the decoding policy under its `hf_retrace` block names, as `_decoding_policy` returns it.
        dtype (`torch.dtype`): the dtype of the exported float tensors.
        num_target_layers (`int`, *optional*): depth of the target; defaults to the drafter's `num_target_layers`.
        datastore_file (`str`, *optional*): `"datastore.safetensors"` when the export holds one.
        source_commit (`str`, *optional*): the hf_retrace commit that wrote the export.
    Returns:
        `dict`, JSON-serialisable.
    """
    check_exportable(drafter_config)
    rope_parameters = dict(drafter_config.rope_parameters)
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": [PLAIN_ARCHITECTURE if is_plain_dflash(drafter_config) else RETRACE_ARCHITECTURE],
        "model_type": "qwen3",
        **{key: getattr(drafter_config, key) for key in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias",
            "block_size",
        )},  # fmt: skip
        "rope_theta": rope_parameters["rope_theta"],
        "rope_parameters": rope_parameters,
        "layer_types": list(drafter_config.layer_types),
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,  # the name readers before transformers 5 look for
        "num_target_layers": drafter_config.num_target_layers if num_target_layers is None else num_target_layers,
        "dflash_config": {
            "mask_token_id": drafter_config.mask_token_id,
            "target_layer_ids": list(drafter_config.target_layer_ids),
        },
    }
    if drafter_config.draft_vocab_size is not None:
        config["draft_vocab_size"] = drafter_config.draft_vocab_size
    config["hf_retrace"] = {
        "anchor_broadcast": bool(drafter_config.anchor_broadcast),
        "retrace_mode": drafter_config.retrace_mode,
        **policy,
        "datastore_file": datastore_file,
        "source_commit": source_commit,
    }
    return config


def vllm_state_dict(drafter, target_head: torch.Tensor | None, dtype: torch.dtype | None = None) -> dict:
    """The export's `model.safetensors` tensors (`docs/formats.md`).

    Args:
        drafter ([`ReTraceDrafterModel`]): the drafter.
        target_head (`torch.Tensor` of shape `(vocab_size, hidden_size)`, *optional*): the target's lm-head weight;
            needed for a reduced draft vocabulary, unused otherwise.
        dtype (`torch.dtype`, *optional*): dtype of the float tensors; defaults to the drafter's.
    Returns:
        `dict[str, torch.Tensor]`, contiguous tensors that share no memory: the backbone under the drafter's keys;
        `lm_head.weight` `(K, hidden_size)` and `d2t` `(K,)` int64 for a reduced vocabulary; `anchor_broadcast.weight`
        `(hidden_size, hidden_size)` with the anchor term; `retrace.*` when retrace_mode is not off.
    """
    config = drafter.config
    check_exportable(config)
    dtype = drafter.fc.weight.dtype if dtype is None else dtype
    source = drafter.state_dict()
    known = (*_BACKBONE_PREFIXES, "retrace.", "anchor_broadcast.")
    unknown = [key for key in source if not key.startswith(known) and key not in _NOT_EXPORTED]
    if unknown:
        raise ExportError(f"the drafter has tensors the vLLM export does not know how to map: {unknown}")
    keys = [key for key in source if key.startswith(_BACKBONE_PREFIXES)]
    if config.anchor_broadcast:
        keys.append("anchor_broadcast.weight")
    if config.retrace_mode != "off":
        keys += _RETRACE_KEYS
    tensors = {key: source[key].detach().to(dtype) for key in keys}
    if config.draft_vocab_size is not None:
        ids = drafter.draft_vocab_ids.detach().cpu().long()  # [K], sorted target ids
        if target_head is None:
            raise ExportError(
                f"this drafter drafts over a reduced vocabulary ({len(ids)} of {config.vocab_size} tokens), so the "
                "export needs the target's lm head for its rows: pass the target with --target DIR"
            )
        if tuple(target_head.shape) != (config.vocab_size, config.hidden_size):
            raise ExportError(
                f"the target's lm head has shape {tuple(target_head.shape)}, the drafter needs "
                f"({config.vocab_size}, {config.hidden_size}): pass the target the drafter was trained for"
            )
        tensors["lm_head.weight"] = target_head.detach().cpu()[ids].to(dtype)  # [K, H]
        # vLLM maps draft id i to target id i + d2t[i] (qwen3_dflash.py, compute_logits)
        tensors["d2t"] = ids - torch.arange(len(ids))  # [K] int64
    return {key: tensor.cpu().contiguous().clone() for key, tensor in tensors.items()}


def export_for_vllm(
    drafter_dir: str | os.PathLike, output_dir: str | os.PathLike, target=None, *, dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:  # fmt: skip
    """Writes the vLLM folder of a drafter folder (module docstring).

    Args:
        drafter_dir (`str` or `os.PathLike`): a drafter folder (`save_pretrained`, a model card, a z-lab DFlash
            checkpoint).
        output_dir (`str` or `os.PathLike`): where to write; must not exist or be empty unless `overwrite`.
        target (`str`, `os.PathLike` or `PreTrainedModel`, *optional*): the target (a folder or a loaded model). Read
            for its lm head when the drafter has a reduced vocabulary, then defaulting to the project's default target
            (`hf_retrace.data.assets.load_default_target`); for a full-vocabulary drafter only checked when given.
        dtype (`torch.dtype`, *optional*): dtype of the exported float tensors; defaults to the drafter's.
        overwrite (`bool`, defaults to `False`): write into a non-empty `output_dir`.
    Returns:
        `Path` of `output_dir`.
    Raises:
        [`ExportError`] (a `ValueError`) for a drafter vLLM cannot express, a target that does not match, or an
        `output_dir` in use; `FileNotFoundError` for a missing drafter or target folder.
    """
    from ..models.modeling_retrace import ReTraceDrafterModel

    drafter_dir, output_dir = Path(drafter_dir), Path(output_dir)
    if not (drafter_dir / "config.json").is_file():
        raise FileNotFoundError(f"--drafter {drafter_dir}: not a drafter folder (no config.json)")
    _check_output_dir(output_dir, drafter_dir, overwrite)
    drafter = ReTraceDrafterModel.from_pretrained(drafter_dir, dtype="auto").eval()
    _drop_inert_retrace(drafter)
    check_exportable(drafter.config)
    head, num_target_layers = _target_head(drafter.config, target)
    dtype = drafter.fc.weight.dtype if dtype is None else dtype
    tensors = vllm_state_dict(drafter, head, dtype)
    has_datastore = (drafter_dir / DATASTORE_FILE).is_file()
    config = vllm_config(
        drafter.config, _decoding_policy(drafter), dtype=dtype, num_target_layers=num_target_layers,
        datastore_file=DATASTORE_FILE if has_datastore else None, source_commit=_source_commit(),
    )  # fmt: skip

    output_dir.mkdir(parents=True, exist_ok=True)
    _write_datastore(drafter_dir, output_dir)
    save_file(tensors, output_dir / "model.safetensors", metadata={"format": "pt"})
    _write_weight_index(tensors, output_dir)
    (output_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    logger.info(f"{output_dir}: {config['architectures'][0]}, {len(tensors)} tensors")
    return output_dir


def _target_head(drafter_config, target) -> tuple[torch.Tensor | None, int | None]:
    """`(lm-head weight [V, H] or None, target depth or None)`: the target is loaded and checked when given, or when
    the drafter's reduced vocabulary needs its head (then defaulting to the project's default target)."""
    if target is None and drafter_config.draft_vocab_size is None:
        return None, None  # the export does not depend on the target
    model = _load_target(target)
    check_target(drafter_config, model.config)
    head = model.get_output_embeddings()
    if head is None and drafter_config.draft_vocab_size is not None:
        raise ExportError(
            f"the target ({type(model).__name__}) has no lm head, and the drafter's reduced vocabulary needs its "
            "rows: pass the target's causal-LM folder (one that loads with AutoModelForCausalLM)"
        )
    return None if head is None else head.weight, model.config.get_text_config().num_hidden_layers


def _decoding_policy(drafter) -> dict:
    """The drafter's decoding policy under its `hf_retrace` block names ([`export_policy`]: every exported setting of
    the drafter and of each registered candidate source), validated and with unset values filled in
    (`drafter.decoding_settings()`; `num_assistant_tokens` unset is all `block_size - 1` drafts, written as that
    number)."""
    return export_policy(drafter.decoding_settings())


def _write_datastore(drafter_dir: Path, output_dir: Path) -> None:
    """Copies the drafter folder's `datastore.safetensors` byte for byte into `output_dir` (or removes one an earlier
    export left there)."""
    source, destination = drafter_dir / DATASTORE_FILE, output_dir / DATASTORE_FILE
    if source.is_file():
        shutil.copyfile(source, destination)
    elif destination.exists():  # left by an earlier export into this folder (`overwrite`)
        destination.unlink()


def _write_weight_index(tensors: dict, output_dir: Path) -> None:
    """`model.safetensors.index.json`, so vLLM loads weights from `model.safetensors` only (not the datastore)."""
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size}, "weight_map": {name: "model.safetensors" for name in sorted(tensors)}}
    (output_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _drop_inert_retrace(drafter) -> None:
    """Sets retrace_mode off where the ReTrace term is exactly zero: in modes `gated` and `corrected` the mask input
    gains `g * W_v(...)`, nothing when `W_v = 0` (a fresh drafter, or a z-lab DFlash checkpoint, which loads with the
    config's default mode and fresh ReTrace modules). Exported as off, such a drafter stays plain DFlash."""
    mode = drafter.config.retrace_mode
    if mode in ("gated", "corrected") and not drafter.retrace.value_proj.weight.any():
        logger.info(f"retrace_mode {mode!r} with W_v = 0 adds nothing; exported as 'off'")
        drafter.set_retrace_mode("off")


def _load_target(target):
    """A loaded target model from a model, a folder, or `None` (the project's default target, in float32)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    if isinstance(target, PreTrainedModel):
        return target
    if target is None:
        from ..data.assets import load_default_target

        return load_default_target(dtype=torch.float32)[0]
    if not (Path(target) / "config.json").is_file():
        raise FileNotFoundError(f"--target {target}: not a model folder (no config.json)")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(target, dtype="auto", output_loading_info=True)
    except ValueError as err:  # e.g. "Unrecognized configuration class" for a config with no causal-LM class
        raise ExportError(f"--target {target} does not load as a causal LM with an lm head ({err})") from err
    if info["missing_keys"]:  # a base-model folder loads as a causal LM with a random head, which must not ship
        raise ExportError(
            f"--target {target} lacks weights {sorted(info['missing_keys'])[:3]} (a base model without its lm head?): "
            "pass the target's causal-LM folder"
        )
    return model.eval()


def _check_output_dir(output_dir: Path, drafter_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and drafter_dir.exists() and output_dir.resolve() == drafter_dir.resolve():
        raise ExportError(f"--output {output_dir} is the drafter folder itself: pass a new folder")
    if output_dir.exists() and not output_dir.is_dir():
        raise ExportError(f"--output {output_dir} is a file, not a folder")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise ExportError(f"--output {output_dir} exists and is not empty: pass a new folder, or --overwrite")


def _source_commit() -> str | None:
    """The git commit of this hf_retrace checkout, or `None` where it is not one (an installed wheel)."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / ".git").exists() or shutil.which("git") is None:
        return None
    result = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


__all__ = [
    "DATASTORE_FILE",
    "ExportError",
    "PLAIN_ARCHITECTURE",
    "RETRACE_ARCHITECTURE",
    "check_exportable",
    "check_target",
    "export_for_vllm",
    "is_plain_dflash",
    "vllm_config",
    "vllm_state_dict",
]

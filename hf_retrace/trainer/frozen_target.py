# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""The frozen target under accelerate: sharded under FSDP and DeepSpeed ZeRO-3, placed on the device otherwise.

TRL prepares a frozen teacher / reference model with `prepare_deepspeed`, `prepare_fsdp` or
`accelerator.prepare_model(model, evaluation_mode=True)` and then calls the model's top-level forward. The trainer
here never does: it calls the target's parts (`get_decoder()(...)` for the features, `get_input_embeddings()` for
the block inputs, the `get_output_embeddings()` weight for the draft loss), and reads `config` and `name_or_path`.
So the target stays the unwrapped `PreTrainedModel` and only the part that holds most of its weights is sharded,
at a granularity whose gather hooks run on those calls:

- FSDP (`fsdp_version` 1 or 2): every decoder layer is its own FSDP unit (`fully_shard`, or an FSDP wrapper in
  place in the layer list), gathered in its own forward and resharded after it. The root is not wrapped: FSDP
  gathers a root's parameters only in the root's forward, which never runs. Embeddings, final norm and lm head
  stay whole on every rank (the draft loss reads the lm-head rows every step).
- DeepSpeed ZeRO-3: the decoder (`get_decoder()`, embeddings and layers) goes into an inference-only engine (no
  optimizer, as TRL's `prepare_deepspeed`). ZeRO-3 gathers per submodule, so direct calls to the embeddings work, and
  the engine's start-of-forward hook (it resets the parameter coordinator's step trace) sits on the decoder, which
  every feature computation calls; on the whole `*ForCausalLM`, whose forward never runs, that reset would never
  happen. ZeRO-1/2 shard no parameter: the target is replicated as below.
- Otherwise (one process, DDP, ZeRO-1/2): placed on `accelerator.device` as `prepare_model` places models (not moved
  when loaded with a multi-device `device_map`).

Precision: the target always computes in its own dtype, never under the run's mixed precision (no autocast, an FSDP
`MixedPrecisionPolicy()` that casts nothing, a DeepSpeed engine whose bf16/fp16 flags follow the target's dtype).
Its features condition the drafter, so they must be what inference feeds it (the target verifies in its own dtype)
and what the feature cache stores (computed without autocast); an earlier check measured accelerate's `bf16=True`
autocast moving them by ~2e-4. TRL's teacher does run under autocast, but its logits are only a soft target. A bf16
target is loaded in bf16 (`target_dtype`). This is also why the plain path does not call
`accelerator.prepare_model(target, evaluation_mode=True)`: besides placement it wraps the target's own `forward` in
autocast (what `target.generate` then runs under) and registers the target in `accelerator._models`, after which
`Trainer.evaluate()` before `train()` no longer prepares the drafter (under `bf16=True` its eval loss changed from
4.89548 to 4.89552 on the tiny test target).
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate.utils import DistributedType
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)


def prepare_frozen_target(target: nn.Module, accelerator) -> tuple[nn.Module, nn.Module | None]:
    """Freezes `target` and shards or places it for `accelerator`'s distributed set-up (see the module docstring).

    Args:
        target (`PreTrainedModel`): a `*ForCausalLM` whose decoder (`get_decoder()`) holds its layers in `.layers`.
        accelerator (`accelerate.Accelerator`): the trainer's; read are `distributed_type`, `device`,
            `state.deepspeed_plugin` / `state.fsdp_plugin`, and under FSDP `torch_device_mesh`.
    Returns:
        `(target, engine)`: `target` itself (same object and class, in eval mode, `requires_grad=False`, its unsharded
        tensors on `accelerator.device`) and the DeepSpeed engine that owns its ZeRO-3 partitions (keep a reference
        while the target is used), `None` otherwise.
    """
    target = target.eval().requires_grad_(False)
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED and _zero_stage(accelerator) == 3:
        return target, _partition_decoder_zero3(target, accelerator)
    if kind == DistributedType.FSDP:
        layers = getattr(target.get_decoder(), "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            sharded = _shard_layers_fsdp(layers, accelerator)
            _place_unsharded(target, accelerator.device, skip=sharded)
            return target, None
        logger.warning(f"{type(target).__name__} has no decoder `.layers` to shard; the target is replicated.")
    if accelerator.device_placement and not accelerator.verify_device_map(target):
        target = target.to(accelerator.device)
    return target, None


@contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[bool]:
    """Inside the block, the parameters of `module` hold their full values, also where DeepSpeed ZeRO-3 partitions
    them (outside a forward, a partitioned parameter is an empty placeholder). Yields whether they were partitioned:
    then a tensor read from them inside the block must be copied, as the gathered values are released after it."""
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        yield False
        return
    import deepspeed  # only reached when DeepSpeed partitioned the module

    with deepspeed.zero.GatheredParameters(partitioned):  # modifier_rank=None: read-only, nothing broadcast back
        yield True


def _zero_stage(accelerator) -> int:
    return int(accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"])


def _partition_decoder_zero3(target: nn.Module, accelerator) -> nn.Module:
    """Partitions the decoder in an inference-only ZeRO-3 engine built from the run's DeepSpeed config; returns the
    engine (its `module` is `target.get_decoder()`)."""
    import deepspeed  # imported here, as TRL does: importing DeepSpeed initialises state other backends trip on

    decoder = target.get_decoder()
    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    # Without an optimizer, the training-only blocks would make DeepSpeed build an optimizer / scheduler (or an
    # offloaded CPU Adam) with nothing to attach to.
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config["zero_optimization"]
    zero.pop("offload_optimizer", None)
    # transformers fills these "auto" buckets from the drafter's width only at train start; size them to the target.
    hidden = target.config.get_text_config().hidden_size
    buckets = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_param_persistence_threshold": 10 * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
    }
    for key, value in buckets.items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value
    # The target computes in its own dtype (module docstring): an engine with bf16/fp16 on would cast it.
    dtype = next(decoder.parameters()).dtype
    config["bf16"] = {"enabled": dtype == torch.bfloat16}
    config["fp16"] = {"enabled": dtype == torch.float16}
    engine, *_ = deepspeed.initialize(model=decoder, config=config)
    engine.eval()
    _place_unsharded(target, accelerator.device, skip=(decoder,))  # the lm head, outside the engine
    return engine


def _shard_layers_fsdp(layers: nn.ModuleList, accelerator) -> tuple[nn.Module, ...]:
    """Makes every decoder layer its own FSDP unit with the run's plugin settings, minus mixed precision (the target
    computes in its own dtype); returns the sharded modules (FSDP1 wrappers replace the layers in `layers`)."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = accelerator.torch_device_mesh
        if mesh is not None:
            mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
        for layer in layers:
            fully_shard(
                layer, mesh=mesh, reshard_after_forward=plugin.reshard_after_forward,
                offload_policy=plugin.cpu_offload, mp_policy=MixedPrecisionPolicy(),
            )  # fmt: skip
        return tuple(layers)
    if plugin.fsdp_version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for i, layer in enumerate(layers):
            layers[i] = FSDP(
                layer, sharding_strategy=plugin.sharding_strategy or plugin.reshard_after_forward,
                cpu_offload=plugin.cpu_offload, device_id=accelerator.device,
                sync_module_states=plugin.sync_module_states, limit_all_gathers=plugin.limit_all_gathers,
            )  # fmt: skip
        return tuple(layers)
    raise ValueError(f"FSDP version {plugin.fsdp_version} is not supported.")


def _place_unsharded(module: nn.Module, device: torch.device, skip: tuple[nn.Module, ...], moved=None) -> None:
    """Moves the parameters and buffers of `module` outside the `skip` subtrees to `device`, in place; a tied weight
    gets one moved parameter in every module that holds it. `Module.to` would also move the shards (FSDP2 refuses;
    a ZeRO-3 placeholder or an offloaded FSDP1 shard must stay where it is)."""
    moved = {} if moved is None else moved  # id(old parameter) -> its moved parameter
    if any(module is s for s in skip):
        return
    for name, param in list(module.named_parameters(recurse=False)):
        if hasattr(param, "ds_id") or param.device == device:  # a tied ZeRO-3 parameter stays partitioned
            continue
        if id(param) not in moved:
            moved[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
        setattr(module, name, moved[id(param)])
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.device != device:
            setattr(module, name, buffer.to(device))
    for child in module.children():
        _place_unsharded(child, device, skip, moved)


__all__ = ["gathered_parameters", "prepare_frozen_target"]

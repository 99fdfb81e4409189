# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports transformers and the standard library only, so `trust_remote_code=True` loads it.
# `modeling_retrace` imports this file, so loading the drafter, from the package or as remote code, installs the hook.
"""Where ReTrace plugs into `generate`: the hook that makes `target.generate(..., assistant_model=drafter)` pick the
ReTrace candidate generator, and [`retrace_generate`], the `custom_generate` callable that patches nothing.

Both build the generator of the drafter's own code copy (this package, or a `trust_remote_code` module), so a
drafter loaded as remote code runs its own `generation_retrace.py`.
"""

import functools
import importlib
import re
import warnings

import transformers
from transformers.generation.utils import GenerationMixin


SUPPORTED_TRANSFORMERS = ((5, 24), (6, 0))  # [min, max) as (major, minor)


def validate_drafter_for_target(target, drafter) -> None:
    """Raises `ValueError` with the fix when `drafter` was not built for `target` (sizes, vocabulary, depth)."""
    tcfg, dcfg = target.config.get_text_config(), drafter.config
    if dcfg.hidden_size != tcfg.hidden_size or dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(
            f"Drafter (hidden_size={dcfg.hidden_size}, vocab_size={dcfg.vocab_size}) does not match the target "
            f"(hidden_size={tcfg.hidden_size}, vocab_size={tcfg.vocab_size}); use a drafter built for this target, "
            "e.g. `ReTraceDrafterModel.from_target(target)`."
        )
    if max(dcfg.target_layer_ids) >= tcfg.num_hidden_layers:
        raise ValueError(
            f"Drafter target_layer_ids {dcfg.target_layer_ids} must be < the target's num_hidden_layers "
            f"({tcfg.num_hidden_layers}); this drafter was built for a deeper target."
        )


def check_batch_size(batch_size: int) -> None:
    if batch_size != 1:
        raise ValueError(
            f"ReTrace speculative decoding supports batch size 1 only, got {batch_size}: each sequence accepts a "
            "different number of drafts per round, so target and drafter caches would diverge (transformers' "
            "assisted decoding has the same limit). Call `generate` once per prompt."
        )


def is_retrace_drafter(model) -> bool:
    """True for ReTrace drafters, whether from this package or loaded with `trust_remote_code`."""
    config = getattr(model, "config", None)
    return config is not None and config.model_type == "retrace_drafter"


def make_candidate_generator(target, drafter, input_ids, generation_config, logits_processor):
    """Builds the ReTrace generator of `drafter`'s own code copy (package or remote code) for `target`."""
    validate_drafter_for_target(target, drafter)
    check_batch_size(input_ids.shape[0])
    generator_cls = _generator_class_of(drafter)
    return generator_cls(
        assistant_model=drafter,
        main_model_input_embeddings=target.get_input_embeddings(),
        main_model_output_embeddings=target.get_output_embeddings(),  # the generator builds its draft head from it
        generation_config=generation_config,
        logits_processor=logits_processor,
        target=target,  # the cost-aware policy profiles its step costs on it (once per host and configuration)
    )


def unwrap_drafter(model):
    """The drafter inside `torch.compile` (`_orig_mod`) and PEFT (`get_base_model()`) wrappers, in any nesting."""
    for _ in range(8):  # wrappers nest a few levels at most
        inner = getattr(model, "_orig_mod", None)
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if inner is None or inner is model:
            return model
        model = inner
    return model


def _generator_class_of(drafter):
    """The candidate generator of the drafter's own code copy (this package, or a `trust_remote_code` module), found
    from the drafter's class hierarchy rather than the wrapper's module name (`torch._dynamo`, `peft`, ...)."""
    for cls in type(unwrap_drafter(drafter)).__mro__:
        if cls.__module__.rsplit(".", 1)[-1] == "modeling_retrace":
            package = cls.__module__.rsplit(".", 1)[0]
            return importlib.import_module(f"{package}.generation_retrace").ReTraceCandidateGenerator
    raise TypeError(f"{type(drafter).__name__} wraps no ReTrace drafter (no modeling_retrace class in its hierarchy)")


def install_generate_hook() -> bool:
    """Makes `target.generate(..., assistant_model=retrace_drafter)` use [`ReTraceCandidateGenerator`].

    transformers 5.24 has no public hook for an assistant to supply its candidate generator. This wraps the two
    `GenerationMixin` methods that decide it: `_validate_generation_mode` (so a mismatched drafter gets our error,
    not the universal-assisted-decoding one) and `_get_candidate_generator` (the dispatch); every other assistant
    falls through. Called when this file is imported (by the package or as remote code). Each wrapper is installed
    at most once across the package and remote-code copies (the marker lives on the wrapper), so calling this again
    changes nothing.

    On a transformers version outside `SUPPORTED_TRANSFORMERS` (the private methods may have changed) it wraps
    nothing and warns: the drafter still loads, and `speculation_type="dflash"` runs it through transformers' own
    DFlash path (plain DFlash drafts, lossless, no ReTrace conditioning).

    Returns:
        `bool`: whether the hook is installed.
    """
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", transformers.__version__).groups())
    if not SUPPORTED_TRANSFORMERS[0] <= installed < SUPPORTED_TRANSFORMERS[1]:
        warnings.warn(
            f"hf_retrace's generate hook supports transformers >=5.24,<6; found {transformers.__version__}, so it is "
            "not installed. Pass `speculation_type=\"dflash\"` to run ReTrace drafters through transformers' own "
            "DFlash path (plain DFlash drafts, no ReTrace conditioning), or install `transformers>=5.24,<6`.",
            stacklevel=2,
        )
        return False
    GenerationMixin._validate_generation_mode = _wrap_once(GenerationMixin._validate_generation_mode, _wrap_validation)
    GenerationMixin._get_candidate_generator = _wrap_once(GenerationMixin._get_candidate_generator, _wrap_dispatch)
    return True


def _wrap_once(method, wrap):
    """`wrap(method)` marked as ours, or `method` itself when it already is one of our wrappers (from this copy of
    the file or another: package and remote-code copies share the marker attribute, not the function objects)."""
    if getattr(method, "_retrace_hook", False):
        return method
    wrapped = wrap(method)
    wrapped._retrace_hook = True
    return wrapped


def _wrap_validation(original):
    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        if is_retrace_drafter(generation_mode_kwargs.get("assistant_model")):
            validate_drafter_for_target(self, generation_mode_kwargs["assistant_model"])
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _wrap_dispatch(original):
    @functools.wraps(original)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, **kwargs):  # fmt: skip
        if is_retrace_drafter(assistant_model) and generation_config.speculation_type in (None, "retrace"):
            return make_candidate_generator(self, assistant_model, input_ids, generation_config, logits_processor)
        return original(
            self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
            assistant_model=assistant_model, **kwargs,
        )  # fmt: skip

    return _get_candidate_generator


class _TargetWithCandidateGenerator:
    """A view of the target whose `_get_candidate_generator` returns a fixed generator; everything else is the
    target's own. Lets [`retrace_generate`] reuse `_assisted_decoding` without patching any class."""

    def __init__(self, target, candidate_generator):
        self._target, self._candidate_generator = target, candidate_generator

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        return self._target(*args, **kwargs)

    def _get_candidate_generator(self, *args, **kwargs):
        return self._candidate_generator


def retrace_generate(
    model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, drafter=None,
    **model_kwargs,
):  # fmt: skip
    """`custom_generate` callable: `target.generate(**inputs, custom_generate=retrace_generate, drafter=drafter)`.

    Runs transformers' assisted-decoding loop with the ReTrace generator and patches nothing.
    (transformers does not forward `streamer` to custom callables; use `assistant_model=` for streaming.)
    """
    if drafter is None:
        raise ValueError("retrace_generate needs `drafter=`: a ReTrace drafter built for this target.")
    generator = make_candidate_generator(model, drafter, input_ids, generation_config, logits_processor)
    view = _TargetWithCandidateGenerator(model, generator)
    return GenerationMixin._assisted_decoding(
        view, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        generation_config=generation_config, synced_gpus=synced_gpus, **model_kwargs,
    )  # fmt: skip


__all__ = [
    "install_generate_hook",
    "is_retrace_drafter",
    "make_candidate_generator",
    "retrace_generate",
    "unwrap_drafter",
    "validate_drafter_for_target",
]


# Installed on import, not in the model constructor: `import hf_retrace`, and loading the drafter with
# `trust_remote_code=True` (its modeling file imports this one), both make `assistant_model=drafter` work.
install_generate_hook()

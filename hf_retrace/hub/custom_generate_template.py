# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Template of `custom_generate/generate.py` in a ReTrace drafter repo, written there by `hf_retrace.hub.publish`.
# Hub file: imports transformers only, so it runs without hf_retrace installed.
"""`custom_generate` recipe of a ReTrace drafter repo: ReTrace speculative decoding with the drafter stored in the same
repo or folder.

    out = target.generate(**inputs, custom_generate="<repo id or folder>", trust_remote_code=True, max_new_tokens=64)

transformers copies this file into its modules cache, so `__file__` does not tell where the drafter lives. Instead
`hf_retrace.hub.publish` writes it into `DRAFTER_SOURCE` below: the Hub repo id once published (or when `repo_id=` is
given to `save_for_hub`), otherwise the absolute path of the folder it was saved to. Pass `drafter=` (a loaded
drafter, a repo id or a folder) to override it, and `drafter_kwargs=` (e.g. `{"revision": "v1"}`) for its
`from_pretrained`.
"""

import functools
import importlib

from transformers import AutoModel


DRAFTER_SOURCE = None  # written by hf_retrace.hub.publish: repo id or absolute folder of the drafter


@functools.lru_cache(maxsize=4)
def _load_drafter(source: str, drafter_kwargs: tuple):
    """Loads the drafter once per (source, kwargs); its code comes from the same repo via `trust_remote_code`."""
    return AutoModel.from_pretrained(source, trust_remote_code=True, **dict(drafter_kwargs)).eval()


def _retrace_generate_of(drafter):
    """`retrace_generate` from the drafter's own code copy (the repo's `hook_retrace.py`)."""
    package = type(drafter).__module__.rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.hook_retrace").retrace_generate


def generate(model, drafter=None, drafter_kwargs=None, assistant_model=None, **kwargs):
    """Runs `model.generate(**kwargs)` with ReTrace speculative decoding.

    Args:
        model (`PreTrainedModel`): the target; transformers passes it.
        drafter (`PreTrainedModel` or `str`, *optional*, defaults to `DRAFTER_SOURCE`): the drafter, or where to
            load it from. It is moved to the target's device and dtype.
        drafter_kwargs (`dict`, *optional*): extra `from_pretrained` arguments when the drafter is loaded here.
        kwargs: the usual `generate` arguments (`input_ids`, `max_new_tokens`, `generation_config`, ...).
    Returns:
        What `generate` returns: the sequences, or a `GenerateOutput` when `return_dict_in_generate=True`.
    """
    if assistant_model is not None:
        raise ValueError("This recipe supplies its own drafter; pass `drafter=` instead of `assistant_model=`.")
    if drafter is None or isinstance(drafter, str):
        source = drafter or DRAFTER_SOURCE
        if source is None:
            raise ValueError("No drafter location recorded in this recipe; pass `drafter=<repo id or folder>`.")
        drafter = _load_drafter(str(source), tuple(sorted((drafter_kwargs or {}).items())))
    drafter.to(device=model.device, dtype=model.dtype)
    return model.generate(**kwargs, custom_generate=_retrace_generate_of(drafter), drafter=drafter)

"""hf_retrace: ReTrace speculative decoding (rejected-trajectory conditioning on a DFlash drafter) for transformers.

`import hf_retrace` registers the drafter with the Auto classes and (by importing `models.hook_retrace`) makes
`target.generate(..., assistant_model=drafter)` pick the ReTrace candidate generator.

Sub-packages: `models` (the Hub files), `trainer`, `data`, `bench`, `hub`; `cli` is the `hf-retrace` command.
"""

from transformers import AutoConfig, AutoModel

from .models.configuration_retrace import RETRACE_MODES, ReTraceDrafterConfig, default_target_layer_ids
from .models.sources_retrace import CandidateSource
from .models.decoding_retrace import ReTraceDecodingSettings
from .models.generation_retrace import (
    ReTraceCandidateGenerator,
    ReTraceConditioning,
    ReTraceGenerationStats,
    build_rejected_trajectory,
)
from .models.hook_retrace import install_generate_hook, retrace_generate
from .models.modeling_retrace import ReTraceDrafterModel, ReTraceDrafterPreTrainedModel
from .hub import publish as _publish


__version__ = "0.1.0"

AutoConfig.register(ReTraceDrafterConfig.model_type, ReTraceDrafterConfig, exist_ok=True)
AutoModel.register(ReTraceDrafterConfig, ReTraceDrafterModel, exist_ok=True)
ReTraceDrafterModel.hub_publisher = staticmethod(_publish.push_to_hub)

# Training needs the `train` extra (trl, datasets, peft); import it only when asked for.
_LAZY = {"ReTraceTrainer": "hf_retrace.trainer.trainer", "ReTraceConfig": "hf_retrace.trainer.config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_retrace' has no attribute {name!r}")


__all__ = [
    "CandidateSource",
    "ReTraceConfig",
    "ReTraceTrainer",
    "RETRACE_MODES",
    "ReTraceCandidateGenerator",
    "ReTraceConditioning",
    "ReTraceDecodingSettings",
    "ReTraceDrafterConfig",
    "ReTraceDrafterModel",
    "ReTraceDrafterPreTrainedModel",
    "ReTraceGenerationStats",
    "build_rejected_trajectory",
    "default_target_layer_ids",
    "install_generate_hook",
    "retrace_generate",
]

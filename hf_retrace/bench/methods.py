"""The decoding methods `hf-retrace bench` compares (`--methods`) and the record of one generation.

`ar` (the target alone) is the reference every other method's greedy output must equal token for token; a drafter
method loads a drafter folder, optionally overriding its `retrace_mode` (definitions: `hf_retrace.bench.run`).
"""

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..models.configuration_retrace import RETRACE_MODES
from ..models.modeling_retrace import ReTraceDrafterModel
from .timing import ConditioningTimer, TargetCycleRecorder


REFERENCE = "ar"
DEFAULT_LOOKUP_TOKENS = 10


@dataclass
class Generation:
    """One method on one prompt."""

    method: str
    prompt_set: str
    prompt_index: int
    token_ids: list[int]
    seconds: float
    acceptance_lengths: list[int]
    target_forwards: int
    conditioning_seconds: float = 0.0
    num_conditioned_rounds: int = 0



@dataclass
class MethodSpec:
    """One `--methods` entry. `kind` is `ar`, `prompt_lookup` or `drafter`; `retrace_mode=None` keeps the saved one;
    `settings` are decoding settings set on the drafter's `generation_config` (`None` = unset)."""

    name: str
    kind: str
    folder: str | None = None
    retrace_mode: str | None = None
    num_lookup_tokens: int = DEFAULT_LOOKUP_TOKENS
    settings: dict = field(default_factory=dict)


def parse_methods(text: str) -> list[MethodSpec]:
    """Parses `ar,prompt_lookup[=K],NAME=prompt_lookup:K,dflash=FOLDER,NAME=FOLDER[:MODE],...`; `ar` is prepended
    when absent."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, has_value, value = item.partition("=")
        if name == REFERENCE and not has_value:
            specs.append(MethodSpec(name, "ar"))
        elif name == "prompt_lookup":
            specs.append(
                MethodSpec(name, "prompt_lookup", num_lookup_tokens=int(value) if has_value else DEFAULT_LOOKUP_TOKENS)
            )
        elif has_value and value.startswith("prompt_lookup:") and name not in (REFERENCE, "pooled"):
            tokens = value.partition(":")[2]
            if not tokens.isdigit() or int(tokens) < 1:
                raise ValueError(f"expected NAME=prompt_lookup:K with K >= 1 lookup tokens, got {item!r}")
            specs.append(MethodSpec(name, "prompt_lookup", num_lookup_tokens=int(tokens)))
        elif has_value and value and name not in (REFERENCE, "pooled"):
            value, settings = split_settings(value)
            folder, mode = split_retrace_mode(value)
            if name == "dflash":
                if mode not in (None, "off"):
                    raise ValueError(
                        f"`dflash` always runs with retrace_mode='off'; name the method otherwise: {item}"
                    )
                mode = "off"
            specs.append(MethodSpec(name, "drafter", folder, mode, settings=settings))
        else:
            raise ValueError(
                f"cannot parse method {item!r}; expected ar, prompt_lookup[=K], NAME=prompt_lookup:K, "
                "dflash=FOLDER or NAME=FOLDER[:MODE][:key=value...]"
            )
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    if REFERENCE not in names:
        specs.insert(0, MethodSpec(REFERENCE, "ar"))
    return specs


def split_settings(value: str) -> tuple[str, dict]:
    """`FOLDER[:MODE]:key=value:...` -> `(FOLDER[:MODE], {key: value})`; values are ints, floats, `None` or text."""
    settings = {}
    while ":" in value and "=" in value.rpartition(":")[2]:
        value, _, pair = value.rpartition(":")
        key, _, text = pair.partition("=")
        settings[key] = setting_value(text)
    return value, dict(reversed(settings.items()))


def setting_value(text: str):
    """A decoding setting's value from text: `None`, an int, a float, else the text."""
    if text == "None":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def split_retrace_mode(value: str) -> tuple[str, str | None]:
    """`FOLDER:MODE` -> `(FOLDER, MODE)` when MODE is a retrace mode, else `(value, None)` (colons in paths stay)."""
    folder, sep, mode = value.rpartition(":")
    return (folder, mode) if sep and mode in RETRACE_MODES else (value, None)


def load_drafter(
    folder: str, retrace_mode: str | None, dtype: torch.dtype, device, draft_logits_dtype: str | None = None,
    settings: dict | None = None,
) -> ReTraceDrafterModel:
    """Loads a drafter folder, optionally overriding its `retrace_mode`, `draft_logits_dtype` and other decoding
    `settings` (same weights); a bad setting raises `ValueError` here, before any generation."""
    drafter = ReTraceDrafterModel.from_pretrained(folder, dtype=dtype)
    if retrace_mode is not None:
        drafter.set_retrace_mode(retrace_mode)
    if draft_logits_dtype is not None:
        drafter.generation_config.draft_logits_dtype = None if draft_logits_dtype == "target" else draft_logits_dtype
    if settings:
        for key, value in settings.items():
            setattr(drafter.generation_config, key, value)
        drafter.decoding_settings()  # checks them (unknown keys, ranges)
    return drafter.to(device).eval()


class Method:
    """A loaded `MethodSpec`: what to pass to `generate`, and how to read its cycles."""

    def __init__(self, spec: MethodSpec, dtype: torch.dtype, device, draft_logits_dtype: str | None = None):
        self.spec, self.name = spec, spec.name
        self.drafter = None
        if spec.kind == "drafter":
            self.drafter = load_drafter(spec.folder, spec.retrace_mode, dtype, device, draft_logits_dtype,
                                        spec.settings)

    @property
    def block_size(self) -> int:
        """Most tokens one cycle can commit."""
        if self.drafter is not None:
            return self.drafter.config.block_size
        return self.spec.num_lookup_tokens + 1 if self.spec.kind == "prompt_lookup" else 1

    @property
    def retrace_mode(self) -> str | None:
        return None if self.drafter is None else self.drafter.config.retrace_mode

    def generate_kwargs(self) -> dict:
        if self.spec.kind == "prompt_lookup":
            return {"prompt_lookup_num_tokens": self.spec.num_lookup_tokens}
        return {"assistant_model": self.drafter} if self.drafter is not None else {}

    def run(self, target, input_ids: torch.LongTensor, generate_kwargs: dict, prompt_set: str, index: int):
        recorder = TargetCycleRecorder(target, input_ids.shape[1])
        timer = ConditioningTimer(self.drafter) if self.drafter is not None else None
        try:
            with timer if timer is not None else contextlib.nullcontext():
                _sync(target.device)
                start = time.perf_counter()
                output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs,
                                         **self.generate_kwargs())  # fmt: skip
                _sync(target.device)
                seconds = time.perf_counter() - start
        finally:
            recorder.remove()
        per_forward = recorder.committed(output.shape[1])
        stats = self.drafter.last_generation_stats if self.drafter is not None else None
        return Generation(
            method=self.name,
            prompt_set=prompt_set,
            prompt_index=index,
            token_ids=output[0, input_ids.shape[1] :].tolist(),
            seconds=seconds,
            acceptance_lengths=list(stats.acceptance_lengths) if stats is not None else per_forward,
            target_forwards=len(per_forward),
            conditioning_seconds=timer.seconds if timer is not None else 0.0,
            num_conditioned_rounds=stats.num_conditioned_rounds if stats is not None else 0,
        )


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

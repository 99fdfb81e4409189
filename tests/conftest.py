"""Tiny random targets and drafters shared by the tests. Everything runs offline on CPU in seconds."""

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import hf_retrace  # noqa: E402,F401  (installs the generate hook)
from hf_retrace import ReTraceDrafterModel  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests are skipped without a CUDA device, whatever `-m` selects (`-m "not slow"` included)."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


VOCAB = 128
# Tokens the "restricted" targets can emit: a and b = -a guarantee max(logit_a, logit_b) >= 0 = every other logit,
# so greedy never leaves {a, b, c}; c is a third direction used as an EOS that appears mid-sequence.
SUPPORT = (5, 6, 7)

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512, bos_token_id=1, eos_token_id=None,
    pad_token_id=0,
)  # fmt: skip
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"head_dim": 8}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"head_dim": 8, "sliding_window": None}),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {"head_dim": 8, "sliding_window": 256, "query_pre_attn_scalar": 8},
    ),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    # its forward scales `inputs_embeds` by `embedding_multiplier` (1.0 here; a feature-resumption test raises it)
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, {"head_dim": 8}),
}


def make_target(arch: str = "qwen3", seed: int = 0, restricted: bool = True, **overrides):
    """A tiny random causal LM. `restricted=True` makes its greedy choice always one of `SUPPORT`, so that a random
    drafter (which scores drafts with the same lm head) gets tokens accepted and every `n` in `0..B-1` occurs."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra, **overrides})
    model = model_cls(config).eval()
    if restricted:
        with torch.no_grad():
            head = model.get_output_embeddings().weight  # [V, H]
            a, b, c = SUPPORT
            direction, third = torch.randn(2, head.shape[1])
            head.zero_()
            head[a], head[b], head[c] = direction, -direction, 0.5 * third
            # Same input embedding for a, b, c: the next token then depends on the whole context rather than
            # flip-flopping on the last token, which gives runs a random drafter sometimes matches.
            embed = model.get_input_embeddings().weight
            embed[b], embed[c] = embed[a], embed[a]
    return model


def make_drafter(
    target, block_size: int = 4, mode: str = "corrected", seed: int = 1, nonzero_retrace: bool = True,
    anchor_broadcast: bool = False,
):  # fmt: skip
    """A 1-layer drafter for `target`; `nonzero_retrace=True` gives W_v, W_c and the gate random values so the
    conditioning path really changes the drafts (and W_a too with `anchor_broadcast=True`)."""
    torch.manual_seed(seed)
    drafter = ReTraceDrafterModel.from_target(
        target, num_hidden_layers=1, block_size=block_size, retrace_mode=mode, anchor_broadcast=anchor_broadcast
    )
    if nonzero_retrace:
        with torch.no_grad():
            for param in drafter.retrace.parameters():
                param.normal_(0.0, 0.5)
            if anchor_broadcast:
                drafter.anchor_broadcast.weight.normal_(0.0, 0.5)
    return drafter.eval()


def random_prompt(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(8, VOCAB, (1, length), generator=generator)


def lossless_call_with(max_new_tokens: int, **setting):
    """A greedy `generate` call of a tiny qwen3 target with a fresh B = 4 drafter and a decoding `setting` for that
    call (e.g. `num_assistant_tokens=1`), asserted equal to the target's own greedy output.

    Returns:
        `(drafter, again)`: `again(**kwargs)` runs the same speculative call without `setting`, with `kwargs` instead.
    """
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="corrected")
    prompt = random_prompt(6, seed=3)
    again = functools.partial(target.generate, prompt, do_sample=False, pad_token_id=0, max_new_tokens=max_new_tokens,
                              assistant_model=drafter)  # fmt: skip
    expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=max_new_tokens)
    assert again(**setting).tolist() == expected.tolist()
    return drafter, again


def assert_greedy_matches(target, drafter, references: list, label: str = "") -> None:
    """Speculative greedy on `random_prompt(5, seed=i)` equals `references[i]` (the target's own greedy output, taken
    before the kernels or the attention under test were switched on), and some draft was accepted, so that
    multi-row verification forwards were checked."""
    accepted = []
    for i, expected in enumerate(references):
        got = target.generate(random_prompt(5, seed=i), do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert got.tolist() == expected.tolist(), f"{label}: speculative output differs on prompt {i}"
        accepted += drafter.last_generation_stats.acceptance_lengths
    assert max(accepted) > 1, "no draft was ever accepted, so no multi-row verification was checked"


@pytest.fixture
def tiny_target():
    return make_target("qwen3")


@pytest.fixture
def tiny_drafter(tiny_target):
    return make_drafter(tiny_target)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh_python(code: str, timeout: int = 300):
    """Runs `code` in a fresh interpreter (this checkout and tests/ on its path, offline, 1 thread), so that what it
    checks about process-wide state (patched classes, import-time side effects) does not depend on earlier tests."""
    import subprocess
    import sys

    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)

"""Lossless greedy decoding: ReTrace speculative output == target-only greedy output, token for token."""

import pytest
import torch

from conftest import ARCHITECTURES, SUPPORT, make_drafter, make_target, random_prompt, run_fresh_python
from hf_retrace import RETRACE_MODES, retrace_generate


BLOCK = 4
# (prompt length, max_new_tokens): lengths not multiples of the block, and one shorter than a block; then more
# prompts until every acceptance length has been seen (at most 16 in all).
CASES = [(5, 23), (9, 2), (3, 30)] + [(3 + i % 6, 31) for i in range(13)]
THRESHOLD = 0.5  # a draft probability the tiny random drafter's drafts fall on both sides of


def _greedy(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize(
    "arch, mode, anchor_broadcast",
    [(arch, mode, False) for arch in sorted(ARCHITECTURES) for mode in RETRACE_MODES]
    + [(arch, mode, True) for arch in ("llama", "qwen3") for mode in ("off", "corrected")],
)
def test_greedy_is_lossless(arch, mode, anchor_broadcast):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=BLOCK, mode=mode, anchor_broadcast=anchor_broadcast)
    acceptance, conditioned = set(), 0
    for i, (length, max_new) in enumerate(CASES):
        prompt = random_prompt(length, seed=i)
        expected = _greedy(target, prompt, max_new_tokens=max_new)
        got = _greedy(target, prompt, max_new_tokens=max_new, assistant_model=drafter)
        assert got.tolist() == expected.tolist(), f"{arch}/{mode}: speculative output differs on case {i}"
        stats = drafter.last_generation_stats
        assert sum(stats.acceptance_lengths) <= max_new - 1  # the prefill token is not a verification cycle
        acceptance.update(stats.acceptance_lengths)
        conditioned += stats.num_conditioned_rounds
        if i >= 2 and len(acceptance) == BLOCK:
            break
    # Every n in 0..B-1 (committed n+1 in 1..B) must have been exercised, or the test proves little.
    assert acceptance == set(range(1, BLOCK + 1)), f"{arch}/{mode}: acceptance lengths seen {sorted(acceptance)}"
    assert (conditioned > 0) == (mode != "off"), f"{arch}/{mode}: {conditioned} conditioned rounds"


def _lossless_runs(target, drafter, label):
    """Yields `(case, stats, widths)` per case of `CASES`, once its speculative output equals target-only greedy;
    `widths` are the input lengths of the speculative run's target forwards (prefill, then one per cycle)."""
    widths = []
    hook = target.register_forward_hook(
        lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        for i, (length, max_new) in enumerate(CASES):
            prompt = random_prompt(length, seed=i)
            expected = _greedy(target, prompt, max_new_tokens=max_new)
            widths.clear()
            got = _greedy(target, prompt, max_new_tokens=max_new, assistant_model=drafter)
            assert got.tolist() == expected.tolist(), f"{label}: speculative output differs on case {i}"
            yield i, drafter.last_generation_stats, list(widths)
    finally:
        hook.remove()


@pytest.mark.parametrize("mode", ["off", "corrected"])
def test_verifying_only_the_first_k_drafts_is_lossless(mode):
    """`num_assistant_tokens = k < B-1`: each cycle verifies `k+1` tokens, output is still the target's, and ReTrace
    keeps only the rejected slots that have verification features (`L = k-1-n` instead of `B-2-n`)."""
    block, k = 6, 3
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=block, mode=mode)
    drafter.generation_config.num_assistant_tokens = k
    acceptance = set()
    for i, stats, widths in _lossless_runs(target, drafter, mode):
        assert widths[1:].count(k + 1) == len(stats.acceptance_lengths)  # every drafted cycle verified k+1 tokens
        assert max(widths[1:], default=1) <= k + 1
        retained = [max(k - committed, 0) if mode != "off" else 0 for committed in stats.acceptance_lengths]
        assert stats.retained_lengths == retained
        acceptance.update(stats.acceptance_lengths)
        if i >= 2 and len(acceptance) == k + 1:
            break
    assert acceptance == set(range(1, k + 2)), f"{mode}: acceptance lengths seen {sorted(acceptance)}"


@pytest.mark.parametrize("mode", ["off", "corrected"])
def test_confidence_stop_is_lossless(mode):
    """`assistant_confidence_threshold`: each cycle verifies only its leading confident drafts, or none (a plain target
    step after the drafter ran); output is still the target's and every drafter forward is one counted cycle."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=BLOCK, mode=mode)
    drafter.generation_config.assistant_confidence_threshold = THRESHOLD
    verified = set()
    for _, stats, widths in _lossless_runs(target, drafter, mode):
        assert stats.num_drafter_forwards == len(stats.acceptance_lengths)
        cycles = widths[1 : 1 + len(stats.acceptance_lengths)]  # after the prefill; a last plain step may follow
        assert all(committed <= width for committed, width in zip(stats.acceptance_lengths, cycles))
        verified.update(cycles)
    assert {1, BLOCK} < verified, f"verified lengths seen {sorted(verified)}: the threshold never (or always) stopped"


def _prompt_with_mid_block_eos(target, eos):
    """A prompt whose target greedy text reaches `eos` after a few tokens, at a position inside a block."""
    for seed in range(200):
        prompt = random_prompt(6, seed=seed)
        new = _greedy(target, prompt, max_new_tokens=40)[0, prompt.shape[1] :].tolist()
        if eos in new and new.index(eos) >= 3 and (new.index(eos) - 1) % BLOCK != 0:
            return prompt
    raise AssertionError("no prompt reaches the EOS token mid-block; change the target seed")


@pytest.mark.parametrize("mode", ["off", "corrected"])
def test_eos_inside_a_block_stops_like_the_target(mode):
    target = make_target("llama", seed=3)
    drafter = make_drafter(target, block_size=BLOCK, mode=mode)
    eos = SUPPORT[2]
    prompt = _prompt_with_mid_block_eos(target, eos)
    expected = _greedy(target, prompt, max_new_tokens=40, eos_token_id=eos)
    got = _greedy(target, prompt, max_new_tokens=40, eos_token_id=eos, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    assert got[0, -1].item() == eos


PATCHES_NOTHING = r"""
import torch
from transformers.generation.utils import GenerationMixin
from conftest import make_drafter, make_target, random_prompt
from hf_retrace import retrace_generate

# importing hf_retrace installed the assistant_model= hook; take it off again, so what follows shows that the
# custom_generate route neither needs it nor puts anything back
GenerationMixin._get_candidate_generator = GenerationMixin._get_candidate_generator.__wrapped__
GenerationMixin._validate_generation_mode = GenerationMixin._validate_generation_mode.__wrapped__
target = make_target("qwen3")
drafter = make_drafter(target)
classes = [cls for cls in type(target).__mro__ if cls is not object]
before = {cls: dict(vars(cls)) for cls in classes}
instance_before = set(vars(target))
prompt = random_prompt(7, seed=11)
expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=25)
got = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=25, custom_generate=retrace_generate,
                      drafter=drafter)
assert got.tolist() == expected.tolist(), (got, expected)
assert drafter.last_generation_stats.num_drafter_forwards > 0
assert not getattr(GenerationMixin._get_candidate_generator, "_retrace_hook", False)
assert not getattr(GenerationMixin._validate_generation_mode, "_retrace_hook", False)
changed = [cls.__name__ for cls in classes if dict(vars(cls)) != before[cls]]
assert not changed, changed
assert set(vars(target)) == instance_before, set(vars(target)) ^ instance_before
print("OK")
"""


@pytest.mark.slow
def test_custom_generate_route_is_lossless_and_patches_nothing():
    """In a fresh process with the hook taken off: the route is lossless and leaves every class of the target's MRO
    (GenerationMixin included) and the target instance as they were."""
    proc = run_fresh_python(PATCHES_NOTHING)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_streamer_and_logits_processor_are_honoured(tiny_target, tiny_drafter):
    from transformers.generation.logits_process import LogitsProcessorList, NoRepeatNGramLogitsProcessor
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            pass

    prompt = random_prompt(5, seed=4)
    processors = LogitsProcessorList([NoRepeatNGramLogitsProcessor(3)])
    expected = _greedy(tiny_target, prompt, max_new_tokens=20, logits_processor=processors)
    streamer = Collect()
    got = _greedy(
        tiny_target, prompt, max_new_tokens=20, logits_processor=processors, assistant_model=tiny_drafter,
        streamer=streamer,
    )  # fmt: skip
    assert got.tolist() == expected.tolist()
    assert streamer.tokens == got[0].tolist()  # prompt first, then every committed token once
    torch.testing.assert_close(got, expected)


def test_bf16_draft_logits_score_drafts_only_and_stay_lossless():
    """`draft_logits_dtype="bfloat16"`: the generator scores drafts with a cached bf16 copy of the lm head (fp32
    logits out, so sampler and acceptance test read the same q; see test_sampling.py); greedy output is still the
    target's."""
    from hf_retrace.models.draft_head_retrace import DraftLMHead, draft_lm_head

    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK, mode="corrected")
    drafter.generation_config.draft_logits_dtype = "bfloat16"
    head = target.get_output_embeddings()
    draft_head = draft_lm_head(head, "bfloat16")
    assert isinstance(draft_head, DraftLMHead) and draft_head.weight.dtype == torch.bfloat16
    assert draft_lm_head(head, "bfloat16") is draft_head  # cached per lm head
    states = torch.randn(1, 3, head.weight.shape[1])
    logits = draft_head(states)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, head(states.bfloat16().float()), rtol=2e-2, atol=2e-2)
    assert draft_lm_head(head, None) is head and draft_lm_head(head, "float32") is head
    for i, (length, max_new) in enumerate(CASES[:6]):
        prompt = random_prompt(length, seed=i)
        expected = _greedy(target, prompt, max_new_tokens=max_new)
        got = _greedy(target, prompt, max_new_tokens=max_new, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
    drafter.generation_config.draft_logits_dtype = "int8"
    with pytest.raises(ValueError, match="draft_logits_dtype must be one of"):
        _greedy(target, random_prompt(4, seed=0), max_new_tokens=4, assistant_model=drafter)


@pytest.mark.slow
def test_wrapped_drafters_pick_the_retrace_generator_and_stay_lossless():
    """`assistant_model=torch.compile(drafter)` and a PEFT-wrapped drafter: the generator class comes from the
    drafter's class hierarchy, not the wrapper's module (`torch._dynamo`, `peft`)."""
    from peft import LoraConfig, get_peft_model

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=BLOCK, mode="corrected")
    compiled = torch.compile(drafter, backend="eager")
    lora = get_peft_model(make_drafter(target, block_size=BLOCK, mode="corrected"),
                          LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    for wrapped in (compiled, lora):
        for i in range(3):
            prompt = random_prompt(4 + i, seed=i)
            expected = _greedy(target, prompt, max_new_tokens=12)
            assert _greedy(target, prompt, max_new_tokens=12, assistant_model=wrapped).tolist() == expected.tolist()

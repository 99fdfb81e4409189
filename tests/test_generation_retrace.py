"""The conditioning builder, draft parity with transformers' DFlash path, forward counts and the dispatch hook."""

import pytest
import torch
from transformers.generation import candidate_generator as cg
from transformers.generation.utils import GenerationMixin

from conftest import make_drafter, make_target, random_prompt, run_fresh_python
from hf_retrace import ReTraceCandidateGenerator, build_rejected_trajectory, install_generate_hook
from hf_retrace.models import generation_retrace, hook_retrace


B, H, F = 6, 3, 2  # block, hidden, feature width


def _block_tensors():
    # value = 10 * slot + channel, so every entry names where it came from
    hidden = (10 * torch.arange(B)[:, None] + torch.arange(H)[None]).float()[None]  # [1, B, H]
    feats = (100 + 10 * torch.arange(B)[:, None] + torch.arange(F)[None]).float()[None]  # [1, B, F]
    return hidden, feats


@pytest.mark.parametrize(
    "n, retained_slots, feature_positions",
    [
        (0, [2, 3, 4, 5], [1, 2, 3, 4]),  # first draft rejected: c at p+1, keep slots 2..5 (L = 4)
        (2, [4, 5], [3, 4]),  # middle: c at p+3, keep slots 4..5 (L = 2)
        (3, [5], [4]),  # L = 1
    ],
)
def test_builder_aligns_retained_suffix(n, retained_slots, feature_positions):
    hidden, feats = _block_tensors()
    cond = build_rejected_trajectory(hidden, feats, n)
    L = B - 2 - n
    assert len(retained_slots) == L
    expected_mask = [False] + [True] * L + [False] * (B - 1 - L)
    assert cond.slot_mask is None and cond.hidden_states.shape[1] == L  # inference layout: slots 1..L, sliced
    assert cond.dense_slot_mask(B)[0].tolist() == expected_mask  # anchor slot 0 never conditioned
    for next_slot, (j, pos) in enumerate(zip(retained_slots, feature_positions), start=1):
        # slot j of round r is absolute position p+j = p'+(j-(n+1)): next-round slot j-(n+1)
        assert next_slot == j - (n + 1)
        assert cond.hidden_states[0, next_slot - 1].tolist() == hidden[0, j].tolist()
        # features of verification position j-1: the target input d_{j-1} whose output scored d_j
        assert cond.target_features[0, next_slot - 1].tolist() == feats[0, pos].tolist()


@pytest.mark.parametrize("n", [B - 2, B - 1])
def test_builder_resets_without_suffix(n):
    hidden, feats = _block_tensors()
    assert build_rejected_trajectory(hidden, feats, n) is None  # rejection at the last slot / full acceptance


def _record_drafts(monkeypatch):
    """Records (drafted token ids, draft logits) of every round, for both the in-tree and the ReTrace generator."""
    rounds = []
    original = cg.DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, **kwargs):
        ids, logits = original(self, input_ids, **kwargs)
        if logits is not None:
            rounds.append((ids[0, input_ids.shape[1] :].tolist(), logits.clone()))
        return ids, logits

    monkeypatch.setattr(cg.DFlashTokenCandidateGenerator, "get_candidates", recording)
    return rounds


def _drafts(target, drafter, prompt, monkeypatch, **kwargs):
    rounds = _record_drafts(monkeypatch)
    target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=drafter, **kwargs)
    monkeypatch.undo()
    return rounds


def _assert_same_rounds(a, b):
    assert len(a) == len(b) > 3
    for (ids_a, logits_a), (ids_b, logits_b) in zip(a, b):
        assert ids_a == ids_b
        torch.testing.assert_close(logits_a, logits_b)


def test_zero_value_projection_gives_dflash_drafts(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target, mode="corrected")
    with torch.no_grad():
        drafter.retrace.value_proj.weight.zero_()  # W_v = 0, W_c and gate stay non-zero
    prompt = random_prompt(6, seed=2)
    corrected = _drafts(target, drafter, prompt, monkeypatch)
    assert drafter.last_generation_stats.num_conditioned_rounds > 0
    drafter.config.retrace_mode = "off"
    off = _drafts(target, drafter, prompt, monkeypatch)
    _assert_same_rounds(corrected, off)
    in_tree = _drafts(target, drafter, prompt, monkeypatch, speculation_type="dflash")
    _assert_same_rounds(off, in_tree)


def test_nonzero_conditioning_changes_drafts(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target, mode="corrected")
    prompt = random_prompt(6, seed=2)
    conditioned = _drafts(target, drafter, prompt, monkeypatch)
    drafter.config.retrace_mode = "off"
    plain = _drafts(target, drafter, prompt, monkeypatch)
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(conditioned, plain))


@pytest.mark.parametrize("probs, kept", [([0.9, 0.6, 0.2, 0.9], 2), ([0.4, 0.9, 0.9, 0.9], 0), ([0.55] * 4, 4)])
def test_confidence_stop_keeps_the_leading_confident_drafts(probs, kept):
    context = torch.tensor([[7, 8, 9]])
    drafts = torch.tensor([[1, 2, 3, 4]])
    # [1, k, V = 6]: slot j peaks at draft j with probability probs[j]; the other 5 tokens share the rest
    dist = torch.tensor(probs)[:, None].expand(4, 6)
    dist = torch.where(torch.arange(6) == drafts[0][:, None], dist, (1 - dist) / 5)
    logits = dist.log()[None]
    ids, kept_logits = generation_retrace.stop_at_low_confidence(3, torch.cat([context, drafts], 1), logits, 0.5)
    assert ids.tolist() == [[7, 8, 9] + [1, 2, 3, 4][:kept]]
    assert (kept_logits is None) if kept == 0 else torch.equal(kept_logits, logits[:, :kept])


@pytest.mark.parametrize("mode", ["off", "corrected"])
def test_one_target_and_one_drafter_forward_per_cycle(mode):
    target = make_target("llama")
    drafter = make_drafter(target, mode=mode)
    calls = {"target": [], "drafter": 0}
    h1 = target.register_forward_hook(lambda m, args, kw, out: calls["target"].append(kw["input_ids"].shape[1]),
                                      with_kwargs=True)  # fmt: skip
    h2 = drafter.register_forward_hook(lambda *_: calls.__setitem__("drafter", calls["drafter"] + 1))
    prompt = random_prompt(5, seed=1)
    target.generate(prompt, do_sample=False, max_new_tokens=29, assistant_model=drafter)
    h1.remove(), h2.remove()
    cycles = len(drafter.last_generation_stats.acceptance_lengths)
    assert calls["drafter"] == cycles
    verification = calls["target"][1:]  # after the prefill
    assert verification.count(drafter.config.block_size) == cycles  # each drafted block verified in one forward
    assert len(verification) - cycles in (0, 1)  # plus at most one final single-token step with no room to draft


def _load_module_copy(name: str):
    """A second copy of hook_retrace.py under another module name, as `trust_remote_code` loads it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, hook_retrace.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs install_generate_hook() on import
    return module


def test_hook_is_idempotent_and_falls_through():
    hooked = (GenerationMixin._get_candidate_generator, GenerationMixin._validate_generation_mode)
    assert all(method._retrace_hook for method in hooked)  # installed by `import hf_retrace`, not by a constructor
    assert install_generate_hook() is True
    install_generate_hook()
    _load_module_copy("remote_copy_hook_retrace")  # a remote-code copy installs nothing more
    assert (GenerationMixin._get_candidate_generator, GenerationMixin._validate_generation_mode) == hooked
    for method in hooked:  # each wrapper wraps transformers' own method directly: wrapped once
        assert not getattr(method.__wrapped__, "_retrace_hook", False)

    target = make_target("qwen3")
    assistant = make_target("qwen3", seed=5)  # an ordinary small LM as assistant: transformers' own generator
    seen = []
    original = cg.AssistedCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        seen.append(type(self))
        original(self, *args, **kwargs)

    cg.AssistedCandidateGenerator.__init__ = spy
    try:
        prompt = random_prompt(5, seed=0)
        out = target.generate(prompt, do_sample=False, max_new_tokens=10, assistant_model=assistant)
    finally:
        cg.AssistedCandidateGenerator.__init__ = original
    assert seen == [cg.AssistedCandidateGenerator]
    assert out.tolist() == target.generate(prompt, do_sample=False, max_new_tokens=10).tolist()


def test_each_wrapper_is_installed_once_even_alone(monkeypatch):
    """Only the validation wrapper present (the dispatch replaced by someone else): installing wraps the dispatch
    and leaves the validation wrapper as it is, rather than wrapping it a second time."""
    validation = GenerationMixin._validate_generation_mode
    plain_dispatch = GenerationMixin._get_candidate_generator.__wrapped__
    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", plain_dispatch)
    assert install_generate_hook() is True
    assert GenerationMixin._validate_generation_mode is validation
    assert GenerationMixin._get_candidate_generator._retrace_hook
    assert GenerationMixin._get_candidate_generator.__wrapped__ is plain_dispatch


UNSUPPORTED_TRANSFORMERS = r"""
import warnings
import transformers
from transformers.generation.utils import GenerationMixin

originals = (GenerationMixin._get_candidate_generator, GenerationMixin._validate_generation_mode)
transformers.__version__ = "6.1.0"  # what the hook's version check reads
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hf_retrace  # installs the hook on import: here it must warn and wrap nothing
assert any("supports transformers >=5.24,<6; found 6.1.0" in str(w.message) for w in caught), caught
assert (GenerationMixin._get_candidate_generator, GenerationMixin._validate_generation_mode) == originals
from conftest import make_drafter, make_target, random_prompt

target = make_target("qwen3")
drafter = make_drafter(target, mode="off")  # constructing a drafter does not raise
prompt = random_prompt(6, seed=2)
expected = target.generate(prompt, do_sample=False, max_new_tokens=20)
got = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter, speculation_type="dflash")
assert got.tolist() == expected.tolist()
print("OK")
"""


@pytest.mark.slow
def test_unsupported_transformers_warns_and_falls_back_to_dflash():
    """Fresh process: on an unsupported transformers version `import hf_retrace` warns instead of raising, patches
    nothing, and the drafter decodes losslessly through transformers' own `speculation_type="dflash"` path."""
    proc = run_fresh_python(UNSUPPORTED_TRANSFORMERS)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_hook_picks_retrace_generator(tiny_target, tiny_drafter):
    generator = GenerationMixin._get_candidate_generator(
        tiny_target, tiny_target.generation_config, random_prompt(4, 0), None, None, {}, assistant_model=tiny_drafter
    )
    assert isinstance(generator, ReTraceCandidateGenerator)

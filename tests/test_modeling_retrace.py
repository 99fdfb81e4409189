"""Config validation, the drafter forward, DFlash checkpoint conversion, save/load round trips and bad input."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_drafter, make_target, random_prompt
from hf_retrace import ReTraceConditioning, ReTraceDrafterConfig, ReTraceDrafterModel, default_target_layer_ids


def test_default_target_layer_ids_follow_the_dflash_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"retrace_mode": "sometimes"}, "retrace_mode"),
        ({"block_size": 1}, "block_size"),
        ({"mask_token_id": 10**7}, "mask_token_id"),
        ({"target_layer_ids": [1, 40], "num_target_layers": 36}, "target_layer_ids"),
        ({"retrace_gate_init": 0.0}, "retrace_gate_init"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types"),
        ({"num_hidden_layers": 1, "layer_types": ["sliding_attention"]}, "sliding_window"),
    ],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ReTraceDrafterConfig(**kwargs)


def test_from_target_sizes_the_drafter(tiny_target):
    drafter = ReTraceDrafterModel.from_target(tiny_target, num_hidden_layers=2, block_size=8)
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (32, 128, 4)
    # the DFlash rule on 4 layers spans layers 1..max(4-3, 1): both ids are layer 1
    assert cfg.target_layer_ids == [1, 1]
    assert cfg.mask_token_id == 127 and cfg.block_size == 8 and cfg.retrace_mode == "corrected"
    assert torch.count_nonzero(drafter.retrace.value_proj.weight) == 0  # W_v zero-initialised
    assert torch.count_nonzero(drafter.retrace.gate) == cfg.hidden_size  # gate non-zero


def test_from_target_sizes_the_drafter_for_a_deep_target():
    """A 36-layer target config (no weights needed): five ids by the DFlash rule, sizes and GQA heads copied."""
    import transformers

    target_config = transformers.Qwen3Config(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=36, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    drafter = ReTraceDrafterModel.from_target(target_config, num_hidden_layers=5)
    cfg = drafter.config
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.num_target_layers == 36
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.mask_token_id) == (48, 80, 300, 299)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 2, 16)
    assert drafter.fc.weight.shape == (48, 5 * 48) and len(drafter.layers) == 5


def _block_inputs(drafter, ctx_len=5, seed=0):
    torch.manual_seed(seed)
    cfg = drafter.config
    noise = torch.randn(1, cfg.block_size, cfg.hidden_size)
    context = torch.randn(1, ctx_len, len(cfg.target_layer_ids) * cfg.hidden_size)
    cond = ReTraceConditioning(
        hidden_states=torch.randn(1, cfg.block_size, cfg.hidden_size),
        target_features=torch.randn(1, cfg.block_size, context.shape[-1]),
        slot_mask=torch.tensor([[False, True, True, False]]),
    )
    return noise, context, cond


@pytest.mark.parametrize("mode", ["gated", "corrected"])
def test_zero_value_projection_reproduces_dflash_forward(tiny_target, mode):
    drafter = make_drafter(tiny_target, mode=mode)
    with torch.no_grad():
        drafter.retrace.value_proj.weight.zero_()
    noise, context, cond = _block_inputs(drafter)
    plain = drafter(noise, context).last_hidden_state
    conditioned = drafter(noise, context, rejected_trajectory=cond).last_hidden_state
    torch.testing.assert_close(conditioned, plain, rtol=0, atol=0)


def test_conditioning_touches_only_masked_slots(tiny_drafter):
    noise, _, cond = _block_inputs(tiny_drafter)
    out = tiny_drafter.apply_rejected_trajectory(noise, cond)
    changed = (out != noise).any(-1)[0].tolist()
    assert changed == cond.slot_mask[0].tolist()  # anchor slot 0 and unconditioned slots untouched


def test_overwrite_mode_replaces_inputs(tiny_target):
    drafter = make_drafter(tiny_target, mode="overwrite")
    noise, _, cond = _block_inputs(drafter)
    out = drafter.apply_rejected_trajectory(noise, cond)
    torch.testing.assert_close(out[0, 1:3], cond.hidden_states[0, 1:3])
    torch.testing.assert_close(out[0, [0, 3]], noise[0, [0, 3]])


@pytest.mark.parametrize("mode", ["gated", "corrected", "overwrite"])
def test_sliced_inference_layout_equals_masked_layout(tiny_target, mode):
    """Slots 1..L as slices (inference) give exactly what the boolean-mask layout (training) gives."""
    drafter = make_drafter(tiny_target, mode=mode)
    torch.nn.init.normal_(drafter.retrace.value_proj.weight)  # zero-initialised otherwise: nothing to compare
    noise, _, masked = _block_inputs(drafter)  # slots 1..2 conditioned
    sliced = ReTraceConditioning(masked.hidden_states[:, 1:3], masked.target_features[:, 1:3])
    assert sliced.dense_slot_mask(noise.shape[1]).tolist() == masked.slot_mask.tolist()
    with torch.no_grad():
        expected = drafter.apply_rejected_trajectory(noise, masked)
        torch.testing.assert_close(drafter.apply_rejected_trajectory(noise, sliced), expected, rtol=0, atol=0)
    assert (expected != noise).any(-1)[0].tolist() == masked.slot_mask[0].tolist()


def _write_zlab_folder(folder, drafter, drop=()):
    """A synthetic checkpoint in the public z-lab DFlash format (backbone keys only, `dflash_config`)."""
    cfg = drafter.config
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": 1000000.0, "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids},
    }  # fmt: skip
    for key in drop:
        raw.pop(key, None)
        raw["dflash_config"].pop(key, None)
    (folder / "config.json").write_text(json.dumps(raw))
    backbone = {k: v for k, v in drafter.state_dict().items() if not k.startswith("retrace.")}
    save_file(backbone, str(folder / "model.safetensors"))


def test_loads_zlab_dflash_checkpoint(tmp_path, tiny_target):
    source = make_drafter(tiny_target, mode="off", nonzero_retrace=False)
    _write_zlab_folder(tmp_path, source)
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path)
    assert loaded.config.retrace_mode == "corrected"
    for key, value in source.state_dict().items():
        if not key.startswith("retrace."):
            torch.testing.assert_close(loaded.state_dict()[key], value)
    assert torch.count_nonzero(loaded.retrace.value_proj.weight) == 0  # fresh ReTrace modules == DFlash drafter
    prompt = random_prompt(6, seed=3)
    tiny_target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=source)
    expected = source.last_generation_stats.acceptance_lengths
    tiny_target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=loaded.eval())
    assert loaded.last_generation_stats.acceptance_lengths == expected


@pytest.mark.parametrize("missing", ["hidden_size", "target_layer_ids", "mask_token_id"])
def test_zlab_config_missing_fields_is_a_clear_error(tmp_path, tiny_target, missing):
    _write_zlab_folder(tmp_path, make_drafter(tiny_target), drop=(missing,))
    with pytest.raises(ValueError, match=f"missing required fields.*{missing}"):
        ReTraceDrafterModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weights_file_is_a_clear_error(tmp_path, tiny_drafter, damage):
    tiny_drafter.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00" * 64)
    with pytest.raises(OSError, match="corrupt or truncated"):
        ReTraceDrafterModel.from_pretrained(tmp_path)


def test_mismatched_drafter_is_a_clear_error(tiny_target):
    other = make_target("qwen3", vocab_size=96)
    drafter = make_drafter(other)
    with pytest.raises(ValueError, match="does not match the target"):
        tiny_target.generate(random_prompt(4, 0), max_new_tokens=5, assistant_model=drafter)


def test_target_layer_ids_beyond_target_depth_is_a_clear_error(tiny_target):
    deep = make_target("qwen3", num_hidden_layers=8)
    drafter = ReTraceDrafterModel.from_target(deep, num_hidden_layers=1, block_size=4, target_layer_ids=[6])
    with pytest.raises(ValueError, match="target_layer_ids"):
        tiny_target.generate(random_prompt(4, 0), max_new_tokens=5, assistant_model=drafter)


def test_batch_size_above_one_is_a_clear_error(tiny_target, tiny_drafter):
    prompts = torch.cat([random_prompt(4, 0), random_prompt(4, 1)])
    with pytest.raises(ValueError, match="batch size 1 only"):
        tiny_target.generate(prompts, max_new_tokens=5, assistant_model=tiny_drafter)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_assistant_tokens", "block_size", r"num_assistant_tokens must be in \[1, block_size - 1 = "),
        ("assistant_confidence_threshold", 1.5, r"assistant_confidence_threshold must be in \(0, 1\]"),
    ],
)
def test_verification_limits_set_after_loading_are_checked_at_generate(
    tiny_target, tiny_drafter, field, value, message
):
    # one more draft than a block has; a probability above 1
    setattr(tiny_drafter.generation_config, field, tiny_drafter.config.block_size if value == "block_size" else value)
    with pytest.raises(ValueError, match=message):
        tiny_target.generate(random_prompt(4, 0), max_new_tokens=5, assistant_model=tiny_drafter)


_FRESH_PROCESS = textwrap.dedent(
    """
    import sys, json, torch
    sys.modules["hf_retrace"] = None  # make `import hf_retrace` fail: only the saved code files may be used
    try:
        import hf_retrace
        raise SystemExit("hf_retrace is importable")
    except ImportError:
        pass
    from transformers import AutoModel, AutoModelForCausalLM
    folder, target_folder, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    drafter = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_folder).eval()
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=25, assistant_model=drafter)
    print(json.dumps({"tokens": out[0].tolist(), "cycles": len(drafter.last_generation_stats.acceptance_lengths),
                      "class": type(drafter).__module__}))
    """
)


@pytest.mark.slow
def test_round_trip_with_remote_code_in_a_fresh_process(tmp_path, tiny_target, tiny_drafter):
    drafter_dir, target_dir = tmp_path / "drafter", tmp_path / "target"
    tiny_drafter.save_pretrained(drafter_dir)
    tiny_target.save_pretrained(target_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_retrace.ReTraceDrafterModel"
    prompt = random_prompt(6, seed=8)[0].tolist()
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, str(drafter_dir), str(target_dir), json.dumps(prompt)],
        capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    assert remote["class"].startswith("transformers_modules")
    greedy = dict(do_sample=False, max_new_tokens=25)
    local = tiny_target.generate(torch.tensor([prompt]), **greedy, assistant_model=tiny_drafter)
    assert remote["tokens"] == local[0].tolist()
    assert remote["tokens"] == tiny_target.generate(torch.tensor([prompt]), **greedy)[0].tolist()
    assert remote["cycles"] == len(tiny_drafter.last_generation_stats.acceptance_lengths)


def test_save_and_from_pretrained_round_trip(tmp_path, tiny_drafter):
    tiny_drafter.save_pretrained(tmp_path)
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path).eval()
    for key, value in tiny_drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    noise, context, cond = _block_inputs(tiny_drafter)
    torch.testing.assert_close(
        loaded(noise, context, rejected_trajectory=cond).last_hidden_state,
        tiny_drafter(noise, context, rejected_trajectory=cond).last_hidden_state,
    )


def test_anchor_broadcast_starts_at_zero_and_adds_the_anchor_to_mask_slots_per_block(tiny_target, tmp_path):
    drafter = make_drafter(tiny_target, mode="off", anchor_broadcast=True, nonzero_retrace=False)
    plain = make_drafter(tiny_target, mode="off", nonzero_retrace=False)  # same seed: same backbone weights
    assert not drafter.anchor_broadcast.weight.any()  # W_a = 0 at init: the DFlash backbone exactly
    noise, context, _ = _block_inputs(drafter)
    torch.testing.assert_close(drafter(noise, context).last_hidden_state, plain(noise, context).last_hidden_state)
    assert "anchor_broadcast.weight" not in plain.state_dict()  # DFlash keys untouched when disabled
    with torch.no_grad():
        drafter.anchor_broadcast.weight.normal_()
    B = drafter.config.block_size
    two_blocks = torch.randn(1, 2 * B, noise.shape[-1])  # training passes N blocks at once
    out = drafter.anchor_broadcast(two_blocks)
    for block in range(2):
        rows = slice(block * B, (block + 1) * B)
        expected = two_blocks[0, rows].clone()
        expected[1:] += two_blocks[0, block * B] @ drafter.anchor_broadcast.weight.T  # W_a e_0 on slots 1..B-1
        torch.testing.assert_close(out[0, rows], expected)
    with pytest.raises(ValueError, match="not a multiple of B"):
        drafter.anchor_broadcast(two_blocks[:, :-1])
    drafter.save_pretrained(tmp_path)
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.anchor_broadcast.weight, drafter.anchor_broadcast.weight, rtol=0, atol=0)


# The backbone is transformers' in-tree DFlash drafter (muse_glimmer_assistant): what that brings, tested.


def _same_drafter(target, attn_implementation, **config):
    """`make_drafter(target, seed=3)`'s weights (the same for every call) under another attention setup."""
    drafter = make_drafter(target, seed=3)
    if config:
        weights = drafter.state_dict()
        drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=4, **config)
        drafter.load_state_dict(weights)
    drafter.set_attn_implementation(attn_implementation)
    return drafter.eval()


def _training_mask(drafter, ctx_len=5):
    from hf_retrace.trainer.masks import build_block_mask

    return build_block_mask(torch.tensor([[3]]), torch.tensor([[True]]), ctx_len, drafter.config.block_size)


def test_backbone_is_the_in_tree_dflash_drafter(tiny_drafter):
    from transformers.models.muse_glimmer_assistant import modeling_muse_glimmer_assistant as in_tree

    assert isinstance(tiny_drafter, in_tree.MuseGlimmerAssistantPreTrainedModel)
    assert isinstance(tiny_drafter.layers[0], in_tree.MuseGlimmerAssistantDecoderLayer)
    assert isinstance(tiny_drafter.layers[0].self_attn, in_tree.MuseGlimmerAssistantAttention)
    assert tiny_drafter._supports_sdpa and tiny_drafter._supports_flex_attn and tiny_drafter._supports_flash_attn


def test_sdpa_gives_the_same_drafts_as_eager(tiny_target):
    """eager == sdpa on the inference block (no mask), the training block mask, and in generation."""
    eager, sdpa = _same_drafter(tiny_target, "eager"), _same_drafter(tiny_target, "sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    noise, context, cond = _block_inputs(eager)
    with torch.no_grad():
        for kwargs in ({}, {"rejected_trajectory": cond}, {"attention_mask": _training_mask(eager)}):
            torch.testing.assert_close(
                sdpa(noise, context, **kwargs).last_hidden_state, eager(noise, context, **kwargs).last_hidden_state
            )
    prompt = random_prompt(6, seed=4)
    plain = tiny_target.generate(prompt, do_sample=False, max_new_tokens=20)
    for drafter in (eager, sdpa):
        out = tiny_target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter)
        assert out.tolist() == plain.tolist()  # lossless with either implementation
    assert sdpa.last_generation_stats.acceptance_lengths == eager.last_generation_stats.acceptance_lengths


@pytest.mark.slow
def test_flex_attention_gives_the_same_drafts_as_eager(tiny_target):
    """flex == eager on the inference block (the BlockMask spans `[context ; block]`) and the training block mask.
    Run under `torch.compile(backend="eager")`, which executes flex's reference implementation: outside a compiled
    region transformers calls the inductor-compiled flex kernel, which aborts the process on this CPU build (torch
    2.13, head_dim 8); flex is a GPU feature."""
    eager, flex = _same_drafter(tiny_target, "eager"), _same_drafter(tiny_target, "flex_attention")
    noise, context, cond = _block_inputs(eager)
    torch._dynamo.reset()
    compiled = torch.compile(flex, backend="eager")
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": _training_mask(eager)}):
            torch.testing.assert_close(
                compiled(noise, context, **kwargs).last_hidden_state, eager(noise, context, **kwargs).last_hidden_state
            )


def test_sliding_window_layers(tiny_target):
    """`layer_types` sliding_attention: a window wider than the sequence equals full attention, a narrow window
    changes the drafts, and greedy generation with it stays lossless."""
    full = _same_drafter(tiny_target, "sdpa")
    wide = _same_drafter(tiny_target, "sdpa", layer_types=["sliding_attention"], sliding_window=512)
    narrow = _same_drafter(tiny_target, "sdpa", layer_types=["sliding_attention"], sliding_window=3)
    noise, context, _ = _block_inputs(full)
    with torch.no_grad():
        expected = full(noise, context).last_hidden_state
        torch.testing.assert_close(wide(noise, context).last_hidden_state, expected)
        assert not torch.allclose(narrow(noise, context).last_hidden_state, expected)
    prompt = random_prompt(6, seed=5)
    plain = tiny_target.generate(prompt, do_sample=False, max_new_tokens=20)
    out = tiny_target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=narrow)
    assert out.tolist() == plain.tolist()
    with pytest.raises(ValueError, match="sliding_attention"):
        narrow(noise, context, attention_mask=_training_mask(narrow))  # the training block mask has no window


def test_forward_compiles_as_one_graph(tiny_drafter):
    """`_can_compile_fullgraph`, inherited from the in-tree drafter: the whole forward traces without graph breaks
    (the `eager` backend checks the trace without spending minutes on CPU code generation)."""
    noise, context, masked = _block_inputs(tiny_drafter)
    cond = ReTraceConditioning(masked.hidden_states[:, 1:3], masked.target_features[:, 1:3])  # inference layout
    torch._dynamo.reset()
    compiled = torch.compile(tiny_drafter, backend="eager", fullgraph=True)
    with torch.no_grad():
        for kwargs in ({}, {"rejected_trajectory": cond}):
            torch.testing.assert_close(
                compiled(noise, context, **kwargs).last_hidden_state,
                tiny_drafter(noise, context, **kwargs).last_hidden_state,
            )

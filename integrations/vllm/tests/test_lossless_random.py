"""A tiny random drafter (anchor term, reduced vocabulary, ReTrace `corrected` on, random weights): its drafts are
mostly rejected, so ReTrace conditions most blocks, and greedy output must still equal plain greedy. The same
backbone as a plain z-lab-style folder (`DFlashDraftModel`, no `hf_retrace` block) runs vLLM's own DFlash path
with the plugin installed: same output, and the plugin's proposer does not run."""

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import PROMPTS, run_speculative


HIDDEN, VOCAB, HEADS, KV_HEADS, HEAD_DIM, FFN = 576, 49152, 9, 3, 64, 256  # SmolLM2-135M's sizes, a small MLP
BLOCK, DRAFT_VOCAB, LAYER_IDS, MASK_ID = 16, 512, [1, 27], 49151


def write_drafter(folder, *, plain: bool, seed: int = 0) -> None:
    """A 1-layer drafter folder in the export format (`docs/formats.md`) with random weights."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    tensors = {
        "fc.weight": rand(HIDDEN, len(LAYER_IDS) * HIDDEN),
        "hidden_norm.weight": torch.ones(HIDDEN),
        "norm.weight": torch.ones(HIDDEN),
        "layers.0.input_layernorm.weight": torch.ones(HIDDEN),
        "layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN),
        "layers.0.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
        "layers.0.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "layers.0.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "layers.0.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "layers.0.self_attn.q_norm.weight": torch.ones(HEAD_DIM),
        "layers.0.self_attn.k_norm.weight": torch.ones(HEAD_DIM),
        "layers.0.mlp.gate_proj.weight": rand(FFN, HIDDEN),
        "layers.0.mlp.up_proj.weight": rand(FFN, HIDDEN),
        "layers.0.mlp.down_proj.weight": rand(HIDDEN, FFN),
    }
    config = {
        "architectures": ["DFlashDraftModel" if plain else "DFlashReTraceDraftModel"],
        "model_type": "qwen3", "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 8192, "vocab_size": VOCAB, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32", "block_size": BLOCK, "num_target_layers": 30,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS},
    }  # fmt: skip
    if not plain:
        ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
        tensors.update({
            "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, std=1.0),
            "d2t": ids - torch.arange(DRAFT_VOCAB),
            "anchor_broadcast.weight": rand(HIDDEN, HIDDEN),
            "retrace.correction.weight": rand(HIDDEN, 2 * HIDDEN),
            "retrace.gate": torch.ones(HIDDEN) + rand(HIDDEN, std=0.1),
            "retrace.value_proj.weight": rand(HIDDEN, HIDDEN, std=0.05),
        })  # fmt: skip
        config["draft_vocab_size"] = DRAFT_VOCAB
        config["hf_retrace"] = {
            "anchor_broadcast": True, "retrace_mode": "corrected", "num_assistant_tokens": 3,
            "assistant_confidence_threshold": None, "prompt_lookup_num_tokens": 3,
            "prompt_lookup_max_ngram_size": 3, "prompt_lookup_min_ngram_size": 2, "datastore_num_tokens": None,
            "datastore_max_ngram_size": 6, "datastore_min_ngram_size": 3, "datastore_file": None,
            "speculation_policy": "fixed", "online_datastore_num_tokens": None,
            "online_datastore_max_bytes": 33554432, "source_commit": None,
        }  # fmt: skip
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def random_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("random-drafters")
    write_drafter(root / "retrace", plain=False)
    write_drafter(root / "plain", plain=True)
    return root


def test_random_retrace_drafter_is_lossless_and_conditions(target, random_folders, plain_greedy, tmp_path):
    outputs, stats = run_speculative(target, random_folders / "retrace", tmp_path / "stats.json")
    for prompt, got, want in zip(PROMPTS, outputs, plain_greedy):
        assert got == want, f"speculative output differs from plain greedy on {prompt!r}"
    assert stats is not None, "the hf-retrace proposer did not run (no counters written)"
    drafted, committed = stats["cycles"]["draft"], stats["committed"]["draft"]
    assert drafted > 20 and committed < 1.5 * drafted, stats  # random drafts: mostly rejected
    # with k = 3 verified, a block with n <= 1 accepted retains L = 2 - n >= 1 slot for the next block
    assert stats["conditioned_blocks"] > drafted // 2, stats
    assert stats["retained_slots"] > stats["conditioned_blocks"], stats  # some blocks got L = 2
    assert stats["cycles"]["datastore"] == 0, stats  # no datastore in this folder


def test_plain_dflash_folder_runs_vllm_own_path(target, random_folders, plain_greedy, tmp_path):
    outputs, stats = run_speculative(target, random_folders / "plain", tmp_path / "stats.json")
    assert outputs == plain_greedy
    assert stats is None, "the hf-retrace proposer ran for a folder without an hf_retrace block"

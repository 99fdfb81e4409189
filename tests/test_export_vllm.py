"""`hf-retrace export --format vllm`: the tensor mapping, the config, the datastore copy and every refusal, on tiny
random drafters (the folder format is docs/formats.md)."""

import json

import pytest
import torch
from conftest import make_drafter, make_target, random_prompt
from safetensors import safe_open
from safetensors.torch import load_file

import hf_retrace.cli as cli
from hf_retrace import ReTraceDrafterModel
from hf_retrace.export.vllm import (
    DATASTORE_FILE,
    PLAIN_ARCHITECTURE,
    RETRACE_ARCHITECTURE,
    ExportError,
    check_exportable,
    export_for_vllm,
    vllm_state_dict,
)


DRAFT_IDS = [0, 3, 5, 6, 7, 40, 127]  # a reduced vocabulary of K = 7 of the 128 tokens
BACKBONE = ("fc.", "hidden_norm.", "layers.", "norm.")


@pytest.fixture
def target():
    return make_target("qwen3")


def _export(tmp_path, drafter, target=None, name="out", **kwargs):
    """Saves `drafter`, exports it; returns `(output folder, config dict, tensors)`."""
    drafter.save_pretrained(tmp_path / "drafter")
    out = export_for_vllm(tmp_path / "drafter", tmp_path / name, target, **kwargs)
    return out, json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


@pytest.fixture
def no_default_target(monkeypatch):
    """Fails the test if the export loads the project's default target."""

    def refuse(*args, **kwargs):
        raise AssertionError("the export loaded the default target")

    monkeypatch.setattr("hf_retrace.data.assets.load_default_target", refuse)


def test_plain_drafter_exports_as_vllm_dflash_without_a_target(tmp_path, target, no_default_target):
    drafter = make_drafter(target, mode="off")
    out, config, tensors = _export(tmp_path, drafter)
    assert config["architectures"] == [PLAIN_ARCHITECTURE] and config["model_type"] == "qwen3"
    source = {k: v for k, v in drafter.state_dict().items() if k.startswith(BACKBONE)}
    assert set(tensors) == set(source)  # vLLM's DFlash loader gets exactly fc, hidden_norm, layers.*, norm
    for key, value in source.items():
        torch.testing.assert_close(tensors[key], value, rtol=0, atol=0)
    assert "draft_vocab_size" not in config and not (out / DATASTORE_FILE).exists()
    assert config["hf_retrace"]["datastore_file"] is None and config["hf_retrace"]["retrace_mode"] == "off"


def test_config_fields(tmp_path, target):
    drafter = make_drafter(target, block_size=4, anchor_broadcast=True)
    _, config, _ = _export(tmp_path, drafter, target)
    dc = drafter.config
    expected = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "block_size": 4, "num_target_layers": 4, "rms_norm_eps": dc.rms_norm_eps,
        "max_position_embeddings": dc.max_position_embeddings, "rope_theta": dc.rope_parameters["rope_theta"],
        "rope_parameters": dict(dc.rope_parameters), "dtype": "float32", "torch_dtype": "float32",
        "dflash_config": {"mask_token_id": 127, "target_layer_ids": [2]},
    }  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    assert config["architectures"] == [RETRACE_ARCHITECTURE]


def test_reduced_vocabulary_is_the_target_head_rows_and_d2t(tmp_path, target):
    drafter = make_drafter(target, mode="off")
    drafter.set_draft_vocab(DRAFT_IDS)
    target.save_pretrained(tmp_path / "target")
    _, config, tensors = _export(tmp_path, drafter, str(tmp_path / "target"))
    ids = torch.tensor(DRAFT_IDS)
    torch.testing.assert_close(tensors["lm_head.weight"], target.lm_head.weight[ids], rtol=0, atol=0)
    assert tensors["d2t"].dtype == torch.int64
    assert tensors["d2t"].tolist() == [0, 2, 3, 3, 3, 35, 121]
    assert (torch.arange(len(ids)) + tensors["d2t"]).tolist() == DRAFT_IDS  # vLLM's draft id -> target id
    assert config["draft_vocab_size"] == 7 and config["architectures"] == [RETRACE_ARCHITECTURE]
    assert "draft_vocab_ids" not in tensors


def test_reduced_vocabulary_defaults_to_the_project_target(tmp_path, target, monkeypatch):
    drafter = make_drafter(target, mode="off")
    drafter.set_draft_vocab(DRAFT_IDS)
    monkeypatch.setattr("hf_retrace.data.assets.load_default_target", lambda dtype: (target, None))
    _, _, tensors = _export(tmp_path, drafter)
    torch.testing.assert_close(tensors["lm_head.weight"], target.lm_head.weight[DRAFT_IDS], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["off", "overwrite", "gated", "corrected"])
def test_anchor_term_and_retrace_modules(tmp_path, target, mode):
    drafter = make_drafter(target, mode=mode, anchor_broadcast=True)
    _, config, tensors = _export(tmp_path, drafter)
    state = drafter.state_dict()
    torch.testing.assert_close(tensors["anchor_broadcast.weight"], state["anchor_broadcast.weight"], rtol=0, atol=0)
    retrace = {key for key in tensors if key.startswith("retrace.")}
    if mode == "off":
        assert not retrace
    else:
        assert retrace == {"retrace.correction.weight", "retrace.gate", "retrace.value_proj.weight"}
        for key in retrace:
            torch.testing.assert_close(tensors[key], state[key], rtol=0, atol=0)
    assert config["hf_retrace"]["anchor_broadcast"] is True and config["hf_retrace"]["retrace_mode"] == mode
    assert config["architectures"] == [RETRACE_ARCHITECTURE]


def test_retrace_mode_with_zero_value_projection_exports_plain(tmp_path, target):
    """W_v = 0 makes modes gated and corrected add nothing (a fresh drafter; a z-lab checkpoint loads so)."""
    drafter = make_drafter(target, mode="corrected", nonzero_retrace=False)
    _, config, tensors = _export(tmp_path, drafter)
    assert config["architectures"] == [PLAIN_ARCHITECTURE] and config["hf_retrace"]["retrace_mode"] == "off"
    assert not any(key.startswith("retrace.") for key in tensors)


def test_plain_export_reloads_as_the_same_drafter(tmp_path, target):
    """The plain export is a z-lab DFlash folder: the drafter loads it back (`dflash_config` path) and computes the
    same hidden states, so the config fields (sizes, eps, RoPE, mask token, target layers) and key names map right."""
    drafter = make_drafter(target, mode="off")
    out, _, _ = _export(tmp_path, drafter)
    reloaded = ReTraceDrafterModel.from_pretrained(out).eval()
    assert reloaded.config.mask_token_id == 127 and reloaded.config.target_layer_ids == [2]
    noise = target.get_input_embeddings()(random_prompt(4, seed=3))  # [1, B, H]
    context = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = drafter(noise, context).last_hidden_state
        actual = reloaded(noise, context).last_hidden_state
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    again = export_for_vllm(out, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["architectures"] == [PLAIN_ARCHITECTURE]


def test_dtype(tmp_path, target):
    drafter = make_drafter(target, anchor_broadcast=True)
    drafter.set_draft_vocab(DRAFT_IDS)
    _, config, tensors = _export(tmp_path, drafter, target, dtype=torch.bfloat16)
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert {key for key, value in tensors.items() if value.dtype != torch.bfloat16} == {"d2t"}
    torch.testing.assert_close(tensors["lm_head.weight"], target.lm_head.weight[DRAFT_IDS].bfloat16(), rtol=0, atol=0)


def test_decoding_policy_block(tmp_path, target):
    drafter = make_drafter(target, block_size=4)
    settings = drafter.generation_config
    settings.num_assistant_tokens, settings.assistant_confidence_threshold = 2, 0.5
    settings.prompt_lookup_num_tokens, settings.max_matching_ngram_size = 3, 4
    _, config, _ = _export(tmp_path, drafter)
    assert config["hf_retrace"] == {
        "anchor_broadcast": False, "retrace_mode": "corrected", "num_assistant_tokens": 2,
        "assistant_confidence_threshold": 0.5, "prompt_lookup_num_tokens": 3, "prompt_lookup_max_ngram_size": 4,
        "prompt_lookup_min_ngram_size": 2, "datastore_num_tokens": None, "datastore_max_ngram_size": 6,
        "datastore_min_ngram_size": 3, "datastore_file": None, "speculation_policy": "fixed",
        "online_datastore_num_tokens": None, "online_datastore_max_bytes": 33554432,
        "source_commit": config["hf_retrace"]["source_commit"],
    }  # fmt: skip
    commit = config["hf_retrace"]["source_commit"]
    assert commit is None or len(commit) == 40


def test_decoding_policy_unset_verifies_every_draft(tmp_path, target):
    _, config, _ = _export(tmp_path, make_drafter(target, block_size=4))
    assert config["hf_retrace"]["num_assistant_tokens"] == 3  # block_size - 1
    assert config["hf_retrace"]["prompt_lookup_num_tokens"] is None


def test_datastore_is_copied_byte_for_byte(tmp_path, target):
    drafter = make_drafter(target)
    drafter.set_datastore([[5, 6, 7, 8], [9, 10]])
    drafter.generation_config.datastore_num_tokens = 2
    out, config, _ = _export(tmp_path, drafter)
    assert (out / DATASTORE_FILE).read_bytes() == (tmp_path / "drafter" / DATASTORE_FILE).read_bytes()
    assert config["hf_retrace"]["datastore_file"] == DATASTORE_FILE
    assert config["hf_retrace"]["datastore_num_tokens"] == 2
    # vLLM loads weights only from the files the index names, never from the datastore file
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {"model.safetensors"}
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert sorted(weight_map) == sorted(weights.keys())

    drafter.set_datastore(None)  # a re-export without one into the same folder leaves no stale file behind
    drafter.save_pretrained(tmp_path / "drafter")
    export_for_vllm(tmp_path / "drafter", out, overwrite=True)
    assert not (out / DATASTORE_FILE).exists()
    assert json.loads((out / "config.json").read_text())["hf_retrace"]["datastore_file"] is None


# --- refusals -------------------------------------------------------------------------------------------------


def test_unknown_retrace_mode_is_refused(target):
    drafter = make_drafter(target)
    drafter.config.retrace_mode = "trajectory-v2"  # a mode a newer drafter might have; the plugin cannot run it
    with pytest.raises(ExportError, match="retrace_mode 'trajectory-v2' has no vLLM implementation"):
        check_exportable(drafter.config)


def test_sliding_window_layers_are_refused(target):
    drafter = ReTraceDrafterModel.from_target(
        target, num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"], sliding_window=8
    )
    with pytest.raises(ExportError, match=r"layers \[1\] are 'sliding_attention'.*runs sliding layers causally"):
        check_exportable(drafter.config)


def test_non_silu_activation_is_refused(target):
    drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(ExportError, match="hidden_act 'gelu' is not supported"):
        check_exportable(drafter.config)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"hidden_size": 48}, r"hidden_size 48 \(the drafter's: 32\)"),
        ({"vocab_size": 256}, r"vocab_size 256 \(the drafter's: 128\)"),
        ({"num_hidden_layers": 2}, r"2 layers, but the drafter reads layer 2 \(target_layer_ids \[2\]\)"),
    ],
)
def test_a_target_that_does_not_match_is_refused(tmp_path, target, overrides, expected):
    other = make_target("qwen3", restricted=False, **overrides)
    with pytest.raises(ExportError, match=rf"the target does not match the drafter: it has {expected}.*--target"):
        _export(tmp_path, make_drafter(target), other)


def test_reduced_vocabulary_without_a_head_is_refused(target):
    drafter = make_drafter(target)
    drafter.set_draft_vocab(DRAFT_IDS)
    with pytest.raises(ExportError, match=r"reduced vocabulary \(7 of 128 tokens\).*--target DIR"):
        vllm_state_dict(drafter, None)


def test_a_target_folder_without_its_lm_head_is_refused(tmp_path, target):
    drafter = make_drafter(target)
    drafter.set_draft_vocab(DRAFT_IDS)
    target.model.save_pretrained(tmp_path / "base")  # the base model: loads as a causal LM with a random head
    with pytest.raises(ExportError, match="lacks weights.*lm_head.*causal-LM folder"):
        _export(tmp_path, drafter, str(tmp_path / "base"))


def test_output_folder_in_use_is_refused(tmp_path, target):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="exists and is not empty: pass a new folder, or --overwrite"):
        _export(tmp_path, make_drafter(target))
    _export(tmp_path, make_drafter(target), overwrite=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "keep me"  # overwrite writes files, deletes nothing else
    with pytest.raises(ExportError, match="is the drafter folder itself"):
        export_for_vllm(tmp_path / "drafter", tmp_path / "drafter", overwrite=True)


def test_missing_folders_are_refused(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="not a drafter folder"):
        export_for_vllm(tmp_path / "nowhere", tmp_path / "out")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    with pytest.raises(FileNotFoundError, match="--target .*not a model folder"):
        export_for_vllm(tmp_path / "drafter", tmp_path / "out", str(tmp_path))


def test_cli(tmp_path, target, capsys):
    make_drafter(target, mode="off").save_pretrained(tmp_path / "drafter")
    argv = ["export", "--format", "vllm", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [PLAIN_ARCHITECTURE]
    capsys.readouterr()
    assert cli.main(argv) == 2  # the output is not empty now: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("hf-retrace export: error: --output") and err.count("\n") == 1 and "--overwrite" in err
    assert cli.main([*argv, "--overwrite", "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", "--format", "onnx", "--drafter", "d", "--output", "o"])
    assert exit_info.value.code == 2

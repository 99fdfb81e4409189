"""`hf_retrace.hub.model_card`: the card states the drafter's real mode (a DFlash drafter never claims to condition
on rejected drafts)."""

import pytest

from conftest import make_drafter, make_target
from hf_retrace.hub.model_card import render_model_card


CONDITIONS = "conditions each block on the previous round's rejected draft suffix"


def _card(mode: str) -> str:
    drafter = make_drafter(make_target("qwen3"), block_size=4, mode=mode)
    return str(render_model_card(drafter.config, repo_id="owner/tiny-drafter", base_model="Qwen/Qwen3-8B"))


def test_an_off_drafter_is_described_as_dflash():
    text = _card("off")
    intro = text.split("## Usage")[0]
    assert "A [DFlash](https://arxiv.org/abs/2602.06036) speculative-decoding drafter for [`Qwen/Qwen3-8B`]" in intro
    assert "`retrace_mode: off`" in intro and "does not\ncondition on the previous round's rejected drafts" in intro
    assert CONDITIONS not in text and "corrected with target features" not in text
    assert "drafts\n3 tokens per round" in intro and "greedy decoding stays lossless" in intro
    assert "| ReTrace mode | `off` |" in text


@pytest.mark.parametrize(
    "mode, wording",
    [
        ("corrected", "corrected with target features that the verification pass already\ncomputed."),
        ("gated", "gated residual"),
        ("overwrite", "replacing the mask-slot input"),
    ],
)
def test_a_retrace_drafter_names_its_conditioning(mode, wording):
    intro = _card(mode).split("## Usage")[0]
    assert intro.count("A [ReTrace](https://arxiv.org/abs/2608.29748) speculative-decoding drafter for") == 1
    assert f"`retrace_mode: {mode}`" in intro and CONDITIONS in " ".join(intro.split("\n"))
    assert wording in intro and "greedy decoding stays lossless" in intro
    others = {"corrected": "corrected with target features", "gated": "gated residual", "overwrite": "mask-slot input"}
    assert not any(text in intro for m, text in others.items() if m != mode)

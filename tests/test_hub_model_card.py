"""`hf_retrace.hub.model_card`: the card states the drafter's real mode (a DFlash drafter never claims to condition
on rejected drafts) and its real decoding settings (its `generation_config`, not config.json's defaults)."""

import pytest

from conftest import make_drafter, make_target
from hf_retrace.hub.model_card import render_model_card


CONDITIONS = "conditions each block on the previous round's rejected draft suffix"


def _render(drafter) -> str:
    return str(render_model_card(drafter.config, drafter.decoding_settings(), repo_id="owner/tiny-drafter",
                                 datastore_size=drafter.datastore_size, base_model="Qwen/Qwen3-8B"))  # fmt: skip


def _card(mode: str) -> str:
    return _render(make_drafter(make_target("qwen3"), block_size=4, mode=mode))


def _row(text: str, name: str) -> str:
    """The value cell of the Drafter table row whose first cell starts with `name`."""
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {name}")]
    return row.rsplit(" | ", 1)[1].rstrip(" |")


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


def test_the_card_states_the_drafters_decoding_settings():
    """Settings live in generation_config.json, not config.json: a card rendered straight from a drafter (as the
    trainer does on save) shows its values, not the defaults."""
    drafter = make_drafter(make_target("qwen3"), block_size=4, mode="off")
    defaults = _render(drafter)
    assert _row(defaults, "drafts verified per cycle") == "all 3" and _row(defaults, "confidence stop") == "none"
    assert _row(defaults, "prompt lookup") == "off" and _row(defaults, "datastore lookup") == "off"
    assert "n-gram of 2-3 tokens" in defaults and "(this drafter has none)" in defaults
    drafter.set_datastore([[5, 6, 7, 8], [9, 10]])
    drafter.generation_config.update(
        num_assistant_tokens=2, assistant_confidence_threshold=0.7, prompt_lookup_num_tokens=5,
        max_matching_ngram_size=4, prompt_lookup_min_ngram_size=1, datastore_num_tokens=2,
        datastore_max_ngram_size=5, datastore_min_ngram_size=2, draft_logits_dtype="float32",
    )  # fmt: skip
    text = _render(drafter)
    assert _row(text, "drafts verified per cycle") == "2" and _row(text, "confidence stop") == "0.7"
    assert _row(text, "prompt lookup") == "5" and "n-gram of 1-4 tokens" in text
    assert _row(text, "datastore lookup") == "2" and "of 2-5 tokens in 8 tokens of the target's own responses" in text
    assert "kept in `datastore.safetensors` beside the weights" in text and "stored with the weights" not in text
    assert _row(text, "draft lm-head dtype") == "float32"


def test_the_card_needs_the_decoding_settings():
    drafter = make_drafter(make_target("qwen3"), block_size=4, mode="off")
    with pytest.raises(TypeError, match=r"drafter\.decoding_settings\(\)"):
        render_model_card(drafter.config, drafter.generation_config, repo_id="owner/tiny-drafter")

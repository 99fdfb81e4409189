"""Greedy output with the hf-retrace proposer equals vLLM's plain greedy, token for token, for the shipped cards; and
the proposer's counters say the policy ran (lookups proposed some cycles, the drafter the others, tau > 1)."""

import pytest

from conftest import PROMPTS, run_speculative


@pytest.mark.parametrize("card", ["smollm2-135m-dflash", "smollm2-135m-retrace"])
def test_card_greedy_equals_plain_greedy(card, target, exports, plain_greedy, tmp_path):
    folder = exports(card)
    outputs, stats = run_speculative(target, folder, tmp_path / "stats.json")
    for prompt, got, want in zip(PROMPTS, outputs, plain_greedy):
        assert got == want, f"speculative output differs from plain greedy on {prompt!r}"
    assert stats is not None, "the hf-retrace proposer did not run (no counters written)"
    cycles, committed = stats["cycles"], stats["committed"]
    assert cycles["draft"] > 0, stats
    assert cycles["lookup"] + cycles["datastore"] > 0, stats
    assert stats["drafter_forwards"] <= cycles["draft"], stats  # lookup cycles skip the drafter
    for source in cycles:  # a cycle commits 1 (all rejected) to K+1 tokens
        assert cycles[source] <= committed[source] <= 4 * cycles[source], stats
    assert stats["tau"] > 1.2, stats
    if card.endswith("retrace"):
        assert stats["conditioned_blocks"] > 0 and stats["retained_slots"] >= stats["conditioned_blocks"], stats
    else:
        assert stats["conditioned_blocks"] == 0, stats

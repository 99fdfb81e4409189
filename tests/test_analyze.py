"""`hf-retrace analyze`: rejected-suffix top-1/top-k agreement, on hand-built rounds and end to end."""

import json

import pytest

from conftest import make_drafter, make_target, random_prompt

from hf_retrace.bench import analyze
from hf_retrace.models import draft_head_retrace
from hf_retrace.bench.analyze import AgreementCounts, DraftRound, analyze_generation, num_accepted, round_agreement
from hf_retrace.bench.run import torch_threads


# prompt [10, 11], generated [20, 21, 22, 23, 24, 25] at positions 2..7
SEQUENCE = [10, 11, 20, 21, 22, 23, 24, 25]
X = 99  # a token that never occurs


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on a shared 2-core machine, two threads oversubscribe and run several times slower."""
    with torch_threads(1):
        yield


def _round(anchor, drafts, topk=None):
    return DraftRound(anchor, drafts, topk if topk is not None else [[d, X, X] for d in drafts])


def test_worked_example():
    # B = 6, anchor p = 2 (token 20). Slot 1 -> position 3 (21) accepted; slot 2 -> position 4 (22) rejected.
    # Suffix slots 3, 4, 5 -> positions 5, 6, 7 = tokens 23, 24, 25: top-1 hit, top-3 hit only, miss.
    topk = [[21, 1, 2], [X, 22, 1], [23, 1, 2], [1, 24, 2], [1, 2, 3]]
    counts = round_agreement(_round(2, [21, X, 23, 1, 1], topk), SEQUENCE)
    assert (counts.rounds, counts.rounds_with_suffix, counts.slots, counts.top1, counts.topk) == (1, 1, 3, 1, 2)
    assert counts.by_distance == {1: [1, 1, 1], 2: [1, 0, 1], 3: [1, 0, 0]}
    assert counts.top1_percent == pytest.approx(100 / 3) and counts.topk_percent == pytest.approx(200 / 3)


@pytest.mark.parametrize(
    "anchor, drafts, n, slots, top1",
    [
        (2, [21, 22, 23, 24, 25], 5, 0, 0),  # full acceptance: no rejected suffix
        (2, [21, 22, 23, X, 25], 3, 1, 1),  # slot 4 rejected; slot 5 (position 7, token 25) is the whole suffix
        (2, [21, 22, 23, 24, X], 4, 0, 0),  # rejection at the final slot: nothing after it
        (2, [X, 22, 23, 24, 25], 0, 4, 4),  # rejection at slot 1: slots 2..5 (positions 4..7) all count
        (3, [X, 23, 24, 1, 1], 0, 3, 2),  # slots 2..4 at positions 5..7 (23, 24 hit; 1 misses); slot 5 is past the end
        (5, [24, X, 1, 1, 1], 1, 0, 0),  # slot 2 rejected at the last position; later slots fall past the end
        (6, [25, 1, 1, 1, 1], 1, 0, 0),  # the text ends before any rejection
    ],
)
def test_edge_rounds(anchor, drafts, n, slots, top1):
    round_ = _round(anchor, drafts)
    assert num_accepted(round_, SEQUENCE) == n
    counts = round_agreement(round_, SEQUENCE)
    assert (counts.slots, counts.top1, counts.rounds_with_suffix) == (slots, top1, int(slots > 0))
    assert counts.top1 == counts.topk  # `_round` lists the draft first and the target token nowhere else


def test_rejection_at_slot_one_by_distance():
    counts = round_agreement(_round(3, [X, 23, 24, 1, 1]), SEQUENCE)
    assert counts.by_distance == {1: [1, 1, 1], 2: [1, 1, 1], 3: [1, 0, 0]}


def test_counts_add_up():
    total = AgreementCounts()
    total.add(round_agreement(_round(3, [X, 23, 24, 1, 1]), SEQUENCE))
    total.add(round_agreement(_round(2, [21, X, 23, 1, 1], [[21], [X], [23], [1], [1]]), SEQUENCE))
    assert (total.rounds, total.rounds_with_suffix, total.slots, total.top1, total.topk) == (2, 2, 6, 3, 3)
    assert total.by_distance[1] == [2, 2, 2] and total.to_dict()["by_distance"][3] == {
        "slots": 2,
        "top1": 0,
        "topk": 0,
    }
    assert AgreementCounts().top1_percent is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze_assets")
    target = make_target("qwen3")
    target.save_pretrained(root / "target")
    make_drafter(target, block_size=4, mode="corrected").save_pretrained(root / "drafter")
    with open(root / "ids.jsonl", "w") as f:
        f.writelines(json.dumps({"input_ids": random_prompt(5 + i, seed=i)[0].tolist()}) + "\n" for i in range(3))
    return root, target


@pytest.mark.parametrize("mode", ["off", "corrected"])
def test_analyze_end_to_end(tiny, mode):
    root, _ = tiny
    out = root / f"out_{mode}"
    argv = ["--target", str(root / "target"), "--drafter", f"{root / 'drafter'}:{mode}", "--dtype", "fp32",
            "--prompt-sets", f"{root / 'ids.jsonl'}:3", "--max-new-tokens", "30", "--output-dir", str(out),
            "--num-threads", "1"]  # fmt: skip
    assert analyze.main(argv) == 0
    payload = json.loads((out / "analysis.json").read_text())
    assert payload["run"]["retrace_mode"] == mode
    pooled, per_set = payload["results"]["pooled"], payload["results"]["ids"]
    assert pooled == per_set and pooled["slots"] > 0
    assert 0.0 <= pooled["top1_percent"] <= pooled["topk_percent"] <= 100.0
    assert pooled["top1_percent"] == pytest.approx(100 * pooled["top1"] / pooled["slots"])
    assert sum(d["slots"] for d in pooled["by_distance"].values()) == pooled["slots"]
    assert "top-1 %" in (out / "analysis.md").read_text()


def test_alignment_check_catches_an_off_by_one(tiny, monkeypatch):
    _root, target = tiny
    drafter = make_drafter(target, block_size=4, mode="off")
    prompt = random_prompt(6, seed=0)
    analyze_generation(target, drafter, prompt, max_new_tokens=30)  # aligned: passes its own cross-check
    original = analyze.DraftRecorder._record

    def shifted(self, module, args, kwargs, output):
        original(self, module, args, kwargs, output)
        self.rounds[-1].anchor_position += 1  # treat slot j as predicting p+j+1

    monkeypatch.setattr(analyze.DraftRecorder, "_record", shifted)
    with pytest.raises(RuntimeError, match="accepted drafts"):
        analyze_generation(target, drafter, prompt, max_new_tokens=30)


def test_analysis_drafts_every_cycle_whatever_the_drafter_verifies(tiny):
    """A shipped-style drafter (k, confidence stop, prompt and datastore lookup set) is analysed on full drafted
    blocks, which equal the plain drafter's, and gets its settings back."""
    _root, target = tiny
    plain = make_drafter(target, block_size=4, mode="off")
    shipped = make_drafter(target, block_size=4, mode="off")
    shipped.load_state_dict(plain.state_dict())
    prompt = random_prompt(6, seed=1)
    shipped.set_datastore([target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20)[0].tolist()])
    settings = dict(num_assistant_tokens=2, assistant_confidence_threshold=0.3, prompt_lookup_num_tokens=2,
                    datastore_num_tokens=2)  # fmt: skip
    shipped.generation_config.update(**settings)
    counts = analyze_generation(target, shipped, prompt, max_new_tokens=30)
    assert counts == analyze_generation(target, plain, prompt, max_new_tokens=30) and counts.slots > 0
    assert {name: getattr(shipped.generation_config, name) for name in settings} == settings


def test_recorder_sees_what_the_generator_drafted(tiny):
    """The recorded argmax drafts, compared with the committed text, reproduce the generator's acceptance counts."""
    _, target = tiny
    drafter = make_drafter(target, block_size=4, mode="corrected")
    seen = []
    for seed in range(4):
        recorder = analyze.DraftRecorder(drafter, target.get_output_embeddings(), top_k=5)
        output = target.generate(random_prompt(5 + seed, seed=seed), assistant_model=drafter, do_sample=False,
                                 max_new_tokens=30)  # fmt: skip
        recorder.remove()
        sequence, stats = output[0].tolist(), drafter.last_generation_stats.acceptance_lengths
        assert len(recorder.rounds) == len(stats)
        inside = [(r, n) for r, n in zip(recorder.rounds, stats) if r.anchor_position + 3 < len(sequence)]
        assert len(inside) >= len(stats) - 1  # only the last block can run past the text
        assert [num_accepted(r, sequence) + 1 for r, _ in inside] == [n for _, n in inside]
        assert all(len(r.topk_ids[0]) == 5 and r.topk_ids[0][0] == r.draft_ids[0] for r in recorder.rounds)
        seen += [n for _, n in inside]
    assert set(seen) == {1, 2, 3, 4}  # every acceptance length, so both rejections and acceptances were checked


def test_recorder_scores_with_the_generators_draft_head(tiny, monkeypatch):
    """With `draft_logits_dtype` the generator drafts with a cast copy of the lm head; the analysis must score with
    that same head. Made unmistakable here: the copy's logits are rolled by one token id, so the target head's argmax
    would name other drafts and the alignment cross-check would fail."""
    _, target = tiny
    drafter = make_drafter(target, block_size=4, mode="corrected")
    drafter.generation_config.draft_logits_dtype = "bfloat16"
    original = draft_head_retrace.DraftLMHead.forward
    monkeypatch.setattr(draft_head_retrace.DraftLMHead, "forward", lambda self, h: original(self, h).roll(1, dims=-1))
    for seed in range(3):
        counts = analyze_generation(target, drafter, random_prompt(5 + seed, seed=seed), max_new_tokens=30)
        assert counts.rounds > 0

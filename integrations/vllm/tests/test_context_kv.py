"""The drafter's context rows kept between block forwards (context_kv.py): written oldest first with one row per
cache slot, when a request leaves or the bound is reached; and in an engine, the drafts made after kept rows are the
drafts made when every step writes its rows at once."""

import itertools

import pytest
import torch
from test_lossless_random import write_drafter

from conftest import PROMPTS, close_llm, greedy, make_llm
from hf_retrace_vllm import context_kv, drafter_run, proposer


def _rows(values, slots):
    """`[n, 2]` features, positions and slots of `n` rows (features carry `values`, to tell rows apart)."""
    values = torch.tensor(values, dtype=torch.float32)
    return torch.stack([values, -values], dim=1), torch.tensor(slots) % 1000, torch.tensor(slots)


def test_take_keeps_the_newest_row_of_each_slot_oldest_first():
    kept = context_kv.DeferredContextKV(max_rows=100)
    assert kept.take() is None
    kept.add(["a"], *_rows([1, 2, 3], [10, 11, 12]))  # 11 and 12: rows of drafts that were rejected
    kept.add(["a"], *_rows([4, 5], [11, 12]))  # the committed tokens at the same positions
    kept.add(["a", "b"], *_rows([6, 7], [13, 50]))
    features, positions, slots = kept.take()
    assert slots.tolist() == [10, 11, 12, 13, 50]
    assert features[:, 0].tolist() == [1, 4, 5, 6, 7] and positions.tolist() == [10, 11, 12, 13, 50]
    assert kept.take() is None and kept.num_rows == 0


def test_rows_are_due_when_a_request_leaves_or_the_bound_is_reached():
    kept = context_kv.DeferredContextKV(max_rows=6)
    assert not kept.due(["a"])  # nothing kept
    kept.add(["a", "b"], *_rows([1, 2, 3, 4], [1, 2, 3, 4]))
    assert not kept.due(["a", "b"]) and not kept.due(["a", "b", "c"])  # a request joining changes nothing
    assert kept.due(["a"])  # "b" left: its blocks may go to another request
    kept.add(["a", "b"], *_rows([5, 6, 7], [5, 6, 7]))
    assert kept.due(["a", "b"])  # 4 + 3 rows > 6
    assert context_kv.DeferredContextKV(max_rows=0).due([]) is False
    immediate = context_kv.DeferredContextKV(max_rows=0)
    immediate.add(["a"], *_rows([1], [1]))
    assert immediate.due(["a"])  # 0: every step's rows are written at once
    with pytest.raises(ValueError, match="max_rows must be >= 0"):
        context_kv.DeferredContextKV(max_rows=-1)


class _WriteEveryStep:
    """The reference: every step's rows are written in that step, as before rows were kept."""

    def __init__(self, max_rows):
        self.rows = None

    def add(self, req_ids, features, positions, slots):
        self.rows = (features, positions.clone(), slots.clone())

    def due(self, req_ids):
        return self.rows is not None

    def take(self):
        rows, self.rows = self.rows, None
        return rows


def _drafts_of_a_run(target, folder, monkeypatch, *, keep: bool):
    """Greedy outputs, and every `propose()` result with whether the block forward ran, in an in-process engine
    whose proposer keeps context rows (`keep`) or writes them every step."""
    calls = []
    original = proposer.ReTraceDFlashProposer.propose

    def recording(self, *args, **kwargs):
        forwards = self.stats.drafter_forwards
        proposals = original(self, *args, **kwargs)
        calls.append((self.stats.drafter_forwards > forwards, [list(p) for p in proposals]))
        return proposals

    monkeypatch.setattr(proposer.ReTraceDFlashProposer, "propose", recording)
    if not keep:
        monkeypatch.setattr(proposer, "DeferredContextKV", _WriteEveryStep)
    llm = make_llm(target, {"method": "dflash", "model": str(folder), "num_speculative_tokens": 3})
    try:  # one prompt at a time: a step of one request on a lookup cycle runs no block forward
        return [greedy(llm, [prompt])[0] for prompt in PROMPTS], calls
    finally:
        close_llm(llm)
        monkeypatch.undo()


def test_drafts_after_kept_rows_equal_drafts_after_immediate_writes(target, plain_greedy, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the proposer runs in this process
    write_drafter(tmp_path / "drafter", plain=False)
    kept_outputs, kept = _drafts_of_a_run(target, tmp_path / "drafter", monkeypatch, keep=True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    immediate_outputs, immediate = _drafts_of_a_run(target, tmp_path / "drafter", monkeypatch, keep=False)
    assert kept_outputs == immediate_outputs == plain_greedy
    # the rows were kept across steps without a block forward, then a block forward read them
    forwards = [ran for ran, _ in kept]
    assert any(not a and b for a, b in itertools.pairwise(forwards)), "no lookup-only step before a drafter step"
    assert kept == immediate


def test_context_rows_are_what_the_input_kernel_writes(target, tmp_path, monkeypatch):
    """Steps with no block forward take their context rows' positions and slots from `context_rows`, not from vLLM's
    input kernel: at every step that runs the kernel (a block forward), the two agree, prefill chunks included."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the proposer runs in this process
    write_drafter(tmp_path / "drafter", plain=False)
    compared, original = [], proposer.prepare_block_inputs

    def checked(self, step_inputs):
        out = original(self, step_inputs)
        rows = step_inputs["target_positions"].shape[0]
        positions, slots = drafter_run.context_rows(self, step_inputs["cad"], step_inputs["target_positions"])
        compared.append((rows, torch.equal(positions, self._context_positions_buffer[:rows]),
                         torch.equal(slots, self._context_slot_mapping_buffer[:rows])))  # fmt: skip
        return out

    monkeypatch.setattr(proposer, "prepare_block_inputs", checked)
    llm = make_llm(target, {"method": "dflash", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 3})
    try:  # all prompts at once: steps of several requests, and prompts prefilled beside decoding ones
        greedy(llm)
    finally:
        close_llm(llm)
    assert compared and all(same_positions and same_slots for _, same_positions, same_slots in compared), compared
    assert max(rows for rows, _, _ in compared) > len(PROMPTS) * 4  # some step carried more than verification rows

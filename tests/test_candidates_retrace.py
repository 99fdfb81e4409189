"""Candidate sources (`candidates_retrace`): the interface the generator composes in priority order in front of the
drafter; a new source is one class plus one setting."""

import pytest
import torch

from conftest import make_drafter, make_target, random_prompt
from hf_retrace import CandidateSource
from hf_retrace.models import candidates_retrace, decoding_retrace
from hf_retrace.models.candidates_retrace import DatastoreSource, PromptLookupSource, candidate_sources


def test_sources_are_asked_in_priority_order_and_only_when_turned_on():
    drafter = make_drafter(make_target("qwen3"), block_size=4)
    drafter.set_datastore([[9, 10, 11, 12]])
    drafter.generation_config.update(prompt_lookup_num_tokens=2, datastore_num_tokens=2, datastore_min_ngram_size=1)
    sources = candidate_sources(drafter, drafter.decoding_settings())
    assert [type(s) for s in sources] == [PromptLookupSource, DatastoreSource]
    assert sources[0].propose(torch.tensor([4, 5, 6, 4, 5]), max_tokens=5).tolist() == [6, 4]
    assert sources[0].propose(torch.tensor([4, 5, 6, 4, 5]), max_tokens=1).tolist() == [6]  # room left caps it
    assert sources[1].propose(torch.tensor([3, 9]), max_tokens=5).tolist() == [10, 11]
    drafter.generation_config.prompt_lookup_num_tokens = None
    assert [type(s) for s in candidate_sources(drafter, drafter.decoding_settings())] == [DatastoreSource]


def test_a_new_source_is_one_class_plus_one_setting(monkeypatch):
    """A source that always proposes the token after the last one: registering the class and adding its setting is
    all it takes for the generator to verify its candidates (and stay lossless)."""
    monkeypatch.setitem(decoding_retrace.DECODING_DEFAULTS, "echo_num_tokens", None)
    fields = {**decoding_retrace.ReTraceDecodingSettings.__dataclass_fields__}
    monkeypatch.setattr(decoding_retrace, "ReTraceDecodingSettings", _settings_with_echo(fields))
    registry = list(CandidateSource.registry)

    class EchoSource(CandidateSource):
        name, priority, setting = "echo", 5, "echo_num_tokens"

        def propose(self, input_ids, max_tokens):
            return input_ids[-1:].repeat(min(self.num_tokens, max_tokens))

    try:
        target = make_target("qwen3")
        drafter = make_drafter(target, block_size=4)
        drafter.generation_config.echo_num_tokens = 2
        prompt = random_prompt(6, seed=2)
        expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20)
        got = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20, assistant_model=drafter)
        assert got.tolist() == expected.tolist()
        stats = drafter.last_generation_stats
        assert stats.source_cycles["echo"] == len(stats.acceptance_lengths)
    finally:
        CandidateSource.registry[:] = registry


def _settings_with_echo(fields):
    import dataclasses

    names = [(name, f.type) for name, f in fields.items()] + [("echo_num_tokens", int | None)]
    return dataclasses.make_dataclass("ReTraceDecodingSettings", names, frozen=True)


def test_the_base_class_proposes_nothing_by_itself():
    with pytest.raises(NotImplementedError):
        CandidateSource.propose(None, torch.tensor([1]), 1)
    assert candidates_retrace.CandidateSource.registry[:2] == [PromptLookupSource, DatastoreSource]

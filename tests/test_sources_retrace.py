"""Candidate sources (`sources_retrace`): the interface both engines compose in priority order in front of the
drafter, and the registry that drives the settings, the vLLM export, the replay and the plugin's proposer. A new
source is one class plus one setting."""

import importlib
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import make_drafter, make_target, random_prompt
from hf_retrace import CandidateSource
from hf_retrace.export.vllm import export_for_vllm
from hf_retrace.models import policy_settings_retrace, sources_retrace
from hf_retrace.models.sources_retrace import DatastoreSource, PromptLookupSource, candidate_sources, source_order


PLUGIN_ROOT = Path(__file__).resolve().parents[1] / "integrations" / "vllm"


def plugin_module(name: str):
    """A module of the vLLM plugin (`hf_retrace_vllm.<name>`), imported from the source tree without vLLM."""
    if str(PLUGIN_ROOT) not in sys.path:
        sys.path.insert(0, str(PLUGIN_ROOT))
    return importlib.import_module(f"hf_retrace_vllm.{name}")


def test_sources_are_asked_in_priority_order_and_only_when_turned_on():
    drafter = make_drafter(make_target("qwen3"), block_size=4)
    drafter.set_datastore([[9, 10, 11, 12]])
    drafter.generation_config.update(prompt_lookup_num_tokens=2, datastore_num_tokens=2, datastore_min_ngram_size=1)
    sources = candidate_sources(drafter.decoding_settings(), drafter)
    assert [type(s) for s in sources] == [PromptLookupSource, DatastoreSource]
    assert sources[0].propose(np.array([4, 5, 6, 4, 5]), max_tokens=5) == [6, 4]
    assert sources[0].propose(np.array([4, 5, 6, 4, 5]), max_tokens=1) == [6]  # room left caps it
    assert sources[1].propose(np.array([3, 9]), max_tokens=5) == [10, 11]
    drafter.generation_config.prompt_lookup_num_tokens = None
    assert [type(s) for s in candidate_sources(drafter.decoding_settings(), drafter)] == [DatastoreSource]


def test_the_base_class_proposes_nothing_by_itself():
    with pytest.raises(NotImplementedError):
        CandidateSource.propose(None, np.array([1]), 1)
    assert sources_retrace.CandidateSource.registry[:2] == [PromptLookupSource, DatastoreSource]
    assert source_order()[:2] == ["prompt_lookup", "datastore"]


def _echo_source(base):
    """The one class a new source is: it proposes the last committed token again, `echo_num_tokens` times."""

    class EchoSource(base):
        name, priority, setting = "echo", 5, "echo_num_tokens"

        def propose(self, tokens, max_tokens):
            return [int(tokens[-1])] * min(self.num_tokens, max_tokens)

    return EchoSource


@pytest.fixture
def echo_source(monkeypatch):
    """`EchoSource` registered in both engines' copies of the registry (the plugin runs its own copy of the shared
    file); each registry is restored afterwards."""
    plugin_base = plugin_module("shared.sources_retrace").CandidateSource
    for base in (CandidateSource, plugin_base):
        monkeypatch.setattr(base, "registry", list(base.registry))
    return _echo_source(CandidateSource), _echo_source(plugin_base)


def test_a_new_source_is_one_class_plus_one_setting(echo_source, tmp_path):
    """Registering the class is all it takes: its setting is a decoding setting with its checks, transformers
    generation verifies its candidates (and stays lossless), the vLLM export writes it to the policy block, and the
    plugin's proposal function asks it first."""
    assert policy_settings_retrace.DECODING_DEFAULTS["echo_num_tokens"] is None
    assert source_order()[0] == "echo"
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.generation_config.echo_num_tokens = 0
    with pytest.raises(ValueError, match="echo_num_tokens must be >= 1"):
        drafter.decoding_settings()
    drafter.generation_config.echo_num_tokens = 2

    prompt = random_prompt(6, seed=2)
    expected = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20)
    got = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=20, assistant_model=drafter)
    assert got.tolist() == expected.tolist()
    stats = drafter.last_generation_stats
    assert stats.source_cycles["echo"] == len(stats.acceptance_lengths) > 0

    drafter.save_pretrained(tmp_path / "drafter")
    out = export_for_vllm(tmp_path / "drafter", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["hf_retrace"]["echo_num_tokens"] == 2

    policy = plugin_module("policy")
    draft_policy = policy.DraftPolicy.from_hf_config(types.SimpleNamespace(**config))
    sources = policy.policy_sources(draft_policy, out, config["vocab_size"])
    assert policy.lookup(sources, np.array([3, 1, 2, 3, 1]), 5) == ([1, 1], "echo")
    assert policy.lookup(sources, np.array([3, 1, 2, 3, 1]), 1) == ([1], "echo")
    del config["hf_retrace"]["echo_num_tokens"]  # a folder exported before the source existed: no silent default
    with pytest.raises(ValueError, match=r"lacks \['echo_num_tokens'\]"):
        policy.DraftPolicy.from_hf_config(types.SimpleNamespace(**config))

"""Both engines propose the same tokens from the same committed tokens: the transformers generator's entry point
(the shared `SpeculationPolicy.plan` under `"fixed"`, on the ids as the generator hands them) and the vLLM
plugin's (`policy.lookup` over the folder `hf-retrace export --format vllm` writes, its datastore read back from `datastore.safetensors`), on random
token streams, with hash collisions forced and responses short enough that most n-grams meet a separator."""

import itertools
import json
import random
import types

import numpy as np
import pytest
import torch

from conftest import make_drafter, make_target
from hf_retrace.export.vllm import export_for_vllm
from hf_retrace.models import lookup_retrace
from hf_retrace.models.sources_retrace import candidate_sources
from hf_retrace.models.speculation_retrace import SpeculationPolicy
from test_sources_retrace import plugin_module


# (prompt lookup num/max/min, datastore num/max/min, responses' vocabulary, longest response)
POLICIES = [
    ((3, 3, 2), (3, 6, 3), 4, 30),
    ((2, 2, 1), (4, 4, 1), 3, 6),
    (None, (5, 3, 2), 2, 3),  # datastore only: tiny responses, every walk meets separators
    ((4, 5, 3), None, 3, 10),  # prompt lookup only
    ((1, 1, 1), (2, 2, 2), 128, 40),  # the whole vocabulary: few matches, the drafter's branch
]


def _transformers_proposal(settings, sources, tokens: list[int], room: int):
    """What the generator's policy plans for a cycle: `(source name, proposed tokens)`, or `None` (the drafter)."""
    policy = SpeculationPolicy(settings, sources, block_size=8)
    action = policy.plan([(0, torch.tensor([tokens])[0].numpy(), room)]).action(0)
    return None if action[0] == "draft" else (action[2], action[1])


def _plugin_proposal(policy, sources, tokens: list[int], room: int):
    proposal, name = policy.lookup(sources, np.array(tokens, dtype=np.int64), room)
    if proposal is None:
        assert name == policy.DRAFTER
        return None
    engine_names = {v: k for k, v in policy.STATS_NAMES.items()}
    return engine_names.get(name, name), proposal


def _check_policy(tmp_path, lookup_settings, datastore_settings, vocab, longest, seed, cases=100):
    rng = random.Random(seed)
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8, mode="off")
    responses = [[rng.randrange(vocab) for _ in range(rng.randrange(1, longest + 1))] for _ in range(60)]
    drafter.set_datastore(responses)
    config = drafter.generation_config
    names = ("prompt_lookup_num_tokens", "max_matching_ngram_size", "prompt_lookup_min_ngram_size")
    config.update(**dict(zip(names, lookup_settings or (None, 3, 2))))
    names = ("datastore_num_tokens", "datastore_max_ngram_size", "datastore_min_ngram_size")
    config.update(**dict(zip(names, datastore_settings or (None, 6, 3))))
    drafter.save_pretrained(tmp_path / "drafter")
    out = export_for_vllm(tmp_path / "drafter", tmp_path / "out")
    exported = json.loads((out / "config.json").read_text())

    policy = plugin_module("policy")
    draft_policy = policy.DraftPolicy.from_hf_config(types.SimpleNamespace(**exported))
    plugin_sources = policy.policy_sources(draft_policy, out, exported["vocab_size"])
    settings = drafter.decoding_settings()
    transformers_sources = candidate_sources(settings, drafter)
    kinds = {"prompt_lookup": 0, "datastore": 0, None: 0}
    for _ in range(cases):
        if rng.random() < 0.5:  # a stretch of a response: the datastore has its continuation
            response = rng.choice(responses)
            tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))] + response[: rng.randrange(1, 8)]
        else:
            tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        room = rng.randrange(1, 7)
        got = _transformers_proposal(settings, transformers_sources, tokens, room)
        assert got == _plugin_proposal(policy, plugin_sources, tokens, room), (tokens, room)
        kinds[None if got is None else got[0]] += 1
    return kinds


@pytest.mark.parametrize("index", range(len(POLICIES)))
def test_both_engines_propose_alike(tmp_path, index):
    lookup_settings, datastore_settings, vocab, longest = POLICIES[index]
    kinds = _check_policy(tmp_path, lookup_settings, datastore_settings, vocab, longest, seed=index)
    if lookup_settings and vocab < 10:
        assert kinds["prompt_lookup"] > 10, kinds
    if datastore_settings and vocab < 10:
        assert kinds["datastore"] > 5, kinds
    if vocab > 100 or lookup_settings is None:
        assert kinds[None] > 0, kinds  # the drafter's branch too


@pytest.fixture
def colliding_hashes(monkeypatch):
    """Tiny hash primes in both engines' copies: distinct n-grams share keys all the time, so a lookup often finds
    another n-gram's entry, which the stored n-gram check must turn into no proposal at that size."""
    plugin_lookup = plugin_module("shared.lookup_retrace")
    for module in (lookup_retrace, plugin_lookup):
        monkeypatch.setattr(module, "_PRIMES", (7, 5))
        monkeypatch.setattr(module, "_BASE", 3)
        monkeypatch.setattr(module, "_SHIFT", 8)


def test_both_engines_propose_alike_when_hashes_collide(tmp_path, colliding_hashes):
    kinds = _check_policy(tmp_path, None, (3, 4, 1), vocab=6, longest=12, seed=7, cases=200)
    assert kinds["datastore"] > 50, kinds
    # the collisions were real: the 6^4 distinct 4-grams share at most 7 * 5 keys
    keys = {lookup_retrace._suffix_keys(list(gram), [4])[4] for gram in itertools.product(range(6), repeat=4)}
    assert len(keys) <= 35

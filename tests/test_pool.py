"""The training pool: continuous-batching generation equals per-prompt greedy generation, captured features equal a
full forward, and the pool (tokens + feature cache) resumes and rebuilds."""

import numpy as np
import pytest
import torch

from conftest import SUPPORT, make_target, random_prompt
from hf_retrace.data.continuous_generation import ContinuousBatchGenerator, PromptItem
from hf_retrace.data.responses import DataCollatorWithFeatures
from hf_retrace.data.pool import (
    build_pool,
    cache_pool_features,
    cache_target_ids,
    load_feature_dataset,
    load_pool_dataset,
    pool_prompt_stream,
    read_token_shards,
)


EOS = SUPPORT[0]  # the restricted target's a: 6 of the 9 test prompts reach it within 14 tokens, at varied steps
LAYERS = [0, 2]


def _items(num: int) -> list[PromptItem]:
    return [PromptItem(i, "rand", random_prompt(2 + (5 * i) % 9, seed=i)[0].tolist()) for i in range(num)]


def _reference(target, item, max_new_tokens):
    prompt = torch.tensor([item.prompt_ids])
    out = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def test_continuous_batching_equals_per_prompt_generation():
    target = make_target("llama")
    items = _items(9)
    generator = ContinuousBatchGenerator(target, {EOS}, batch_size=3, max_new_tokens=14, layer_ids=LAYERS,
                                         feature_dtype=torch.float32, refill_fraction=0.3)  # fmt: skip
    rows = {row.index: row for row in generator.generate(items)}
    assert sorted(rows) == list(range(9))
    assert any(row.finished for row in rows.values()) and not all(row.finished for row in rows.values())
    for item in items:
        row = rows[item.index]
        assert row.response_ids == _reference(target, item, 14), f"prompt {item.index}"
        assert row.finished == (row.response_ids[-1] == EOS)
        with torch.no_grad():
            hidden = target(torch.tensor([row.prompt_ids + row.response_ids]), output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[k + 1] for k in LAYERS], dim=-1)[0]
        torch.testing.assert_close(row.features[:-1], expected[:-1], atol=1e-5, rtol=1e-4)
        assert not row.features[-1].any()  # the last token is never fed back
    assert generator.generated_tokens == sum(len(r.response_ids) for r in rows.values())


def test_prompt_stream_keeps_proportions():
    stream = pool_prompt_stream({"a": [[1]] * 6, "b": [[2]] * 3})
    assert [item.index for item in stream] == list(range(9))
    assert "".join(item.source for item in stream) == "abaabaaba"  # every prefix keeps roughly 2:1


def test_pool_resumes_and_features_rebuild(tmp_path):
    target = make_target("llama")
    items = _items(10)
    kwargs = dict(eos_token_ids={EOS}, layer_ids=LAYERS, target_name="tiny", batch_size=4, max_new_tokens=10,
                  shard_rows=3)  # fmt: skip
    first = build_pool(target, items, tmp_path / "pool", tmp_path / "features", max_response_tokens=15, **kwargs)
    assert 15 <= first < 10 * 10
    partial = read_token_shards(tmp_path / "pool")
    total = build_pool(target, items, tmp_path / "pool", tmp_path / "features", **kwargs)  # resume
    rows = read_token_shards(tmp_path / "pool")
    assert sorted(r["index"] for r in rows) == list(range(10))  # every prompt once, none twice
    assert {r["index"] for r in partial} <= {r["index"] for r in rows}
    assert total == sum(len(r["response_ids"]) for r in rows)
    for row in rows:
        assert row["response_ids"] == _reference(target, items[row["index"]], 10)

    dataset = load_feature_dataset(tmp_path / "features", layer_ids=[2], target_name="tiny")
    assert len(dataset) == 10
    # a fresh machine has only the token shards: the features are recomputed from them
    import shutil

    shutil.rmtree(tmp_path / "features")
    written = cache_pool_features(target, tmp_path / "pool", tmp_path / "rebuilt", layer_ids=LAYERS, target_name="tiny")
    assert len(written) == len(list((tmp_path / "pool" / "tokens").glob("*.npz")))
    rebuilt = load_feature_dataset(tmp_path / "rebuilt").with_format("numpy")
    row = rebuilt[0]
    with torch.no_grad():
        hidden = target(torch.tensor([row["input_ids"].tolist()]), output_hidden_states=True).hidden_states
    stored = torch.from_numpy(row["features"].astype(np.int16)).view(torch.bfloat16).float()
    expected = torch.cat([hidden[k + 1] for k in LAYERS], dim=-1)[0]
    torch.testing.assert_close(stored[:-1], expected[:-1], atol=2e-2, rtol=2e-2)  # bf16 storage

    collator = DataCollatorWithFeatures(cache_layer_ids=LAYERS, layer_ids=[2], hidden_size=32, max_length=6)
    longest = max(range(len(rebuilt)), key=lambda i: len(rebuilt[i]["input_ids"]))
    row = rebuilt[longest]
    stored = torch.from_numpy(row["features"].astype(np.int16)).view(torch.bfloat16)
    batch = collator([row, rebuilt[(longest + 1) % len(rebuilt)]])
    assert len(row["input_ids"]) > 6 and batch["features"].shape == (2, 6, 32)  # cut to max_length
    assert batch["features"].dtype == torch.bfloat16
    torch.testing.assert_close(batch["features"][0], stored[:6, 32:])  # layer 2 is the cache's second block
    prompt_length = int(row["prompt_length"])
    assert batch["loss_mask"][0].tolist() == [0] * min(prompt_length, 6) + [1] * max(6 - prompt_length, 0)


def test_a_changed_prompt_stream_never_generates_a_prompt_twice(tmp_path):
    target = make_target("llama")
    items = _items(9)
    kwargs = dict(eos_token_ids={EOS}, layer_ids=LAYERS, target_name="tiny", batch_size=4, max_new_tokens=6,
                  shard_rows=3)  # fmt: skip
    build_pool(target, items[:6], tmp_path / "pool", None, **kwargs)
    # the same prompts at positions shifted by 3 (a source list that changed size): by position alone, prompts 3-5
    # would be generated again under positions 6-8
    shifted = [PromptItem(item.index + 3, item.source, item.prompt_ids) for item in items]
    build_pool(target, shifted, tmp_path / "pool", None, **kwargs)
    rows = read_token_shards(tmp_path / "pool")
    prompts = [tuple(r["prompt_ids"]) for r in rows]
    assert sorted(prompts) == sorted(tuple(item.prompt_ids) for item in items)  # each of the 9 prompts once


def test_a_time_budget_stops_taking_prompts_and_the_pool_reads_as_a_training_set(tmp_path):
    target = make_target("llama")
    items = _items(6)
    kwargs = dict(eos_token_ids={EOS}, layer_ids=LAYERS, target_name="tiny", batch_size=2, max_new_tokens=8,
                  shard_rows=4)  # fmt: skip
    assert build_pool(target, items, tmp_path / "pool", None, max_seconds=0, **kwargs) == 0  # time is up at once
    assert read_token_shards(tmp_path / "pool") == []
    with pytest.raises(ValueError, match="no token shard"):
        load_pool_dataset(tmp_path / "pool")
    build_pool(target, items, tmp_path / "pool", None, max_seconds=600, **kwargs)
    rows = read_token_shards(tmp_path / "pool")
    assert sorted(r["index"] for r in rows) == list(range(6))

    dataset = load_pool_dataset(tmp_path / "pool", max_length=9)
    assert len(dataset) == 6
    for row, example in zip(rows, dataset):
        ids = row["prompt_ids"] + row["response_ids"]
        assert example["input_ids"] == ids[:9]
        assert example["loss_mask"] == ([0] * len(row["prompt_ids"]) + [1] * len(row["response_ids"]))[:9]


def test_feature_cache_mismatches_are_clear_errors(tmp_path):
    target = make_target("llama")
    build_pool(target, _items(2), tmp_path / "pool", tmp_path / "features", eos_token_ids={EOS}, layer_ids=LAYERS,
               target_name="tiny", batch_size=2, max_new_tokens=3)  # fmt: skip
    with pytest.raises(ValueError, match="caches only"):
        load_feature_dataset(tmp_path / "features", layer_ids=[1], target_name="tiny")
    with pytest.raises(ValueError, match="not of 'other'"):
        load_feature_dataset(tmp_path / "features", target_name="other")
    with pytest.raises(ValueError, match="not a feature cache"):
        load_feature_dataset(tmp_path / "pool")
    with pytest.raises(ValueError, match="holds features of"):
        cache_pool_features(target, tmp_path / "pool", tmp_path / "features", layer_ids=[1], target_name="tiny")


def test_target_ids_are_the_greedy_chain(tmp_path):
    """`cache_target_ids` adds the target's greedy next token of every position: the prefill argmax over the prompt,
    the recorded greedy response after it, -100 on the last token; it rewrites only shards that lack it."""
    target = make_target("llama")
    items = _items(5)
    build_pool(target, items, tmp_path / "pool", tmp_path / "features", eos_token_ids={EOS}, layer_ids=LAYERS,
               target_name="tiny", batch_size=3, max_new_tokens=8, shard_rows=3)  # fmt: skip
    assert len(cache_target_ids(target, tmp_path / "features", batch_tokens=24)) == 2  # small batches: padding too
    assert cache_target_ids(target, tmp_path / "features") == []  # resumable: nothing left to add
    dataset = load_feature_dataset(tmp_path / "features")
    for row in dataset:
        ids, labels, p = row["input_ids"], row["target_ids"], row["prompt_length"]
        with torch.no_grad():
            argmax = target(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        assert labels[: p - 1] == argmax[: p - 1]
        assert labels[p - 1 : -1] == ids[p:] == argmax[p - 1 : -1]  # greedy generation: the same chain
        assert labels[-1] == -100
    collator = DataCollatorWithFeatures(cache_layer_ids=LAYERS, layer_ids=[2], hidden_size=32)
    rows = [dataset[0], dataset[1]]
    batch = collator(rows)
    shortest = min(range(2), key=lambda i: len(rows[i]["input_ids"]))
    n = len(rows[shortest]["input_ids"])
    assert batch["target_ids"][shortest, :n].tolist() == rows[shortest]["target_ids"]
    assert (batch["target_ids"][shortest, n:] == -100).all()


def test_target_ids_leave_the_shared_preamble_unlabelled(tmp_path):
    """A preamble that every row of a shard shares (a system prompt) gets -100, so prompt blocks anchor after it;
    a shard labelled before the rule gets it on the next call, without a new prefill."""
    from hf_retrace.data.pool import _save_with_column

    target = make_target("llama")
    preamble = [7, 8, 9]
    items = [PromptItem(i, "rand", preamble + random_prompt(3 + i, seed=i)[0].tolist()) for i in range(4)]
    build_pool(target, items, tmp_path / "pool", tmp_path / "features", eos_token_ids={EOS}, layer_ids=LAYERS,
               target_name="tiny", batch_size=4, max_new_tokens=5)  # fmt: skip
    cache_target_ids(target, tmp_path / "features")
    shard = next((tmp_path / "features").glob("shard_*"))
    labelled = load_feature_dataset(tmp_path / "features")
    for row in labelled:
        assert row["target_ids"][:3] == [-100] * 3 and -100 not in row["target_ids"][3:-1]
    # the same shard as labelled before the rule: the preamble's argmax labels are back
    with torch.no_grad():
        unmasked = [target(torch.tensor([r["input_ids"]])).logits[0, :3].argmax(-1).tolist() + r["target_ids"][3:]
                    for r in labelled]  # fmt: skip
    _save_with_column(labelled.remove_columns("target_ids"), "target_ids", unmasked, shard)
    assert cache_target_ids(target, tmp_path / "features") == [shard.name]
    assert load_feature_dataset(tmp_path / "features")["target_ids"] == labelled["target_ids"]
    assert cache_target_ids(target, tmp_path / "features") == []


def test_a_pool_grown_after_target_ids_loads_without_them(tmp_path):
    """Shards generated after `cache_target_ids` ran have no target ids: the cache still loads (responses-only
    training needs none) without the column, and the next `cache_target_ids` labels only the new shards."""
    target = make_target("llama")
    kwargs = dict(eos_token_ids={EOS}, layer_ids=LAYERS, target_name="tiny", batch_size=3, max_new_tokens=6,
                  shard_rows=3)  # fmt: skip
    build_pool(target, _items(3), tmp_path / "pool", tmp_path / "features", **kwargs)
    cache_target_ids(target, tmp_path / "features")
    build_pool(target, _items(6), tmp_path / "pool", tmp_path / "features", **kwargs)
    grown = load_feature_dataset(tmp_path / "features")
    assert len(grown) == 6 and "target_ids" not in grown.column_names
    batch = DataCollatorWithFeatures(cache_layer_ids=LAYERS, layer_ids=[2], hidden_size=32)([grown[0], grown[5]])
    assert "target_ids" not in batch and batch["features"].shape[0] == 2
    assert len(cache_target_ids(target, tmp_path / "features")) == 1
    assert len(load_feature_dataset(tmp_path / "features")["target_ids"]) == 6

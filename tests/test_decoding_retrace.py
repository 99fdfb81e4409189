"""The drafter's decoding settings (`decoding_retrace`): its `generation_config`, what "unset" means, which
`generate(...)` values override it for one call, and a setting put on the network config is refused."""

import pytest
from transformers import GenerationConfig

from conftest import lossless_call_with, make_drafter, make_target, random_prompt
from hf_retrace import ReTraceDrafterModel
from hf_retrace.models.decoding_retrace import DECODING_DEFAULTS, drafter_generation_config, resolve_decoding_settings


def _call_config(**kwargs) -> GenerationConfig:
    """A `generate` call's config as transformers prepares it: the global defaults (20, 0.4, ...) filled in."""
    config = GenerationConfig(**kwargs)
    config.update(**config._get_default_generation_params(), defaults_only=True)
    return config


def test_unset_is_none_and_means_the_drafters_default_not_transformers():
    settings = resolve_decoding_settings(drafter_generation_config(), block_size=16, has_datastore=False)
    assert settings.num_assistant_tokens == 15  # every draft of the block, not transformers' 20
    assert settings.assistant_confidence_threshold is None  # no confidence stop, not transformers' 0.4
    assert settings.prompt_lookup_num_tokens is None and settings.datastore_num_tokens is None
    assert (settings.max_matching_ngram_size, settings.prompt_lookup_min_ngram_size) == (3, 2)
    bare = GenerationConfig()  # a generation_config.json without our keys: the same defaults
    assert resolve_decoding_settings(bare, 16, False) == settings


def test_a_calls_values_override_and_its_global_defaults_do_not():
    stored = drafter_generation_config(num_assistant_tokens=3, prompt_lookup_num_tokens=3)
    untouched = resolve_decoding_settings(stored, 16, False, _call_config())
    assert (untouched.num_assistant_tokens, untouched.assistant_confidence_threshold) == (3, None)
    given = resolve_decoding_settings(stored, 16, False, _call_config(num_assistant_tokens=5,
                                      assistant_confidence_threshold=0.3, max_matching_ngram_size=1))  # fmt: skip
    assert (given.num_assistant_tokens, given.assistant_confidence_threshold) == (5, 0.3)
    # a smaller longest n-gram lowers the shortest
    assert (given.max_matching_ngram_size, given.prompt_lookup_min_ngram_size) == (1, 1)
    assert given.prompt_lookup_num_tokens == 3  # not given: the drafter's


def test_generate_kwargs_override_for_one_call_only():
    drafter, again = lossless_call_with(20, num_assistant_tokens=1)
    assert max(drafter.last_generation_stats.acceptance_lengths) <= 2  # k = 1: at most one draft and the bonus
    assert drafter.generation_config.num_assistant_tokens is None
    again()
    assert max(drafter.last_generation_stats.acceptance_lengths) > 2
    with pytest.raises(ValueError, match=r"num_assistant_tokens must be in \[1, block_size - 1 = 3\]"):
        again(num_assistant_tokens=7)


def test_a_setting_put_on_the_model_config_is_a_clear_error():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.config.prompt_lookup_num_tokens = 2  # the old place: it would silently do nothing
    with pytest.raises(ValueError, match=r"drafter\.generation_config\.prompt_lookup_num_tokens = \.\.\."):
        target.generate(random_prompt(5, seed=0), max_new_tokens=4, pad_token_id=0, assistant_model=drafter)


def test_saved_generation_config_holds_the_settings_and_config_json_none(tmp_path):
    drafter = make_drafter(make_target("qwen3"), block_size=4)
    drafter.generation_config.update(num_assistant_tokens=2, assistant_confidence_threshold=0.25)
    drafter.save_pretrained(tmp_path)
    config_json = (tmp_path / "config.json").read_text()
    assert not any(f'"{key}"' in config_json for key in (*DECODING_DEFAULTS, "prompt_lookup_max_ngram_size"))
    loaded = ReTraceDrafterModel.from_pretrained(tmp_path)
    settings = loaded.generation_config
    assert (settings.num_assistant_tokens, settings.assistant_confidence_threshold) == (2, 0.25)
    drafter.generation_config.num_assistant_tokens = 9  # more drafts than the block has: refused, nothing written
    with pytest.raises(ValueError, match="num_assistant_tokens must be in"):
        drafter.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()

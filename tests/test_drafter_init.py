"""Warm start of a fresh drafter from its target (`drafter_init="target"`): what is copied, what is not, and that
the drafter's context starts as the deepest target layer read."""

import pytest
import torch

from hf_retrace import ReTraceDrafterModel
from hf_retrace.trainer.drafter_init import init_drafter_from_target
from hf_retrace.trainer.config import ReTraceConfig
from hf_retrace.trainer.setup import build_tiny_target, init_drafter


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(seed=0)


def test_copies_top_layers_final_norm_and_selects_deepest_layer(target):
    torch.manual_seed(0)
    drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=2, block_size=4).float()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    copied = init_drafter_from_target(drafter, target)
    # the 4-layer target's last two layers -> drafter layers 0, 1, parameter for parameter
    for i, source in enumerate(target.model.layers[2:]):
        for name, param in source.named_parameters():
            torch.testing.assert_close(drafter.layers[i].get_parameter(name), param, rtol=0, atol=0)
            assert f"layers.{i}.{name}" in copied
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight, rtol=0, atol=0)
    # fc selects the deepest layer read: features [h_a ; h_b] -> h_deepest
    hidden = target.config.hidden_size
    ids = drafter.config.target_layer_ids
    features = torch.randn(3, len(ids) * hidden)
    deepest = ids.index(max(ids))
    torch.testing.assert_close(drafter.fc(features), features[:, deepest * hidden : (deepest + 1) * hidden])
    # ReTrace modules keep their init, W_v = 0 included
    for key in ("retrace.correction.weight", "retrace.value_proj.weight", "retrace.gate"):
        torch.testing.assert_close(drafter.state_dict()[key], before[key], rtol=0, atol=0)
    assert not drafter.retrace.value_proj.weight.any()


def test_init_drafter_applies_it_only_when_asked(target, tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", drafter_num_layers=1, block_size=4)
    random = init_drafter(ReTraceConfig(**common), target)
    warm = init_drafter(ReTraceConfig(**common, drafter_init="target"), target)
    source = target.model.layers[-1].mlp.up_proj.weight
    torch.testing.assert_close(warm.layers[0].mlp.up_proj.weight, source, rtol=0, atol=0)
    assert not torch.equal(random.layers[0].mlp.up_proj.weight, source)


def test_loaded_drafter_takes_a_new_block_size(target, tmp_path):
    """B sizes no parameter: a saved B = 8 drafter loads for training at B = 4 with the same weights."""
    torch.manual_seed(0)
    saved = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=8, anchor_broadcast=True)
    saved.save_pretrained(tmp_path / "b8")
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", drafter_name_or_path=str(tmp_path / "b8"))
    kept = init_drafter(ReTraceConfig(**common), target)
    reblocked = init_drafter(ReTraceConfig(**common, block_size=4), target)
    assert kept.config.block_size == 8
    assert reblocked.config.block_size == 4 and reblocked.anchor_broadcast.block_size == 4
    for (name, a), (_, b) in zip(kept.state_dict().items(), reblocked.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_errors(target, tmp_path):
    with pytest.raises(ValueError, match="drafter_init must be one of"):
        ReTraceConfig(output_dir=str(tmp_path), use_cpu=True, drafter_init="pretrained")
    for fresh_only in (dict(drafter_init="target"), dict(drafter_anchor_broadcast=True)):
        with pytest.raises(ValueError, match="configure a FRESH drafter"):
            ReTraceConfig(output_dir=str(tmp_path), use_cpu=True, drafter_name_or_path="some/folder", **fresh_only)
    deep = ReTraceDrafterModel.from_target(target, num_hidden_layers=5, target_layer_ids=[1], block_size=4)
    with pytest.raises(ValueError, match="at least as many decoder layers"):
        init_drafter_from_target(deep, target)


def _assert_drafts_as_before(target, trained, changed, folder):
    """`changed`, saved to `folder` and loaded back, drafts exactly what `trained` did: same acceptance lengths on every
    prompt, and output stays the target's."""
    from conftest import random_prompt

    changed.save_pretrained(folder)
    reloaded = ReTraceDrafterModel.from_pretrained(folder, dtype=torch.float32).eval()
    for i in range(6):
        prompt = random_prompt(3 + i, seed=i)
        runs = []
        for model in (trained, reloaded):
            out = target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=24, assistant_model=model)
            runs.append((out.tolist(), model.last_generation_stats.acceptance_lengths))
        assert runs[0] == runs[1], f"prompt {i}: {folder.name} drafts differently"
        assert runs[0][0] == target.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=24).tolist()


def test_grown_drafter_drafts_exactly_what_the_trained_one_did(tmp_path):
    """Depth growth is function-preserving through save/load and the inference path (context cache, per-layer
    index): the grown drafter's acceptance lengths equal the original's on every prompt, output stays the target's,
    and the new layers still receive gradient."""
    from conftest import make_drafter, make_target

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="off")
    drafter.save_pretrained(tmp_path / "trained")
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", drafter_name_or_path=str(tmp_path / "trained"))
    grown = init_drafter(ReTraceConfig(**common, drafter_grow_layers=2), target)
    assert grown.config.num_hidden_layers == 3 and len(grown.config.layer_types) == 3
    assert [layer.self_attn.layer_idx for layer in grown.layers] == [0, 1, 2]
    torch.testing.assert_close(grown.layers[2].mlp.up_proj.weight, drafter.layers[0].mlp.up_proj.weight)
    _assert_drafts_as_before(target, drafter, grown, tmp_path / "grown")
    # zero output projections, yet gradient reaches them (d loss / d o_proj = the attention output)
    noise = torch.randn(1, 4, grown.config.hidden_size)
    context = torch.randn(1, 5, len(grown.config.target_layer_ids) * grown.config.hidden_size)
    grown.train()
    grown(noise, context).last_hidden_state.square().sum().backward()
    assert grown.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert grown.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0


def test_grow_errors(tmp_path):
    with pytest.raises(ValueError, match="no drafter_name_or_path is set"):
        ReTraceConfig(output_dir=str(tmp_path), use_cpu=True, drafter_grow_layers=2)
    with pytest.raises(ValueError, match="drafter_grow_layers must be >= 0"):
        ReTraceConfig(output_dir=str(tmp_path), use_cpu=True, drafter_name_or_path="x", drafter_grow_layers=-1)


def test_drafter_reading_more_target_layers_drafts_exactly_what_the_trained_one_did(tmp_path):
    """A superset of a loaded drafter's target layers (`drafter_target_layer_ids`) adds zero `fc` slices: through
    save/load and generation the drafter drafts as before, output stays the target's, and the new slice gets
    gradient."""
    from conftest import make_drafter, make_target

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="off")
    assert drafter.config.target_layer_ids == [2]
    new = [0, 2, 3]  # a layer in front of the drafter's and one behind it
    drafter.save_pretrained(tmp_path / "trained")
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    common["drafter_name_or_path"] = str(tmp_path / "trained")
    wider = init_drafter(ReTraceConfig(**common, drafter_target_layer_ids=new), target)
    assert wider.config.target_layer_ids == new and wider.fc.weight.shape[1] == len(new) * wider.config.hidden_size
    _assert_drafts_as_before(target, drafter, wider, tmp_path / "wider")
    hidden = wider.config.hidden_size
    wider.train()
    wider(torch.randn(1, 4, hidden), torch.randn(1, 5, len(new) * hidden)).last_hidden_state.square().sum().backward()
    added = new.index(0)
    assert wider.fc.weight.grad[:, added * hidden : (added + 1) * hidden].abs().sum() > 0
    with pytest.raises(ValueError, match="a trained drafter can read more layers, not fewer"):
        init_drafter(ReTraceConfig(**common, drafter_target_layer_ids=[0, 3]), target)

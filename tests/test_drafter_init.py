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

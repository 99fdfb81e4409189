"""`hf_retrace.skinny_gemm`: few-row fp32 linears as a transposed GEMM give linear's result, and keep greedy
speculative decoding lossless when the target and drafter both use them."""

import functools
import logging

import pytest
import torch
from torch import nn

import hf_retrace.skinny_gemm as skinny_gemm
from conftest import assert_greedy_matches, make_drafter, make_target, random_prompt
from hf_retrace.skinny_gemm import (
    disable_skinny_gemm,
    enable_skinny_gemm,
    enable_skinny_gemm_where_it_pays,
    skinny_gemm_skip_reason,
    skinny_linear,
)


needs_packing = pytest.mark.skipif(not skinny_gemm.packing_available(), reason="this torch build has no MKL packing")


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (3, 24), (1, 5, 24), (2, 32, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_equals_linear(shape, with_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(40, 24)
    bias = torch.randn(40) if with_bias else None
    out = skinny_linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    torch.testing.assert_close(out, nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_skinny_linear_reads_strided_inputs():
    torch.manual_seed(0)
    x, weight = torch.randn(1, 24, 6).transpose(1, 2), torch.randn(40, 24)  # [1, 6, 24], not contiguous
    torch.testing.assert_close(skinny_linear(x, weight), nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x, weight, max_rows",
    [
        (torch.randn(1, 9, 24), torch.randn(40, 24), 8),  # more rows than max_rows (a prefill)
        (torch.randn(1, 3, 24, dtype=torch.bfloat16), torch.randn(40, 24, dtype=torch.bfloat16), 8),  # not fp32
        (torch.randn(1, 3, 24), torch.randn(24, 40).t(), 8),  # a transposed weight view
    ],
)
def test_other_inputs_take_linear_unchanged(x, weight, max_rows):
    assert torch.equal(skinny_linear(x, weight, max_rows=max_rows), nn.functional.linear(x, weight))


def test_enable_routes_plain_linears_and_disable_restores_them(monkeypatch):
    target = make_target("llama")
    plain = sum(type(m) is nn.Linear for m in target.modules())
    calls = []
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *args: calls.append(args[0].shape) or "routed")
    assert enable_skinny_gemm(target, max_rows=4) == plain > 0
    assert target.lm_head(torch.randn(1, 2, 32)) == "routed" and calls == [(1, 2, 32)]
    assert disable_skinny_gemm(target) == plain
    assert disable_skinny_gemm(target) == 0
    assert isinstance(target.lm_head(torch.randn(1, 2, 32)), torch.Tensor) and len(calls) == 1


def _linear_state(model: nn.Module) -> list:
    """Every module's name, type and instance attributes (`forward` there if something set one)."""
    return [(name, type(m), sorted(m.__dict__), m.__dict__.get("forward")) for name, m in model.named_modules()]


@pytest.mark.parametrize("tune_rows", [0, 4])
def test_disable_restores_the_model_exactly(tune_rows):
    """`disable_skinny_gemm` is `enable_skinny_gemm`'s inverse: the same modules, attributes and forwards, and the
    same logits bit for bit."""
    target = make_target("llama")
    prompt = random_prompt(3, seed=0)
    with torch.no_grad():
        before_logits = target(prompt).logits
    before_state, before_weights = _linear_state(target), {k: v.clone() for k, v in target.state_dict().items()}
    assert enable_skinny_gemm(target, max_rows=8, tune_rows=tune_rows) > 0
    assert _linear_state(target) != before_state
    assert disable_skinny_gemm(target) > 0
    assert _linear_state(target) == before_state
    assert all(m.forward.__func__ is nn.Linear.forward for m in target.modules() if type(m) is nn.Linear)
    with torch.no_grad():
        assert torch.equal(target(prompt).logits, before_logits)
    assert all(torch.equal(v, before_weights[k]) for k, v in target.state_dict().items())


def test_a_forward_set_by_someone_else_is_kept():
    """A linear whose `forward` something else replaced (accelerate's device hooks do) is not routed, so disabling
    leaves that forward in place instead of deleting it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    hooked = model[1].forward = functools.partial(nn.Linear.forward, model[1])
    assert enable_skinny_gemm(model) == 1 and enable_skinny_gemm(model) == 1  # re-enabling re-routes its own
    assert model[1].forward is hooked and disable_skinny_gemm(model) == 1
    assert "forward" not in model[0].__dict__ and model[1].forward is hooked


def test_where_it_pays_skips_bf16_and_notes_why(caplog):
    fp32, bf16 = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="hf_retrace.skinny_gemm"):
        assert enable_skinny_gemm_where_it_pays(bf16, tune_rows=0, name="target") == 0
    assert "forward" not in bf16[0].__dict__
    assert "skinny GEMM skipped for the target" in caplog.text and "torch.bfloat16 on cpu" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_retrace.skinny_gemm"):
        assert enable_skinny_gemm_where_it_pays(fp32, tune_rows=0) == 1
    assert caplog.text == "" and skinny_gemm_skip_reason(fp32) is None


def test_subclassed_linears_are_left_alone():
    class LoraLikeLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), LoraLikeLinear(4, 4))
    assert enable_skinny_gemm(model) == 1
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__


@pytest.mark.parametrize("max_rows", [0, -3, 2.5, None])
def test_bad_max_rows_is_a_clear_error(max_rows):
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        enable_skinny_gemm(nn.Linear(4, 4), max_rows=max_rows)


@pytest.mark.parametrize("rows, widths", [(3, [0, 2, 2, 4, 4]), (1, [0, 4]), (2, [0, 4, 2]), (5, [0, 4, 4, 4, 4])])
def test_padded_widths_give_linear_result(rows, widths):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(1, rows, 24), torch.randn(40, 24), torch.randn(40)
    out = skinny_linear(x, weight, bias, widths=widths)  # 5 rows: beyond the list, not padded
    assert out.shape == (1, rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_padding_reaches_the_gemm(monkeypatch):
    widths_seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: widths_seen.append(b.shape[1]) or mm(a, b))
    weight = torch.randn(40, 24)
    for rows in (1, 2, 3):
        skinny_linear(torch.randn(rows, 24), weight, widths=[0, 4, 2, 4])
    skinny_linear(torch.randn(1, 24), weight)  # untuned: one row padded to two
    assert widths_seen == [4, 2, 4, 2]


def test_tuned_widths_pick_the_cheapest_width_at_or_above(monkeypatch):
    costs = [0.0, 5.0, 2.0, 3.0, 1.0, 4.0, 4.05]  # seconds per width 1..6
    stock = [0.0] + [9.0] * 6  # torch's own linear slower at every count: never taken

    def fake_costs(weights, max_rows, repeats, stock_kernel=False):
        return (stock if stock_kernel else costs)[: max_rows + 1]

    monkeypatch.setattr(skinny_gemm, "width_costs", lambda w, r, n, stock=False: fake_costs(w, r, n, stock))
    # 1-3 pad to 4, the cheapest; 5 and 6 keep their own width (nothing above them is cheaper by over 3%)
    assert skinny_gemm.tune_widths([], 6) == [0, 4, 4, 4, 4, 5, 6]
    assert skinny_gemm.tune_widths([], 3) == [0, 2, 2, 3]
    # an AVX-512 host: torch's linear is cheapest for 1 and 2 rows, within 3% for 5, dearer for 3, 4 and 6
    stock[1:] = [0.5, 0.9, 1.5, 1.2, 4.1, 4.2]
    assert skinny_gemm.tune_widths([], 6) == [0, 0, 0, 4, 4, 0, 6]


def test_a_zero_width_runs_torch_linear(monkeypatch):
    calls, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(b.shape[1]) or mm(a, b))
    x, weight, bias = torch.randn(1, 3, 24), torch.randn(40, 24), torch.randn(40)
    out = skinny_linear(x, weight, bias, widths=[0, 0, 2, 0, 4])  # 3 rows: torch's own kernel
    assert calls == [] and torch.equal(out, nn.functional.linear(x, weight, bias))
    skinny_linear(torch.randn(2, 24), weight, widths=[0, 0, 2, 0, 4])
    assert calls == [2]


def test_width_costs_time_every_width_and_keep_the_best_repeat(monkeypatch):
    """A fake clock that a product advances by its size (`width * out * in`), plus 1000 on each width's first
    repeat (a cold cache): the cost of width `w` is exactly one pass over all weights at `w`, the best repeat."""
    clock, seen, mm = [0.0], [], torch.mm

    def timed_mm(a, b):
        seen.append((tuple(a.shape), tuple(b.shape)))
        clock[0] += b.shape[1] * a.numel() + (1000 if len(seen) % 4 == 1 else 0)  # 2 weights x 2 repeats a width
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", timed_mm)
    monkeypatch.setattr(skinny_gemm.time, "perf_counter", lambda: clock[0])
    weights = [torch.randn(64, 24), torch.randn(24, 64)]
    cost = skinny_gemm.width_costs(weights, 5, repeats=2)
    assert cost == [0.0] + [float(w * (64 * 24 + 24 * 64)) for w in range(1, 6)]
    assert seen[:4] == [((64, 24), (24, 1)), ((24, 64), (64, 1))] * 2 and seen[-1] == ((24, 64), (64, 5))


def test_width_costs_of_torch_linear_time_that_kernel(monkeypatch):
    seen, linear = [], nn.functional.linear
    monkeypatch.setattr(torch, "mm", lambda a, b: pytest.fail("the stock pass ran the transposed GEMM"))
    monkeypatch.setattr(nn.functional, "linear",
                        lambda x, w: seen.append((tuple(x.shape), tuple(w.shape))) or linear(x, w))  # fmt: skip
    cost = skinny_gemm.width_costs([torch.randn(64, 24)], 3, repeats=1, stock=True)
    assert len(cost) == 4 and cost[0] == 0.0 and all(c > 0 for c in cost[1:])
    assert seen == [((1, 24), (64, 24)), ((2, 24), (64, 24)), ((3, 24), (64, 24))]


def test_tune_widths_on_real_weights_gives_valid_widths():
    widths = skinny_gemm.tune_widths([torch.randn(64, 24)], 5, repeats=1)
    assert len(widths) == 6 and widths[0] == 0 and all(w == 0 or r <= w <= 5 for r, w in enumerate(widths) if r)


def test_enable_with_tuning_hands_the_widths_to_every_linear(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "tune_widths", lambda weights, rows, pack: [0, 2, 2, 4, 4][: rows + 1])
    target = make_target("llama")
    enable_skinny_gemm(target, max_rows=8, tune_rows=4)
    forwards = [m.forward for m in target.modules() if type(m) is nn.Linear]
    assert forwards and all(f.args[2] == [0, 2, 2, 4, 4] for f in forwards)
    with pytest.raises(ValueError, match="tune_rows must be an int in"):
        enable_skinny_gemm(target, max_rows=8, tune_rows=9)


def test_packed_widths_take_the_counts_a_pack_saves_most_on():
    cost = [0.0] + [3.0] * 8  # transposed: 3 s at every width
    stock = [0.0, 1.0, 1.1, 1.2, 5.0, 5.0, 5.0, 6.0, 6.0]  # torch's linear: cheap for 1-3 rows only
    # a pack for 4 rows saves 2 x 1 s at 4; one for 8 saves 5 x 1 s at 4-8 (1-3 stay on torch's linear)
    assert skinny_gemm.cheapest_widths(cost, 0.03, stock, {4: 2.0, 8: 2.0}) == [0, 0, 0, 0, -8, -8, -8, -8, -8]
    assert skinny_gemm.cheapest_widths(cost, 0.03, stock, {8: 2.95}) == [0, 0, 0, 0, 4, 5, 6, 7, 8]  # within 3%


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_packed_gemm_gives_linear_result_and_a_stale_pack_is_not_used(rows):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    enable_skinny_gemm(layer)
    layer.forward = functools.partial(skinny_gemm._skinny_forward, layer, 64, [0] + [-8] * 8)
    layer._skinny_packed = skinny_gemm.PackedWeight(layer.weight, 8)
    x = torch.randn(1, rows, 24)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(2.0)  # an in-place update (an optimizer step, load_state_dict): the pack is stale
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    out = layer(x)  # a gradient to track: torch's linear, which has one
    assert out.requires_grad and torch.equal(out, nn.functional.linear(x, layer.weight, layer.bias))


@needs_packing
def test_enable_packs_only_when_tuning_picks_the_packed_kernel_and_disable_drops_it(monkeypatch):
    target = make_target("llama")
    monkeypatch.setattr(skinny_gemm, "tune_widths", lambda weights, rows, pack: [0, 0, 0, -4, -4][: rows + 1])
    enable_skinny_gemm(target, max_rows=8, tune_rows=4)
    linears = [m for m in target.modules() if type(m) is nn.Linear]
    assert all(m._skinny_packed.width == 4 for m in linears)
    monkeypatch.setattr(skinny_gemm, "tune_widths", lambda weights, rows, pack: [0, 0, 2, 4, 4][: rows + 1])
    enable_skinny_gemm(target, max_rows=8, tune_rows=4)  # re-tuned without the packed kernel: packs dropped
    assert not any("_skinny_packed" in m.__dict__ for m in linears)
    monkeypatch.setattr(skinny_gemm, "tune_widths", lambda weights, rows, pack: [0, 0, 0, -4, -4][: rows + 1])
    enable_skinny_gemm(target, max_rows=8, tune_rows=4)
    assert disable_skinny_gemm(target) == len(linears)
    assert not any("_skinny_packed" in m.__dict__ or "forward" in m.__dict__ for m in linears)


@needs_packing
def test_packed_cost_times_a_pass_at_its_width():
    assert skinny_gemm.packed_cost([torch.randn(64, 24), torch.randn(24, 64)], 8, repeats=1) > 0


@needs_packing
def test_greedy_stays_lossless_with_packed_verification(monkeypatch):
    """Verification forwards of 2-5 rows through MKL's packed GEMM, target-only steps through torch's linear."""
    monkeypatch.setattr(skinny_gemm, "tune_widths", lambda weights, rows, pack: [0, 0, -5, -5, -5, -5, 6, 7, 8])
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode="corrected")
    stock = [target.generate(random_prompt(5, seed=i), do_sample=False, max_new_tokens=24) for i in range(4)]
    enable_skinny_gemm(target, tune_rows=8), enable_skinny_gemm(drafter, tune_rows=8)
    assert all(m._skinny_packed.width == 5 for m in target.modules() if type(m) is nn.Linear)
    packed_rows, mkl_linear = [], torch.ops.mkl._mkl_linear
    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear",
                        lambda x, *args: packed_rows.append(len(x)) or mkl_linear(x, *args))  # fmt: skip
    assert_greedy_matches(target, drafter, stock, "packed")
    assert packed_rows and set(packed_rows) == {5}  # the packed kernel ran, at its width


@pytest.mark.parametrize("mode, tune_rows", [("off", 0), ("corrected", 0), ("corrected", 8)])
def test_greedy_stays_lossless_with_skinny_gemm(mode, tune_rows):
    """Verification forwards (B rows) and target-only steps (1 row, padded) both take the transposed GEMM."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, mode=mode)
    stock = [target.generate(random_prompt(5, seed=i), do_sample=False, max_new_tokens=24) for i in range(4)]
    enable_skinny_gemm(target, tune_rows=tune_rows), enable_skinny_gemm(drafter, tune_rows=tune_rows)
    accepted = []
    for i, expected in enumerate(stock):
        prompt = random_prompt(5, seed=i)
        assert target.generate(prompt, do_sample=False, max_new_tokens=24).tolist() == expected.tolist()
        got = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert got.tolist() == expected.tolist(), f"{mode}: speculative output differs on prompt {i}"
        accepted += drafter.last_generation_stats.acceptance_lengths
    assert max(accepted) > 1, "no draft was ever accepted, so no multi-row verification was checked"

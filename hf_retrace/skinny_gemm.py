"""Skinny GEMMs: fp32 linears over a few rows on a CPU, computed transposed so the weight is streamed once.

When it pays: fp32 weights on a CPU, and forwards over a few rows (1 to a few dozen tokens: decoding steps and the
verification of a drafted block). That is where torch's stock kernel is slow and this one is not; the main command
(`examples/01_generate.py`) and `hf-retrace bench` turn it on by default (`--no-skinny-gemm` turns it off) through
[`enable_skinny_gemm_where_it_pays`], which leaves bf16/fp16 and GPU models alone with a logged note: there the
stock kernels are the fast ones, and a long prefill takes the stock kernel here too.

Why: on a CPU, speculative decoding pays only if a forward over the few tokens of a verified block costs little more
than a forward over one token: both read every weight once, and a decoding step of a small model is bound by that
read. torch's fp32 CPU BLAS (MKL) does not deliver this for `linear(x, W) = x @ W.T` with `x` of 2-16 rows: on the
2-core AVX2 machine of this repo, SmolLM2-135M's linears take 1.5x as long for 2 rows and 1.7x for 4 rows as for
one. The same product computed transposed, `(W @ x.T).T` (`torch.mm(weight, x.t())`, with the weight as the wide
left operand and `x` as a transposed right operand), streams the weight at full speed for any few rows: 4 rows cost
what 2 do, and both less than one row through MKL's matrix-vector product. One row is therefore duplicated into two
(the study is listed in docs/findings.md).

`enable_skinny_gemm(model)` routes every `nn.Linear` of a model through `skinny_linear`, for inputs of at most
`max_rows` rows in fp32 on a CPU; anything else (prefill of long prompts, bf16, CUDA, subclasses such as quantized
linears, linears whose `forward` something else already replaced, such as accelerate's hooks) keeps its forward.
`disable_skinny_gemm(model)` undoes it exactly: the same modules with their class `forward` again, so the same outputs
bit for bit. The result equals `linear`'s up to fp32 summation order, like any change of BLAS kernel. Speedups are
only meaningful when the target-only baseline runs with the same setting, which the bench and
`examples/01_generate.py` do: both run the very same patched target.

The BLAS kernel behind the transposed product is itself uneven in the row count: on the repo's machine 3 rows cost
more than 4, and 13-15 rows more than 16 (docs/findings.md). So `enable_skinny_gemm` times a
pass over the model's own weights at every width up to `tune_rows` and zero-pads each row count to the cheapest
width at or above it ([`tune_widths`]); the padded rows' outputs are dropped.

Which kernel wins depends on the CPU. On an AVX-512 host torch's own `linear` is the fast one for 1 to 3 rows
(SmolLM2-135M's linears: 21-24 ms a pass, against 22-44 ms transposed) and the slow one from 4 rows on (48-100 ms
against ~44 ms; `benchmarks/verification_rows.py`). So the tuning also times torch's `linear` at each row count and
keeps it where it is cheapest (`widths[r] = 0`).

A third kernel is MKL's packed GEMM, the one torch's inductor uses for frozen fp32 CPU linears
(`torch.ops.mkl._mkl_reorder_linear_weight` packs a weight once for `P` rows, `torch.ops.mkl._mkl_linear` runs it).
On the AVX-512 host a pass packed for 8, 12 or 16 rows costs 27, 31 or 35 ms, against ~44 ms transposed and
48-100 ms through `linear`. The tuning times it at a few pack widths and, where it is the cheapest, pads those row
counts to the chosen `P` (`widths[r] = -P`); the packed copies cost about twice the weights' memory, so models whose
routed weights exceed `PACK_MAX_BYTES` are not packed. A packed copy is used only while its weight is unchanged
(the weight's in-place version counter, which `optimizer.step()` and `load_state_dict` advance) and no gradient is
needed; otherwise torch's `linear` runs.
"""

import functools
import time

import torch
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)


DEFAULT_MAX_ROWS = 64
PACK_WIDTHS = (8, 12, 16, 24)  # the pack widths `P` the tuning tries (at most its `tune_rows`)
PACK_MAX_BYTES = 2**30  # routed fp32 weights above this are not packed (the packed copies take about twice as much)
# what `hf-retrace bench` and `examples/01_generate.py` tune: every verification forward of the shipped
# setting (4 tokens) and the drafter's block of 16 with its few context rows
DEFAULT_TUNE_ROWS = 24


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    max_rows: int = DEFAULT_MAX_ROWS,
    widths: list[int] | None = None,
    packed: "PackedWeight | None" = None,
) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)`, as a transposed GEMM when `x` has 1..`max_rows` rows.

    Args:
        x: `[..., in_features]`.
        weight: `[out_features, in_features]`, contiguous (as `nn.Linear` keeps it).
        bias: `[out_features]` or `None`.
        max_rows: most rows sent to the transposed GEMM.
        widths: `widths[r] >= r` is the GEMM width that `r` rows are zero-padded to, or `0` where torch's own
            `linear` is the cheaper kernel for `r` rows, or `-P` where MKL's packed GEMM is (the rows zero-padded
            to `P`, `packed` the weight packed for `P` rows) ([`tune_widths`]); counts beyond the list are not
            padded. `None`: one row is padded to two, other counts are not.
        packed: `weight` packed by [`PackedWeight`]; without it (or once `weight` changed) `-P` runs torch's `linear`.

    Returns:
        `[..., out_features]`, contiguous.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    eligible = (
        0 < rows <= max_rows
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
    )
    if not eligible:
        return nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # [rows, in]
    if widths is None:  # one row: MKL's matrix-vector product is slower than this GEMM over two rows
        width = max(rows, 2)
    else:
        width = widths[rows] if rows < len(widths) else rows
        if width == 0:  # torch's own kernel is the cheaper one for this many rows on this host
            return nn.functional.linear(x, weight, bias)
        if width < 0:
            return _packed_linear(x, weight, bias, rows, -width, packed)
    if width > rows:
        flat = nn.functional.pad(flat, (0, 0, 0, width - rows))  # [width, in]: zero rows after the real ones
    # [out, in] @ [in, width] with the right operand a transposed view: the kernel that streams the weight.
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # [rows, out]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _packed_linear(x, weight, bias, rows: int, width: int, packed: "PackedWeight | None") -> torch.Tensor:
    """`linear(x, weight, bias)` through MKL's packed GEMM, the `rows` rows zero-padded to the pack's `width`; torch's
    `linear` when there is no usable pack (none, another width, a changed weight, or a gradient to track)."""
    usable = (
        packed is not None and packed.width == width >= rows and packed.version == weight._version
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    )  # fmt: skip
    if not usable:
        return nn.functional.linear(x, weight, bias)
    flat = nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, width - rows))  # [width, in]
    out = torch.ops.mkl._mkl_linear(flat, packed.data, weight, bias, width)[:rows]  # [rows, out]
    return out.view(*x.shape[:-1], weight.shape[0])


class PackedWeight:
    """A weight packed by MKL for `width` rows (`data`, an opaque MKL-DNN tensor), and the weight's in-place version
    counter when it was packed: a later in-place change of the weight makes the pack stale."""

    def __init__(self, weight: torch.Tensor, width: int):
        with torch.no_grad():
            self.data = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), width)
        self.width, self.version = width, weight._version


def packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM ops (x86 CPU wheels do)."""
    try:
        PackedWeight(torch.zeros(8, 8), 2)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _skinny_forward(module: nn.Linear, max_rows: int, widths: list[int] | None, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, module.weight, module.bias, max_rows, widths, module.__dict__.get("_skinny_packed"))


def _is_routed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _skinny_forward


def enable_skinny_gemm(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS, tune_rows: int = 0) -> int:
    """Routes every plain `nn.Linear` of `model` through `skinny_linear` (an instance-level `forward`).

    Args:
        model: any module; its plain `nn.Linear`s are routed (exact type: quantized or LoRA subclasses have their own
            forward). A linear whose `forward` was already replaced by something else (accelerate's device hooks)
            is left alone, so [`disable_skinny_gemm`] can restore every routed one to its class `forward`. Calling it
            again re-routes the already routed linears with the new settings.
        max_rows: most rows sent to the transposed GEMM.
        tune_rows: with `tune_rows > 0`, row counts up to it take the kernel and width [`tune_widths`] measures on
            the model's fp32 CPU weights (a few seconds for a 135M model at 24 rows), their weights packed when it
            picks MKL's packed GEMM; `0` pads one row to two only.
    Returns:
        How many linears were routed (0 for a model without plain `nn.Linear`s).
    """
    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int (most rows sent to the transposed GEMM), got {max_rows!r}")
    if not isinstance(tune_rows, int) or not 0 <= tune_rows <= max_rows:
        raise ValueError(f"tune_rows must be an int in [0, max_rows={max_rows}] (0: no tuning), got {tune_rows!r}")
    linears = [
        module for module in model.modules()
        if type(module) is nn.Linear and ("forward" not in module.__dict__ or _is_routed(module))
    ]  # fmt: skip
    weights = [m.weight for m in linears if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    pack = sum(w.numel() * 4 for w in weights) <= PACK_MAX_BYTES and packing_available()
    widths = tune_widths(weights, tune_rows, pack=pack) if tune_rows and weights else None
    pack_width = -min(widths) if widths and min(widths) < 0 else 0
    for module in linears:
        module.__dict__.pop("_skinny_packed", None)
        if pack_width and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module._skinny_packed = PackedWeight(module.weight, pack_width)  # a plain attribute: not in state_dict
        module.forward = functools.partial(_skinny_forward, module, max_rows, widths)
    return len(linears)


def skinny_gemm_skip_reason(model: nn.Module) -> str | None:
    """Why the skinny GEMM would not pay for `model` (`None`: it would): it speeds up fp32 linears on a CPU only."""
    kinds = {(p.device.type, p.dtype) for p in model.parameters()}
    others = sorted(f"{dtype} on {device}" for device, dtype in kinds if (device, dtype) != ("cpu", torch.float32))
    if not kinds or others:
        return f"it pays for fp32 on CPU only, and the model is {', '.join(others) or 'empty'}"
    return None


def enable_skinny_gemm_where_it_pays(model: nn.Module, tune_rows: int = DEFAULT_TUNE_ROWS, name: str = "model") -> int:
    """[`enable_skinny_gemm`] for an fp32 CPU model; any other model (bf16, fp16, GPU) is left untouched and the
    reason is logged: there the stock kernels are the fast ones. The default of the main command and the bench.

    Args:
        model: the target or a drafter.
        tune_rows: as in [`enable_skinny_gemm`]; [`DEFAULT_TUNE_ROWS`] covers the shipped setting.
        name: what the note calls the model (`"target"`, a method's name).
    Returns:
        How many linears were routed (0 when skipped).
    """
    reason = skinny_gemm_skip_reason(model)
    if reason is not None:
        logger.warning(f"skinny GEMM skipped for the {name}: {reason} (pass --no-skinny-gemm to silence this)")
        return 0
    return enable_skinny_gemm(model, tune_rows=tune_rows)


@torch.no_grad()
def tune_widths(weights: list[torch.Tensor], max_rows: int, repeats: int = 2, margin: float = 0.03,
                pack: bool = False) -> list[int]:  # fmt: skip
    """The kernel of each row count `0..max_rows`: the transposed GEMM at the cheapest measured width at or above
    it, or torch's own `linear` (`0`) where that is cheaper still.

    A count keeps its own width unless a larger one is cheaper by more than `margin`, so timing noise rarely pads;
    torch's `linear` is kept unless the transposed GEMM is cheaper by more than `margin`. With `pack`, MKL's packed
    GEMM at one pack width `P` (of [`PACK_WIDTHS`] up to `max_rows`) takes the counts up to `P` where it is cheaper
    than both by more than `margin`. Padding or a change of kernel changes the real rows' products by fp32 summation
    order at most, like any change of BLAS kernel.

    Args:
        weights: the `[out, in]` fp32 CPU weights of the linears to be routed.
    Returns:
        `widths`, `max_rows + 1` ints with `widths[r] >= r`, `0` (torch's `linear`) or `-P` (`widths[0] = 0`).
    """
    transposed = width_costs(weights, max_rows, repeats)
    stock = width_costs(weights, max_rows, repeats, stock=True)
    packed = {w: packed_cost(weights, w, repeats) for w in PACK_WIDTHS if w <= max_rows} if pack else None
    return cheapest_widths(transposed, margin, stock, packed)


def cheapest_widths(cost: list[float], margin: float = 0.03, stock_cost: list[float] | None = None,
                    packed_cost: dict[int, float] | None = None) -> list[int]:  # fmt: skip
    """`widths[r]`: the cheapest width at or above `r` by `cost` (`cost[w]`, seconds at width `w`, `cost[0]` unused),
    keeping `r` itself unless a larger width is cheaper by more than `margin`; then `0` (torch's `linear`) where
    `stock_cost[r]`, its seconds for `r` rows, is not above that width's by more than `margin`; then `-P` for the
    counts up to `P` where `packed_cost[P]` (seconds of a pass packed for `P` rows) is cheaper still by more than
    `margin`, `P` the pack width that saves the most seconds over all counts, count `r` weighted `1 / r` (one pack a
    model, for memory; verification lengths fall off with acceptance, so a few rows are the common case)."""
    max_rows = len(cost) - 1
    widths, seconds, cheapest = [0] * (max_rows + 1), [0.0] * (max_rows + 1), max_rows
    for rows in range(max_rows, 0, -1):  # `cheapest`: the best width in rows .. max_rows
        if cost[rows] <= cost[cheapest] * (1 + margin):
            cheapest = rows
        widths[rows], seconds[rows] = cheapest, cost[cheapest]
        if stock_cost is not None and stock_cost[rows] <= cost[cheapest] * (1 + margin):
            widths[rows], seconds[rows] = 0, stock_cost[rows]

    def saved(width: int) -> float:  # seconds the pack of `width` saves over the counts it would take, weighted
        counts = range(1, min(width, max_rows) + 1)
        return sum(max(seconds[r] - packed_cost[width] * (1 + margin), 0.0) / r for r in counts)

    best = max(packed_cost or {}, key=saved, default=None)
    if best is not None and saved(best) > 0:
        for rows in range(1, min(best, max_rows) + 1):
            if packed_cost[best] * (1 + margin) < seconds[rows]:
                widths[rows] = -best
    return widths


@torch.no_grad()
def width_costs(weights: list[torch.Tensor], max_rows: int, repeats: int = 2, stock: bool = False) -> list[float]:
    """Seconds of one pass of transposed products over all `weights`, in order, at every width `1..max_rows` (best
    of `repeats`; `[0]` is 0); with `stock`, of torch's own `linear` over that many rows instead. One pass reads every
    weight once, as a forward does, so caches are as cold as there."""
    inputs = {weight.shape[1]: torch.zeros(max_rows, weight.shape[1]) for weight in weights}

    def one_pass(width: int) -> None:
        for weight in weights:
            if stock:
                nn.functional.linear(inputs[weight.shape[1]][:width], weight)
            else:
                torch.mm(weight, inputs[weight.shape[1]][:width].t())

    return [0.0] + [_best_seconds(lambda: one_pass(width), repeats) for width in range(1, max_rows + 1)]


def _best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run()`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def packed_cost(weights: list[torch.Tensor], width: int, repeats: int = 2) -> float:
    """Seconds of one pass of MKL's packed GEMM over all `weights` at `width` rows (packed for `width`; best of
    `repeats`). The packs are dropped after."""
    packs = [PackedWeight(weight, width) for weight in weights]
    inputs = {weight.shape[1]: torch.zeros(width, weight.shape[1]) for weight in weights}

    def one_pass() -> None:
        for weight, pack in zip(weights, packs):
            torch.ops.mkl._mkl_linear(inputs[weight.shape[1]], pack.data, weight, None, width)

    return _best_seconds(one_pass, repeats)


def disable_skinny_gemm(model: nn.Module) -> int:
    """Undoes [`enable_skinny_gemm`] exactly: each routed linear loses its instance-level `forward`, so it runs
    `nn.Linear.forward` again and `model` is the model it was before (same modules, attributes and outputs, bit for
    bit). Linears it did not route are untouched. Returns how many were restored."""
    routed = [module for module in model.modules() if _is_routed(module)]
    for module in routed:
        del module.forward
        module.__dict__.pop("_skinny_packed", None)
    return len(routed)

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
"""

import functools
import time

import torch
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)


DEFAULT_MAX_ROWS = 64
# what `hf-retrace bench` and `examples/01_generate.py` tune: every verification forward of the shipped
# setting (4 tokens) and the drafter's block of 16 with its few context rows
DEFAULT_TUNE_ROWS = 24


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    max_rows: int = DEFAULT_MAX_ROWS,
    widths: list[int] | None = None,
) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)`, as a transposed GEMM when `x` has 1..`max_rows` rows.

    Args:
        x: `[..., in_features]`.
        weight: `[out_features, in_features]`, contiguous (as `nn.Linear` keeps it).
        bias: `[out_features]` or `None`.
        max_rows: most rows sent to the transposed GEMM.
        widths: `widths[r] >= r` is the GEMM width that `r` rows are zero-padded to ([`tune_widths`]); counts
            beyond the list are not padded. `None`: one row is padded to two, other counts are not.

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
    if width > rows:
        flat = nn.functional.pad(flat, (0, 0, 0, width - rows))  # [width, in]: zero rows after the real ones
    # [out, in] @ [in, width] with the right operand a transposed view: the kernel that streams the weight.
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # [rows, out]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _skinny_forward(module: nn.Linear, max_rows: int, widths: list[int] | None, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, module.weight, module.bias, max_rows, widths)


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
        tune_rows: with `tune_rows > 0`, row counts up to it are padded to the widths [`tune_widths`] measures on
            the model's fp32 CPU weights (a few seconds for a 135M model at 24 rows); `0` pads one row to two only.
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
    widths = tune_widths(weights, tune_rows) if tune_rows and weights else None
    for module in linears:
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
def tune_widths(weights: list[torch.Tensor], max_rows: int, repeats: int = 2, margin: float = 0.03) -> list[int]:
    """The GEMM width each row count `0..max_rows` is padded to: the cheapest measured width at or above it.

    A count keeps its own width unless a larger one is cheaper by more than `margin`, so timing noise rarely pads.
    Padding changes the real rows' products by fp32 summation order at most, like any change of BLAS kernel.

    Args:
        weights: the `[out, in]` fp32 CPU weights of the linears to be routed.
    Returns:
        `widths`, `max_rows + 1` ints with `widths[r] >= r` (`widths[0] = 0`).
    """
    return cheapest_widths(width_costs(weights, max_rows, repeats), margin)


def cheapest_widths(cost: list[float], margin: float = 0.03) -> list[int]:
    """`widths[r]`: the cheapest width at or above `r` by `cost` (`cost[w]`, seconds at width `w`, `cost[0]` unused),
    keeping `r` itself unless a larger width is cheaper by more than `margin`."""
    max_rows = len(cost) - 1
    widths, cheapest = [0] * (max_rows + 1), max_rows
    for rows in range(max_rows, 0, -1):  # `cheapest`: the best width in rows .. max_rows
        if cost[rows] <= cost[cheapest] * (1 + margin):
            cheapest = rows
        widths[rows] = cheapest
    return widths


@torch.no_grad()
def width_costs(weights: list[torch.Tensor], max_rows: int, repeats: int = 2) -> list[float]:
    """Seconds of one pass of transposed products over all `weights`, in order, at every width `1..max_rows` (best
    of `repeats`; `[0]` is 0). One pass reads every weight once, as a forward does, so caches are as cold as there."""
    inputs = {weight.shape[1]: torch.zeros(max_rows, weight.shape[1]) for weight in weights}
    cost = [0.0] * (max_rows + 1)
    for width in range(1, max_rows + 1):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for weight in weights:
                torch.mm(weight, inputs[weight.shape[1]][:width].t())
            best = min(best, time.perf_counter() - start)
        cost[width] = best
    return cost


def disable_skinny_gemm(model: nn.Module) -> int:
    """Undoes [`enable_skinny_gemm`] exactly: each routed linear loses its instance-level `forward`, so it runs
    `nn.Linear.forward` again and `model` is the model it was before (same modules, attributes and outputs, bit for
    bit). Linears it did not route are untouched. Returns how many were restored."""
    routed = [module for module in model.modules() if _is_routed(module)]
    for module in routed:
        del module.forward
    return len(routed)

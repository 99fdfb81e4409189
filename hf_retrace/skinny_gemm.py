"""Skinny GEMMs: fp32 linears over a few rows on a CPU, computed transposed so the weight is streamed once.

On a CPU, speculative decoding pays only if a forward over the few tokens of a verified block costs little more
than a forward over one token: both read every weight once, and a decoding step of a small model is bound by that
read. torch's fp32 CPU BLAS (MKL) does not deliver this for `linear(x, W) = x @ W.T` with `x` of 2-16 rows: on the
2-core AVX2 machine of this repo, SmolLM2-135M's linears take 1.5x as long for 2 rows and 1.7x for 4 rows as for
one. The same product computed transposed, `(W @ x.T).T` (`torch.mm(weight, x.t())`, with the weight as the wide
left operand and `x` as a transposed right operand), streams the weight at full speed for any few rows: 4 rows cost
what 2 do, and both less than one row through MKL's matrix-vector product. One row is therefore duplicated into two
(`benchmarks/verification_cost.py --skinny-gemm` prints the effect on the whole target).

`enable_skinny_gemm(model)` routes every `nn.Linear` of a model through `skinny_linear`, for inputs of at most
`max_rows` rows in fp32 on a CPU; anything else (prefill of long prompts, bf16, CUDA, subclasses such as quantized
linears) keeps `nn.Linear.forward`. The result equals `linear`'s up to fp32 summation order, like any change of
BLAS kernel. Speedups are only meaningful when the target-only baseline runs with the same setting, which the
bench and `examples/01_generate.py` do: both run the very same patched target.
"""

import functools

import torch
from torch import nn


DEFAULT_MAX_ROWS = 64


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int = DEFAULT_MAX_ROWS
) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)`, as a transposed GEMM when `x` has 1..`max_rows` rows.

    Args:
        x: `[..., in_features]`.
        weight: `[out_features, in_features]`, contiguous (as `nn.Linear` keeps it).
        bias: `[out_features]` or `None`.

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
    if rows == 1:  # MKL's matrix-vector product is slower than this GEMM over two copies of the row
        flat = torch.cat([flat, flat])
    # [out, in] @ [in, rows or 2] with the right operand a transposed view: the kernel that streams the weight.
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # [rows, out]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _skinny_forward(module: nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, module.weight, module.bias, max_rows)


def enable_skinny_gemm(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Routes every plain `nn.Linear` of `model` through `skinny_linear` (an instance-level `forward`).

    Returns:
        How many linears were routed (0 for a model without plain `nn.Linear`s).
    """
    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int (most rows sent to the transposed GEMM), got {max_rows!r}")
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:  # exact type: quantized or LoRA subclasses have their own forward
            module.forward = functools.partial(_skinny_forward, module, max_rows)
            count += 1
    return count


def disable_skinny_gemm(model: nn.Module) -> int:
    """Undoes `enable_skinny_gemm`: every linear uses `nn.Linear.forward` again. Returns how many were restored."""
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func is _skinny_forward:
            del module.forward
            count += 1
    return count

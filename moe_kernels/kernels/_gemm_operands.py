"""The host side every grouped-GEMM layout shares: its operands checked, its output buffer, its
torch references, and the one workaround for Triton's interpreter.

* :func:`check_operands` - 16/32-bit ``a`` with weights of its dtype, or fp8 with their scales;
  returns the weights' :class:`~moe_kernels.kernels.formats.WeightFormat`.
* :func:`check_out` - a caller's output buffer (dtype, device, contiguity, shape), or a new one.
* :func:`gemm_width` - the output columns (half of ``w``'s rows when SiLU·mul halves them).
* :func:`expert_rows_product` / :func:`dequantized` - the torch references' pieces, in float32.
* :func:`output_dtype` - fp8 GEMMs write bf16 unless asked otherwise.
* :func:`in_float32_under_interpreter` - Triton's interpreter multiplies bf16 ``tl.dot`` operands
  as raw bit patterns (triton issue 11584) and truncates fp32 -> bf16 stores, so a bf16 stage runs
  in float32 there and is rounded once.

For example, ``gemm_width("f", torch.empty(4, 96, 32), silu_mul=True)`` is 48: GEMM 1's 96 rows
are 48 gate rows and 48 up rows, and SiLU·mul leaves one column per pair.
"""

from __future__ import annotations

import torch

from .._checks import FLOAT_DTYPES, check_tensor, fail
from .._runtime import interpreted_bf16
from .formats import WeightFormat
from .quant import FP8


def check_out(func: str, out: object, shape: tuple, like: torch.Tensor, *,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A caller's contiguous output buffer of ``shape`` (checked), or a new one like ``like``."""
    dtype = like.dtype if dtype is None else dtype
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(func, "out", out, dtypes=(dtype,), device=like.device, contiguous=True)
    if tuple(out.shape) != tuple(shape):
        fail(func, "out", f"must have shape {tuple(shape)}", f"shape {tuple(out.shape)}")
    return out


def in_float32_under_interpreter(run, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor | None:
    """Under the interpreter, run a bf16 GEMM stage in float32 and round into ``out`` once.

    ``run(float32_inputs..., out=float32_buffer)`` is the stage itself. Returns ``out`` when it
    did so, None when the inputs need no workaround (the caller then launches as usual).
    """
    if not interpreted_bf16(out, *inputs):
        return None
    wide = out.float()   # rows the stage does not write keep what ``out`` held
    widened = [t.float() if t.dtype == torch.bfloat16 else t for t in inputs]
    run(*widened, out=wide)
    return out.copy_(wide)


def gemm_width(func: str, w: torch.Tensor, silu_mul: bool) -> int:
    """Output columns of a grouped GEMM over ``w [E, N_w, K]``: ``N_w``, or ``N_w/2`` when the
    SiLU·mul epilogue halves it."""
    if not silu_mul:
        return w.shape[1]
    if w.shape[1] % 2:
        fail(func, "w", "must have an even number of rows [gate | up] when silu_mul=True", f"shape {tuple(w.shape)}")
    return w.shape[1] // 2


def expert_rows_product(x_rows: torch.Tensor, w_expert: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    """Torch reference of one expert's tile product, in float32 like the kernels' accumulators."""
    h = x_rows.float() @ w_expert.float().T
    if silu_mul:
        gate, up = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
    return h


def check_operands(func: str, a_name: str, a: object, w_name: str, w: object, a_scale, w_scale) -> WeightFormat:
    """The two GEMM operands: 16/32-bit ``a [rows, K]`` with ``w [E, N, K]`` of its dtype and no
    scales, or both fp8 with their scales. Returns the weights' :class:`WeightFormat`."""
    check_tensor(func, a_name, a, ndim=2, dtypes=FLOAT_DTYPES + (FP8,), last_dim_contiguous=True)
    check_tensor(func, w_name, w, ndim=3, device=a.device, last_dim_contiguous=True)
    if w.dtype == FP8 and a.dtype != FP8:
        fail(func, a_name, f"must be float8_e4m3fn (quantised, with a_scale) to multiply fp8 {w_name}",
             str(a.dtype).replace("torch.", ""), TypeError)
    fmt = WeightFormat.of(func, w_name, w, w_scale, "w_scale")
    if not fmt.quantized:
        check_tensor(func, w_name, w, dtypes=(a.dtype,))
        if a_scale is not None:
            fail(func, "a_scale", f"must be None for {str(a.dtype).replace('torch.', '')} operands (scales belong to "
                 "fp8 ones)", "a tensor")
        return fmt
    rows, k = a.shape
    want = (rows, -(-k // fmt.block[1])) if fmt.activations == "group" else (rows,)
    check_tensor(func, "a_scale", a_scale, dtypes=(torch.float32,), device=a.device)
    if tuple(a_scale.shape) != want or a_scale.stride(-1) != 1:
        fail(func, "a_scale", f"must be a row-major {want} float32 tensor for the {fmt.name} scales of {w_name}",
             f"shape {tuple(a_scale.shape)}")
    return fmt


def output_dtype(a: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """fp8 GEMMs write ``out_dtype`` (bf16 unless asked otherwise); others their input dtype."""
    if a.dtype in FLOAT_DTYPES:
        return a.dtype
    return torch.bfloat16 if out_dtype is None else out_dtype


def dequantized(a: torch.Tensor, w: torch.Tensor, a_scale, w_scale, fmt: WeightFormat):
    """The operands in float32 (for the torch references), or as they are without fp8."""
    return fmt.dequantize_activations(a, a_scale), fmt.dequantize_weight(w, w_scale)

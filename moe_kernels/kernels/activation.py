"""SiLU·mul as a launch of its own: ``out = silu(gate) * up`` from an fp32 ``[rows, 2F]`` buffer.

GEMM 1 normally applies SiLU·mul in its epilogue, which needs each output's whole K sum in one
program. Split over K (``GemmTiles.split_k > 1`` on GEMM 1, index-gather layout), several programs
each add a partial product into an fp32 ``[rows, 2F]`` buffer (gate columns, then up columns),
and this kernel then reads each row once and writes ``[rows, F]`` in the activations' dtype. Why
split GEMM 1 at all: at decode a GEMM 1 of few rows has few tiles (Qwen3-30B-A3B at batch 1:
8 experts x 12 column tiles = 96 programs for the H200's 132 SMs), and a split gives every SM a
share of the weight stream.

The formula is the epilogue's, ``g * sigmoid(g) * u`` in fp32, then one rounding, so the split
GEMM 1 differs from the fused one only in the order of the fp32 additions.

    >>> import torch
    >>> h = torch.tensor([[0.0, 1.0, 2.0, 3.0]])   # F = 2: gate [0, 1], up [2, 3]
    >>> [round(v, 4) for v in silu_mul_reference(h, torch.float32)[0].tolist()]   # [silu(0) * 2, silu(1) * 3]
    [0.0, 2.1932]
"""

from __future__ import annotations

import torch

from .._runtime import HAS_TRITON, cdiv, kernel, note_launch, recording, tl, use_triton

__all__ = ["silu_mul_rows", "silu_mul_reference"]

_BLOCK = 1024   # columns per program: one row's F = 768 (Qwen3) or 2048 (DeepSeek-V3) in 1 or 2 programs

if HAS_TRITON:

    @kernel
    def _silu_mul_kernel(h_ptr, out_ptr, F, stride_h, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        gate = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        up = tl.load(h_ptr + row * stride_h + F + cols, mask=mask, other=0.0)
        y = gate * tl.sigmoid(gate) * up   # (GEMM 1's epilogue, exactly)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_reference(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:]`` in fp32, rounded once to ``dtype``."""
    f = h.shape[1] // 2
    gate, up = h[:, :f].float(), h[:, f:].float()
    return (gate * torch.sigmoid(gate) * up).to(dtype)


def silu_mul_rows(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [rows, F] = silu(h[:, :F]) * h[:, F:]`` for an fp32 ``h [rows, 2F]`` (unchecked: the
    caller, :func:`moe_kernels.kernels.index_gather.gate_up`, made both)."""
    rows, f = out.shape
    if rows == 0 or f == 0:
        return out
    if not use_triton(h, out):
        return out.copy_(silu_mul_reference(h, out.dtype))
    grid = (rows, cdiv(f, _BLOCK))
    if recording():
        note_launch("activation.silu_mul", grid=grid)
    _silu_mul_kernel[grid](h, out, f, h.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out

"""The grouped GEMM of a few tokens an expert (decode) in Gluon, block-fp8 or bf16, computed transposed: its
call, its checks and its torch reference. The kernel is :mod:`moe_kernels.kernels._gluon_transposed`.

``out[r] = x[r] @ w[m_indices[r]]^T`` (dequantised, for fp8) for every real row ``r`` of a packed buffer
whose rows come in segments of ``block_t`` rows, one expert each (:func:`~moe_kernels.kernels.permute.permute`
with ``align = block_t``; ``m_indices`` is -1 on padding rows), below ``rows_used`` (int32 ``[1]`` on the
device: the rows the segments span). A tile is 128 weight rows by ``block_t`` tokens: the weights fill wgmma's
M side, where an expert's handful of tokens could not, and one program per SM streams its tiles' weights
through a ring of TMA loads that runs on across tiles. ``gated`` (GEMM 1, ``w`` of ``2F`` rows, gate then
up): ``silu(gate) * up``, ``[M_pad, F]``. Rows of padding are never written.

:func:`~moe_kernels.kernels.gluon_block_fp8.available` says where it runs (Triton 3.6's Gluon, sm_90);
elsewhere the call refuses with that reason. Two experts' segments of 16 rows, bf16::

    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> w = (torch.randn(2, 256, 128, generator=g) / 16).to(torch.bfloat16)
    >>> x = torch.randn(48, 128, generator=g).to(torch.bfloat16)
    >>> m_indices = torch.tensor([0] * 3 + [-1] * 13 + [1] * 16 + [-1] * 16, dtype=torch.int32)
    >>> out = grouped_transposed_reference(x, w, m_indices)
    >>> out.shape, bool((out[3:16] == 0).all())          # padding rows: nothing
    (torch.Size([48, 256]), True)
    >>> bool(torch.allclose(out[16].float(), x[16].float() @ w[1].float().T, rtol=1e-2, atol=1e-2))
    True
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_tensor, fail
from .._runtime import note_launch
from .gluon_block_fp8 import _check, _check_rows_used, available, block_fp8_grouped, block_fp8_grouped_reference

__all__ = ["grouped_transposed", "grouped_transposed_reference"]


def grouped_transposed(x, w, m_indices, rows_used, *, x_scale=None, w_scale=None, gated: bool = False,
                       block_t: int = 16, stages: int = 6, out=None, validate_ids: bool = True,
                       quantize_output: bool = False):
    """``[M_pad, N]`` bf16 (gated ``[M_pad, N/2]``) for the rows with ``m_indices >= 0`` below ``rows_used``;
    others are not written (``out``, if given, keeps them). fp8 ``x`` and ``w`` take their block scales
    (``x_scale [M_pad, K/128]``, ``w_scale [E, N/128, K/128]``: :func:`~moe_kernels.kernels.gluon_block_fp8.
    block_fp8_grouped` with ``block_t``); bf16 ones none. ``block_t``: 16, 32 or 64 tokens a tile (the
    segments' alignment); ``stages``: the ring's TMA buffers (2-6). ``validate_ids`` reads ``m_indices`` and
    ``rows_used`` back to check them (a host sync; skipped while a graph captures). ``quantize_output`` (fp8,
    gated): ``(out, out_scale)``, GEMM 2's fp8 input and its scales, as ``block_fp8_grouped``'s. The launch
    record (``gluon_transposed.gemm``) names the format."""
    func = "grouped_transposed"
    for name, flag in (("gated", gated), ("validate_ids", validate_ids), ("quantize_output", quantize_output)):
        if not isinstance(flag, bool):
            fail(func, name, "must be a bool", repr(flag), TypeError)
    if block_t not in (16, 32, 64):
        fail(func, "block_t", "must be 16, 32 or 64", repr(block_t))
    check_int(func, "stages", stages, lo=2, hi=6)
    check_tensor(func, "rows_used", rows_used, ndim=1, dtypes=(torch.int32,))
    if tuple(rows_used.shape) != (1,):
        fail(func, "rows_used", "must have shape (1,)", tuple(rows_used.shape))
    if isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn:   # (checked and launched there)
        out = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, out=out, gated=gated, stages=stages,
                                validate_ids=validate_ids, rows_used=rows_used, block_t=block_t,
                                quantize_output=quantize_output)
        note_launch("gluon_transposed.gemm", format="fp8 block", gated=gated, block_t=block_t, stages=stages,
                    quantize_output=quantize_output)
        return out
    if quantize_output:
        fail(func, "quantize_output", "must be False unless the weights are fp8 (GEMM 2 then reads bf16)",
             quantize_output)
    reason = available(w.device if isinstance(w, torch.Tensor) else "cpu")
    if reason is not None:
        fail(func, "w", f"must be on a device this kernel runs on ({reason})", getattr(w, "device", w))
    _check(func, x, x_scale, w, w_scale, m_indices, out, 128, gated, validate_ids, block_t, dtype=torch.bfloat16)
    _check_rows_used(func, rows_used, m_indices, w.device, validate_ids, tile_m=block_t)
    if out is None:
        out = torch.empty(x.shape[0], w.shape[1] // 2 if gated else w.shape[1], device=x.device, dtype=torch.bfloat16)
    note_launch("gluon_transposed.gemm", format="bf16", gated=gated, block_t=block_t, stages=stages,
                quantize_output=False)
    if x.shape[0]:
        from ._gluon_transposed import launch, warps_for

        launch(x, None, w, None, m_indices, rows_used, out, block_t=block_t, stages=stages,
               num_warps=warps_for(block_t), gated=gated)
    return out


def grouped_transposed_reference(x, w, m_indices, *, x_scale=None, w_scale=None, gated: bool = False) -> torch.Tensor:
    """Torch reference for :func:`grouped_transposed`: each expert's rows (dequantised, for fp8) multiplied in
    float32 (``gated``: then ``silu(gate) * up`` in float32), rounded once to bf16; zero on the other rows."""
    if w.dtype == torch.float8_e4m3fn:
        return block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices, gated=gated)
    from .activation import silu_mul_reference

    out = torch.zeros(x.shape[0], w.shape[1], device=x.device, dtype=torch.float32)
    for e in range(w.shape[0]):
        rows = (m_indices == e).nonzero().flatten()
        if rows.numel():
            out[rows] = x[rows].float() @ w[e].float().T
    return silu_mul_reference(out, torch.bfloat16) if gated else out.to(torch.bfloat16)

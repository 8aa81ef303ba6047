"""The permute layout's fp8 input in one pass: each token quantised once, its fp8 row and scales written
to every slot it was routed to (and, without the quantiser, its bf16 input: :func:`scatter_rows`).

The block-fp8 permute layout needs GEMM 1's input as fp8 rows in the packed order, with one float32 scale
per row per 128 columns. Done in three steps (quantise ``[T, d]``, scatter the fp8 rows, gather the scales
in the rows' order) it reads and writes the activations twice and runs a handful of small launches for
the scales: on the H200 at DeepSeek-V3's 16,384 tokens those steps took 142 + 565 + 130 us
(``permute-gluon-stages.json``), where the bytes they must move take about 230 at the read bandwidth.
Here one program reads a token's ``[BLOCK_G, group]`` block of columns in bf16 once, quantises it with the
quantiser's arithmetic (:mod:`moe_kernels.kernels.quant`, line for line, so the rows are bit for bit the
three-step path's) and stores it, with its scales, at each of the token's ``k`` rows of the packed buffer
(``src2dst``, written by :func:`~moe_kernels.kernels.permute.permute` with ``copy=False``). A slot of
``-1`` (an id out of range) is skipped. Padding rows are not written: each output row of the GEMMs that
read them depends on its own input row only, and no padding row is ever read back. ``permute_experts``
takes it where ``permute.ONE_PASS_FP8_INPUT`` is set (the default since session 30).

Three tokens, ``k = 2``, rows of 128 columns (one group each), packed rows from a permutation::

    >>> import torch
    >>> from moe_kernels.kernels.permute import permute
    >>> x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    >>> p = permute(x, torch.tensor([[1, 0], [1, 2], [0, 1]]), 3, align=4, copy=False)
    >>> rows, scales = quantize_scatter(x, p.src2dst, p.m_indices.shape[0])
    >>> rows.shape, scales.shape
    (torch.Size([12, 128]), torch.Size([12, 1]))
    >>> dst = int(p.src2dst[1, 1])                        # token 1's second slot
    >>> want = (x[1] / scales[dst, 0]).clamp(-448, 448).to(torch.float8_e4m3fn)
    >>> bool(torch.equal(rows[dst].float(), want.float())), bool(scales[dst, 0] == x[1].abs().max() / 448)
    (True, True)
"""

from __future__ import annotations

import torch

from .. import _runtime
from .._checks import check_int, check_tensor, fail
from .._runtime import HAS_TRITON, cdiv, kernel, note_launch, tl, use_triton
from . import quant
from .quant import FP8, per_token_group_quant_fp8_reference

__all__ = ["quantize_scatter", "quantize_scatter_reference", "scatter_rows", "scatter_rows_reference"]

#: Column groups per program: 8 groups of 128 bf16 columns, 2 KiB read and k x 1 KiB written a program.
BLOCK_G = 8

if HAS_TRITON:

    # >>> book: quant-scatter
    @kernel
    def _quant_scatter_kernel(x_ptr, stride_x, src2dst_ptr, q_ptr, stride_q, s_ptr,
                              stride_s, num_groups, TOPK: tl.constexpr,
                              GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                              QUANTIZE: tl.constexpr = True):
        token = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        real = (groups < num_groups)[:, None]
        x = tl.load(x_ptr + token * stride_x + cols, mask=real, other=0.0)
        if QUANTIZE:   # (the quantiser's arithmetic)
            xf = x.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-10) / 448.0
            q = tl.clamp(xf / scale[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty)
        else:   # (bf16 rows: copied as they are)
            q = x
        for slot in tl.static_range(TOPK):   # the same bytes to each of its rows
            dst = tl.load(src2dst_ptr + token * TOPK + slot).to(tl.int64)
            if dst >= 0:   # (-1: an id out of range, routed nowhere)
                tl.store(q_ptr + dst * stride_q + cols, q, mask=real)
                if QUANTIZE:
                    tl.store(s_ptr + dst * stride_s + groups, scale,
                             mask=groups < num_groups)
    # <<< book: quant-scatter


def _check(func, x, src2dst, num_rows, group):
    check_tensor(func, "x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32), last_dim_contiguous=True)
    check_tensor(func, "src2dst", src2dst, ndim=2, dtypes=(torch.int32,), device=x.device, contiguous=True)
    if src2dst.shape[0] != x.shape[0]:
        fail(func, "src2dst", f"must have one row per token ({x.shape[0]})", tuple(src2dst.shape))
    check_int(func, "num_rows", num_rows, lo=0)
    check_int(func, "group", group, lo=16)
    if group & (group - 1):
        fail(func, "group", "must be a power of two", group)
    if x.shape[1] % group:
        fail(func, "x", f"must have a multiple of group={group} columns", tuple(x.shape))


def quantize_scatter(x: torch.Tensor, src2dst: torch.Tensor, num_rows: int, *, group: int = 128):
    """``(rows, scales)``: fp8 ``[num_rows, d]`` and float32 ``[num_rows, d / group]``, where row
    ``src2dst[t, j]`` holds token ``t`` quantised per 1 x ``group`` columns (as
    :func:`~moe_kernels.kernels.quant.per_token_group_quant_fp8` would), for every slot ``j`` with
    ``src2dst[t, j] >= 0``; the other rows are left unwritten. One launch, no host sync."""
    func = "quantize_scatter"
    _check(func, x, src2dst, num_rows, group)
    t, d = x.shape
    rows = torch.empty(num_rows, d, dtype=FP8, device=x.device)
    scales = torch.empty(num_rows, d // group, dtype=torch.float32, device=x.device)
    # (the interpreter's fp8 rounding is wrong where it carries into the exponent: see quant)
    interpreted_wrongly = _runtime.INTERPRET and quant.INTERPRETER_ROUNDS_FP8_WRONGLY
    if not use_triton(x, src2dst) or interpreted_wrongly or t == 0 or d == 0 or src2dst.shape[1] == 0:
        return _scatter(x, src2dst, rows, scales, group)
    num_groups = d // group
    note_launch("quant_scatter", block_g=BLOCK_G, topk=src2dst.shape[1], quantize=True)
    _quant_scatter_kernel[(t, cdiv(num_groups, BLOCK_G))](
        x, x.stride(0), src2dst, rows, rows.stride(0), scales, scales.stride(0), num_groups,
        TOPK=src2dst.shape[1], GROUP=group, BLOCK_G=BLOCK_G, num_warps=4)
    return rows, scales


def scatter_rows(x: torch.Tensor, src2dst: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, d]`` in ``x``'s dtype, row ``src2dst[t, j]`` a copy of token ``t`` for every slot with
    ``src2dst[t, j] >= 0``, the other rows left unwritten: the same one pass over the tokens as
    :func:`quantize_scatter`, without the quantiser (the permute layout's bf16 input, where the row-driven copy
    of :func:`~moe_kernels.kernels.permute.permute` reads each token once for every slot it was routed to).
    ``d`` a multiple of 128. One launch, no host sync.

        >>> from moe_kernels.kernels.permute import permute
        >>> x = torch.randn(3, 128)
        >>> p = permute(x, torch.tensor([[1, 0], [1, 2], [0, 1]]), 3, align=4, copy=False)
        >>> rows = scatter_rows(x, p.src2dst, p.m_indices.shape[0])
        >>> bool(torch.equal(rows[int(p.src2dst[2, 0])], x[2]))
        True
    """
    func = "scatter_rows"
    _check(func, x, src2dst, num_rows, 128)
    t, d = x.shape
    rows = torch.empty(num_rows, d, dtype=x.dtype, device=x.device)
    if not use_triton(x, src2dst) or t == 0 or d == 0 or src2dst.shape[1] == 0:
        return _to_slots(src2dst, (x, rows))[0]
    num_groups = d // 128
    note_launch("quant_scatter", block_g=BLOCK_G, topk=src2dst.shape[1], quantize=False)
    _quant_scatter_kernel[(t, cdiv(num_groups, BLOCK_G))](
        x, x.stride(0), src2dst, rows, rows.stride(0), None, 0, num_groups,
        TOPK=src2dst.shape[1], GROUP=128, BLOCK_G=BLOCK_G, QUANTIZE=False, num_warps=4)
    return rows


def _to_slots(src2dst, *pairs):
    """Each ``(per_token, per_row)`` pair: row ``src2dst[t, j]`` of ``per_row`` set to ``per_token[t]`` for every slot
    with ``src2dst[t, j] >= 0``; the ``per_row`` tensors, filled."""
    dst = src2dst.flatten().to(torch.int64)
    tokens = torch.arange(dst.numel(), device=src2dst.device) // src2dst.shape[1]
    routed = dst >= 0
    for per_token, per_row in pairs:
        per_row[dst[routed]] = per_token[tokens[routed]]
    return tuple(per_row for _, per_row in pairs)


def _scatter(x, src2dst, rows, scales, group):
    """The torch path: the quantiser's reference, then each slot's copy."""
    q, s = per_token_group_quant_fp8_reference(x, group)
    return _to_slots(src2dst, (q, rows), (s, scales))


def scatter_rows_reference(x: torch.Tensor, src2dst: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Torch reference of :func:`scatter_rows` (unwritten rows: zeros)."""
    _check("scatter_rows_reference", x, src2dst, num_rows, 128)
    return _to_slots(src2dst, (x, torch.zeros(num_rows, x.shape[1], dtype=x.dtype, device=x.device)))[0]


def quantize_scatter_reference(x: torch.Tensor, src2dst: torch.Tensor, num_rows: int, *, group: int = 128):
    """Torch reference of :func:`quantize_scatter` (unwritten rows: zeros and scales of 1)."""
    _check("quantize_scatter_reference", x, src2dst, num_rows, group)
    rows = torch.zeros(num_rows, x.shape[1], dtype=FP8, device=x.device)
    scales = torch.ones(num_rows, x.shape[1] // group, dtype=torch.float32, device=x.device)
    return _scatter(x, src2dst, rows, scales, group)

"""The top-k sum: each token's ``k`` expert outputs back into one row.

Two forms, one per kind of layout, both accumulating in fp32 and rounding once:

* :func:`moe_sum` (index-gather): GEMM 2 has already multiplied by the routing weights and written
  ``[T, k, d]`` in assignment order, so the sum is a plain strided add over the ``k`` axis (vLLM's
  ``ops.moe_sum``).
* :func:`unpermute` (permute and masked): the expert outputs sit in expert order in a row buffer,
  and ``src2dst[t, j]`` names the row holding assignment ``(t, j)``; the gather multiplies by the
  routing weights as it sums (SGLang's ``post_reorder_deepgemm_triton_kernel`` in
  sgl-project/sglang ``python/sglang/kernels/ops/moe/ep_moe_kernels.py`` does the same). A row
  index outside the buffer, or negative, means "no row": it adds nothing and is never used as an
  address.

    >>> import torch
    >>> moe_sum(torch.arange(12.0).reshape(2, 3, 2)).tolist()
    [[6.0, 9.0], [24.0, 27.0]]
    >>> y = torch.tensor([[1.0, 1.0], [10.0, 10.0], [100.0, 100.0]])
    >>> unpermute(y, torch.tensor([[2, 0], [1, -1]], dtype=torch.int32), torch.full((2, 2), 0.5)).tolist()
    [[50.5, 50.5], [5.0, 5.0]]
"""

from __future__ import annotations

import torch

from .._checks import FLOAT_DTYPES, check_tensor, fail
from .._runtime import HAS_TRITON, cdiv, kernel, next_power_of_2, note_launch, tl, use_triton
from ._gemm_operands import check_out, in_float32_under_interpreter

#: How :func:`unpermute` reads a token's ``k`` rows: ``"slots"``, one row chunk per slot in an
#: unrolled loop, added in registers, the shape of :func:`moe_sum`'s kernel; or ``"tile"``, as one
#: ``[k, BLOCK_D]`` tile summed over its first axis (the reduction crosses warps: shared memory and
#: barriers). On the H200 (``unpermute-ab.json``, ``tools/unpermute_ab.py``) "slots" ran at
#: ``moe_sum``'s rate on the same bytes and "tile" took 2.0-2.4 times as long (DeepSeek-V3, 16,384
#: tokens: 494 against 1,186 us; ``moe_sum`` 487), so "slots" is the default. The two add the same
#: products in another order: the sums agree to float32's rounding, not bit for bit. Read at each
#: call: a call recorded before a change (an ``MoELayer``'s plan and its CUDA graph) keeps the body
#: it was recorded with (``moe_kernels._replay.forget_all_plans()`` forgets them).
UNPERMUTE_BODY = "slots"

if HAS_TRITON:

    @kernel
    def _moe_sum_kernel(x_ptr, out_ptr, add_ptr, D, stride_xt, stride_xk, stride_ot, stride_at,
                        TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        if HAS_ADD:   # a shared expert's output joins the same fp32 sum (no separate add launch)
            acc += tl.load(add_ptr + token * stride_at + offs, mask=mask).to(tl.float32)
        for slot in tl.static_range(TOP_K):
            acc += tl.load(x_ptr + token * stride_xt + slot * stride_xk + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + token * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @kernel
    def _unpermute_kernel(
        y_ptr, stride_ym, num_rows, src2dst_ptr, weights_ptr, stride_wt, out_ptr, stride_ot,
        topk, hidden_size, BLOCK_TOPK: tl.constexpr, BLOCK_D: tl.constexpr, SLOT_LOOP: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_mask = cols < hidden_size
        if SLOT_LOOP:
            # One row chunk per slot, unrolled: each thread adds its columns of the k rows in
            # registers (no reduction across warps), and nothing is stored before the last load,
            # so all k rows' loads can be in flight at once (moe_sum's shape, with an index per row).
            total = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for slot in tl.static_range(BLOCK_TOPK):
                # (the row index broadcast over the chunk: the mask of a masked load is a tensor)
                src_row = tl.load(src2dst_ptr + token * topk + slot) + tl.zeros((BLOCK_D,), dtype=tl.int32)
                present = (src_row >= 0) & (src_row < num_rows)
                # (every slot's weight exists; a row that is not there adds nothing)
                weight = tl.where(present, tl.load(weights_ptr + token * stride_wt + slot).to(tl.float32), 0.0)
                safe_row = tl.where(present, src_row, 0).to(tl.int64)
                y = tl.load(y_ptr + safe_row * stride_ym + cols, mask=present & col_mask, other=0.0)
                total += y.to(tl.float32) * weight
        else:
            # The k rows as one [k, BLOCK_D] tile, summed over its first axis.
            slots = tl.arange(0, BLOCK_TOPK)
            src_rows = tl.load(src2dst_ptr + token * topk + slots, mask=slots < topk, other=-1)
            present = (slots < topk) & (src_rows >= 0) & (src_rows < num_rows)
            weights = tl.load(weights_ptr + token * stride_wt + slots, mask=present, other=0.0).to(tl.float32)
            safe_rows = tl.where(present, src_rows, 0).to(tl.int64)
            y = tl.load(y_ptr + safe_rows[:, None] * stride_ym + cols[None, :],
                        mask=present[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            total = tl.sum(y * weights[:, None], axis=0)
        tl.store(out_ptr + token * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def moe_sum(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the ``k`` slots of ``x`` (``[T, k, d]``) into ``[T, d]``, accumulating in fp32."""
    func = "moe_sum"
    check_tensor(func, "x", x, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    return sum_slots(x, check_out(func, out, (x.shape[0], x.shape[2]), x))


def sum_slots(x: torch.Tensor, out: torch.Tensor | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`moe_sum` without its checks (the experts step's own ``[T, k, d]``); ``add`` (``[T, d]``,
    rows contiguous, e.g. a shared expert's output) joins the fp32 sum before the one rounding."""
    num_tokens, top_k, d = x.shape
    if out is None:
        out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if not use_triton(x, out):
        return out.copy_(moe_sum_reference(x, add))
    if num_tokens == 0 or d == 0:
        return out
    if top_k == 0 and add is None:
        return out.zero_()
    if in_float32_under_interpreter(lambda x, *extra, out: sum_slots(x, out, *extra), out, x,
                                    *(() if add is None else (add,))) is not None:
        return out
    block_d = min(1024, next_power_of_2(d))
    note_launch("combine.moe_sum", top_k=top_k, block_d=block_d, add=add is not None)
    _moe_sum_kernel[(num_tokens, cdiv(d, block_d))](
        x, out, x if add is None else add, d, x.stride(0), x.stride(1), out.stride(0),
        0 if add is None else add.stride(0), TOP_K=top_k, BLOCK_D=block_d, HAS_ADD=add is not None, num_warps=4)
    return out


def moe_sum_reference(x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference for :func:`moe_sum` (and :func:`sum_slots`'s ``add``)."""
    total = x.float().sum(dim=1)
    return (total if add is None else total + add.float()).to(x.dtype)


def unpermute(y_rows: torch.Tensor, src2dst: torch.Tensor, topk_weights: torch.Tensor, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * y_rows[src2dst[t, j]]``, in float32, cast once.

    ``y_rows`` ``[R, d]``: the packed segments of :func:`moe_kernels.kernels.permute.permute`, or
    the flattened ``[E*m_max, d]`` slabs of :func:`moe_kernels.kernels.masked.masked_dispatch`.
    Returns ``[T, d]`` in ``y_rows.dtype``. A row of ``src2dst`` outside ``[0, R)`` adds nothing.
    """
    func = "unpermute"
    check_tensor(func, "y_rows", y_rows, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor(func, "src2dst", src2dst, ndim=2, dtypes=(torch.int32,), device=y_rows.device,
                 contiguous=True)
    check_tensor(func, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES,
                 device=y_rows.device, last_dim_contiguous=True)
    if topk_weights.shape != src2dst.shape:
        fail(func, "topk_weights", f"must have the shape of src2dst {tuple(src2dst.shape)}",
             f"shape {tuple(topk_weights.shape)}")
    num_tokens, topk = src2dst.shape
    hidden_size = y_rows.shape[1]
    out = check_out(func, out, (num_tokens, hidden_size), y_rows)
    if UNPERMUTE_BODY not in ("tile", "slots"):
        fail("moe_kernels.kernels.combine", "UNPERMUTE_BODY", "must be 'tile' or 'slots'", repr(UNPERMUTE_BODY))
    if not use_triton(y_rows, src2dst, topk_weights, out):
        return out.copy_(unpermute_reference(y_rows, src2dst, topk_weights))
    if num_tokens == 0 or hidden_size == 0:
        return out
    rerun = lambda y, out: unpermute(y, src2dst, topk_weights, out=out)  # noqa: E731
    if in_float32_under_interpreter(rerun, out, y_rows) is not None:
        return out
    slot_loop = UNPERMUTE_BODY == "slots"
    if slot_loop:   # k rows unrolled (BLOCK_TOPK = k exactly), each chunk as wide as moe_sum's
        block_topk, block_d = topk, min(next_power_of_2(hidden_size), 1024)
    else:
        block_topk, block_d = max(next_power_of_2(topk), 2), min(next_power_of_2(hidden_size), 512)
    note_launch("combine.unpermute", body=UNPERMUTE_BODY, block_d=block_d)
    _unpermute_kernel[(num_tokens, cdiv(hidden_size, block_d))](
        y_rows, y_rows.stride(0), y_rows.shape[0], src2dst, topk_weights, topk_weights.stride(0),
        out, out.stride(0), topk, hidden_size,
        BLOCK_TOPK=block_topk, BLOCK_D=block_d, SLOT_LOOP=slot_loop, num_warps=4,
    )
    return out


def unpermute_reference(y_rows, src2dst, topk_weights):
    """Torch reference for :func:`unpermute`."""
    if y_rows.shape[0] == 0:
        return y_rows.new_zeros(src2dst.shape[0], y_rows.shape[1])
    present = (src2dst >= 0) & (src2dst < y_rows.shape[0])
    gathered = y_rows[torch.where(present, src2dst, 0).to(torch.int64)].float()
    weights = torch.where(present, topk_weights.float(), 0.0)
    return (gathered * weights[..., None]).sum(dim=1).to(y_rows.dtype)

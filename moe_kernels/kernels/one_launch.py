"""Both expert GEMMs of a tiny batch in one launch, split over the intermediate dimension.

At one token a decode step's experts are a handful of matrix-vector products: Qwen3-30B-A3B's
eight experts read 75.5 MB of bf16 weights for 0.08 GFLOP. Two grouped GEMMs (gate-up, then down)
each fill the machine for a few microseconds, and each pays its own start and its own tail: the
second cannot begin streaming its weights until the first has finished, although those weights
do not depend on it. Here one program owns one assignment ``a`` (token ``a // k``) and one slice
of ``BLOCK_F`` rows of that expert's intermediate ``F``, and does both products for that slice:

1. ``h = silu(W1_gate[slice] @ x) * (W1_up[slice] @ x)``: its ``2 * BLOCK_F`` rows of ``w1``,
   complete over ``d`` (no other program needs them), then times the routing weight;
2. ``W2[:, slice] @ h``: that slice's ``BLOCK_F`` columns of ``w2``, a partial sum over ``F`` of the
   token's whole output row, added into an fp32 ``[T, d]`` with atomic adds.

No program waits for another, so every SM streams from the first microsecond to the last, and
both matrices' bytes are read exactly once. The last program to finish for a token (an arrival
counter per token, the pattern of :mod:`moe_kernels.kernels.gate_routing`) rounds its fp32 row
to the output dtype. The price: ``F / BLOCK_F`` atomic adds per output element per assignment (at
one Qwen3 token with ``BLOCK_F = 32``: 8 x 24 x 2048 = 393k, all to 8 KB), and sums whose order
varies from run to run in float32's last bits, like ``MoEConfig.sum_in_gemm``. One fill (the fp32
row and the counters) precedes the launch.

The products are matrix-vector products on the CUDA cores (``tl.sum`` of a weight tile times
the token's row), not ``tl.dot``: with one token per program there is nothing for a tensor core
to share. fp8 weights are dequantised in registers (their scales applied to the activations'
columns, or to the rows' sums) and multiply the unquantised activations: W8A16, one rounding
fewer than the two-GEMM path's W8A8 (which quantises ``x`` and ``h`` to fp8 on the fly).
Each slice rounds ``h`` to the activations' dtype before ``w2``, as the two-GEMM path writes it.

Worth it only while the assignments are few: each assignment reads its expert's weights
itself, so two tokens on one expert read it twice (L2 may catch the second read).

    >>> import torch
    >>> from moe_kernels.reference import moe_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(1, 64, generator=g)                  # one token, d = 64
    >>> w1 = torch.randn(4, 2 * 32, 64, generator=g) / 8     # E = 4, F = 32
    >>> w2 = torch.randn(4, 64, 32, generator=g) / 4
    >>> ids, weights = torch.tensor([[3, 1]]), torch.tensor([[0.75, 0.25]])
    >>> out = one_launch_experts(x, w1, w2, weights, ids, tiles=OneLaunchTiles(block_f=16, block_d=32))
    >>> grid_programs(1, 2, 32, OneLaunchTiles(block_f=16, block_d=32))   # 2 assignments x 2 slices
    4
    >>> ref = moe_reference(x, w1, w2, weights, ids)
    >>> bool(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref) < 1e-5)
    True
"""

from __future__ import annotations

import torch

from .._checks import check_moe_inputs, device_id_check, fail
from .._runtime import HAS_TRITON, cdiv, device_assert_options, kernel, note_launch, tl, use_triton
from ._one_launch_parts import ROUND, one_launch_reference, scale_strides, settled_without_launch
from .config import OneLaunchTiles
from .formats import WeightFormat
from .two_phase import run_two_phase

__all__ = ["OneLaunchTiles", "grid_programs", "one_launch_experts", "one_launch_reference", "run_one_launch"]


def grid_programs(num_tokens: int, top_k: int, f: int, tiles: OneLaunchTiles) -> int:
    """Programs of one launch: one per assignment and slice of ``F``."""
    return num_tokens * top_k * cdiv(f, tiles.block_f)


if HAS_TRITON:
    from ._one_launch_parts import _rounded

    @kernel
    def _column_scales(scale_ptr, expert, row_block, cols, cols_ok, stride_se, stride_sn, stride_sk,
                       SCALES: tl.constexpr):
        """Block scales (``SCALES == 1``) of one 128-row block, per column of ``cols``; 1 otherwise."""
        if SCALES == 1:
            return tl.load(scale_ptr + expert * stride_se + row_block * stride_sn + (cols // 128) * stride_sk,
                           mask=cols_ok, other=1.0)
        else:
            return tl.full(cols.shape, 1.0, tl.float32)

    @kernel
    def _row_scales(scale_ptr, expert, rows, rows_ok, col_block, stride_se, stride_sn, stride_sk,
                    SCALES: tl.constexpr):
        """Scales that multiply each row's sum: a 128-row block's (1), a row's (2), the expert's (3)."""
        if SCALES == 1:
            return tl.load(scale_ptr + expert * stride_se + (rows // 128) * stride_sn + col_block * stride_sk,
                           mask=rows_ok, other=1.0)
        elif SCALES == 2:
            return tl.load(scale_ptr + expert * stride_se + rows * stride_sn, mask=rows_ok, other=1.0)
        elif SCALES == 3:
            return tl.load(scale_ptr + expert * stride_se + rows * 0, mask=rows_ok, other=1.0)
        else:
            return tl.full(rows.shape, 1.0, tl.float32)

    @kernel
    def _one_launch_kernel(
        x_ptr, w1_ptr, w2_ptr, topk_weights_ptr, topk_ids_ptr, acc_ptr, arrivals_ptr, out_ptr, add_ptr,
        w1_scale_ptr, w2_scale_ptr, num_experts, D, F,
        stride_x, stride_w1e, stride_w1n, stride_w2e, stride_w2n, stride_out, stride_add,
        stride_s1e, stride_s1n, stride_s1k, stride_s2e, stride_s2n, stride_s2k,
        TOP_K: tl.constexpr, SLICES: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        SCALES: tl.constexpr, ID_CHECK: tl.constexpr, STAGES: tl.constexpr, HAS_ADD: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        # >>> book: one-launch
        pid = tl.program_id(0)
        assignment = pid // SLICES   # neighbours: one expert's neighbouring slices
        token = (assignment // TOP_K).to(tl.int64)
        expert = tl.load(topk_ids_ptr + assignment).to(tl.int64)
        known = (expert >= 0) & (expert < num_experts)
        if ID_CHECK != "":
            tl.device_assert(known, ID_CHECK)
        if known:   # (an unchecked bad id adds nothing)
            f0 = (pid % SLICES) * BLOCK_F
            rows = f0 + tl.arange(0, BLOCK_F)
            row_ok = rows < F
            cols = tl.arange(0, BLOCK_D)
            gate_rows = (w1_ptr + expert * stride_w1e
                         + rows.to(tl.int64)[:, None] * stride_w1n)
            up_rows = gate_rows + F * stride_w1n
            gate = tl.zeros([BLOCK_F], dtype=tl.float32)
            up = tl.zeros([BLOCK_F], dtype=tl.float32)
            # GEMM 1: the slice's gate and up rows times the token's row, all of d
            for k0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
                k = k0 + cols
                k_ok = k < D
                xk = tl.load(x_ptr + token * stride_x + k, mask=k_ok, other=0.0)
                xk = xk.to(tl.float32)
                mask = row_ok[:, None] & k_ok[None, :]
                wg = tl.load(gate_rows + k[None, :], mask=mask, other=0.0)
                wu = tl.load(up_rows + k[None, :], mask=mask, other=0.0)
                # (block scales: one per column here, from the rows' 128-row block)
                sg = _column_scales(w1_scale_ptr, expert, f0 // 128, k, k_ok,
                                    stride_s1e, stride_s1n, stride_s1k, SCALES)
                su = _column_scales(w1_scale_ptr, expert, (F + f0) // 128, k, k_ok,
                                    stride_s1e, stride_s1n, stride_s1k, SCALES)
                gate += tl.sum(wg.to(tl.float32) * (xk * sg)[None, :], axis=1)
                up += tl.sum(wu.to(tl.float32) * (xk * su)[None, :], axis=1)
            if SCALES > 1:   # a row's or the expert's scale: on the finished sums
                gate *= _row_scales(w1_scale_ptr, expert, rows, row_ok, 0,
                                    stride_s1e, stride_s1n, stride_s1k, SCALES)
                up *= _row_scales(w1_scale_ptr, expert, F + rows, row_ok, 0,
                                  stride_s1e, stride_s1n, stride_s1k, SCALES)
            h = gate / (1.0 + tl.exp(-gate)) * up
            h = _rounded(h, ROUND)   # to the activations' dtype, as GEMM 1 stores it
            weight = tl.load(topk_weights_ptr + assignment).to(tl.float32)
            h = tl.where(row_ok, h, 0.0) * weight
            # GEMM 2: the slice's columns of w2, a partial sum of the output row
            w2_cols = w2_ptr + expert * stride_w2e + rows[None, :]
            for n0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
                n = n0 + cols
                n_ok = n < D
                w = tl.load(w2_cols + n.to(tl.int64)[:, None] * stride_w2n,
                            mask=n_ok[:, None] & row_ok[None, :], other=0.0)
                part = tl.sum(w.to(tl.float32) * h[None, :], axis=1)
                part *= _row_scales(w2_scale_ptr, expert, n, n_ok, f0 // 128,
                                    stride_s2e, stride_s2n, stride_s2k, SCALES)
                tl.atomic_add(acc_ptr + token * D + n, part, mask=n_ok,
                              sem="relaxed", scope="gpu")
        # Every thread's adds, then one release: the token's last program sees them.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K * SLICES - 1:
            tl.debug_barrier()   # thread 0's acquire, for all the program's threads
            for n0 in range(0, D, BLOCK_D):
                n = n0 + tl.arange(0, BLOCK_D)
                row = tl.load(acc_ptr + token * D + n, mask=n < D, other=0.0,
                              cache_modifier=".cg")   # (from L2: other SMs added)
                if HAS_ADD:   # a shared expert's output joins the fp32 sum
                    extra = tl.load(add_ptr + token * stride_add + n, mask=n < D, other=0.0)
                    row += extra.to(tl.float32)
                tl.store(out_ptr + token * stride_out + n,
                         row.to(out_ptr.dtype.element_ty), mask=n < D)
        # <<< book: one-launch


def runs_in_one_launch(config, fmt) -> bool:
    """Whether ``config`` (a :class:`~moe_kernels.kernels.config.MoEConfig`) runs both GEMMs in one launch
    for weights of format ``fmt``: it has ``one_launch`` tiles, and their kernel takes the format (the
    two-phase kernel runs unquantised weights, and block-fp8 ones with K steps of their block; a tuned
    table is keyed by the element type, so an fp8 entry also meets the channel and tensor formats,
    which then take its two GEMMs)."""
    tiles = config.one_launch
    if tiles is None or tiles.phases == 1 or not fmt.quantized:
        return tiles is not None
    return fmt.activations == "group" and tiles.block_k == fmt.block[1]


def one_launch_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, *, tiles: OneLaunchTiles | None = None, w1_scale=None, w2_scale=None,
                       validate_ids: bool = True) -> torch.Tensor:
    """``fused_experts``' result (``[T, d]`` in ``hidden_states``' dtype) in one launch (see the
    module docstring). Arguments as :func:`~moe_kernels.kernels.index_gather.fused_experts`;
    ``tiles`` defaults to :class:`OneLaunchTiles`' defaults. fp8 weights in any format of
    :mod:`moe_kernels.kernels.formats` run W8A16."""
    func = "one_launch_experts"
    check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids)
    fmt = WeightFormat.of_pair(func, w1, w2, w1_scale, w2_scale)
    if tiles is None:
        tiles = OneLaunchTiles()
    elif not isinstance(tiles, OneLaunchTiles):
        fail(func, "tiles", "must be a OneLaunchTiles", type(tiles).__name__, TypeError)
    return run_one_launch(hidden_states, w1, w2, topk_weights, topk_ids, fmt=fmt, tiles=tiles, w1_scale=w1_scale,
                          w2_scale=w2_scale, ids="validate" if validate_ids else "unchecked", func=func)


def run_one_launch(hidden_states, w1, w2, topk_weights, topk_ids, *, fmt, tiles: OneLaunchTiles, w1_scale=None,
                   w2_scale=None, ids: str = "validate", func: str = "one_launch_experts", add=None,
                   _round_to=None) -> torch.Tensor:
    """:func:`one_launch_experts` after its checks. ``ids``: ``"validate"`` (a device assert in
    the kernel; at once on the CPU), ``"trusted"`` or ``"unchecked"`` (a bad id adds nothing).
    ``add``: a ``[T, d]`` tensor (e.g. a shared expert's output; made contiguous if its columns are not) added in the
    fp32 sum before its one rounding. ``tiles.phases == 2``: :mod:`moe_kernels.kernels.two_phase`."""
    if add is not None and add.stride(-1) != 1:   # (both kernels step along an addend's row by one element)
        add = add.contiguous()
    if tiles.phases == 2:
        return run_two_phase(hidden_states, w1, w2, topk_weights, topk_ids, fmt=fmt, tiles=tiles, w1_scale=w1_scale,
                             w2_scale=w2_scale, ids=ids, func=func, add=add, _round_to=_round_to)
    num_tokens, top_k = topk_ids.shape
    num_experts, d, f = w2.shape
    out, done = settled_without_launch(run_one_launch, hidden_states, w1, w2, topk_weights, topk_ids,
                                       reference=not use_triton(hidden_states, w1, w2), fmt=fmt, w1_scale=w1_scale,
                                       w2_scale=w2_scale, ids=ids, func=func, add=add, tiles=tiles)
    if done:
        return out
    id_check = device_id_check(func, "topk_ids", topk_ids, num_experts) if ids == "validate" else ""
    # One fill: the fp32 rows the slices add into, then one arrival counter per token.
    scratch = torch.zeros(num_tokens * d + num_tokens, device=out.device, dtype=torch.int32)
    acc, arrivals = scratch[:num_tokens * d].view(torch.float32), scratch[num_tokens * d:]
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    ids_flat = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    s1 = scale_strides(w1_scale)
    s2 = scale_strides(w2_scale)
    slices = cdiv(f, tiles.block_f)
    note_launch("one_launch.experts", format=fmt.name, **tiles.as_dict(), add=add is not None)
    _one_launch_kernel[(num_tokens * top_k * slices,)](
        hidden_states, w1, w2, weights, ids_flat, acc, arrivals, out, out if add is None else add,
        w1 if w1_scale is None else w1_scale, w2 if w2_scale is None else w2_scale, num_experts, d, f,
        hidden_states.stride(0), w1.stride(0), w1.stride(1), w2.stride(0), w2.stride(1), out.stride(0),
        0 if add is None else add.stride(0), *s1, *s2,
        TOP_K=top_k, SLICES=slices, BLOCK_F=tiles.block_f, BLOCK_D=tiles.block_d, SCALES=fmt.scale_code,
        ID_CHECK=id_check, STAGES=tiles.num_stages, HAS_ADD=add is not None,
        ROUND=ROUND[_round_to or hidden_states.dtype], num_warps=tiles.num_warps,
        **device_assert_options(id_check))
    return out

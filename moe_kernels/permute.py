"""Permute: copy every assignment's row into its expert's contiguous, aligned segment.

The index-gather layout (``fused_moe.py``) leaves the activations where they are and lets each
GEMM tile gather its rows through an index list. This module is the other answer, the one SGLang
uses in front of DeepGEMM's ``m_grouped_*_gemm_nt_contiguous``: physically copy the rows so that
each expert owns one contiguous segment of a packed buffer, every segment starting on an
``align``-row boundary (DeepGEMM wants 128). A GEMM tile then covers rows of one expert only and
reads them with plain strided loads; the price is the copy in (``permute``) and the copy back
(``unpermute``), which :func:`permute_copy_bytes` counts.

The pipeline, each step a Triton kernel with a torch reference beside it:

1. :func:`permute` - where the rows go is exactly what :func:`moe_kernels.align.moe_align_block_size`
   computes with ``block_size=align``: its ``sorted_token_ids`` *is* the permutation (row ``r`` of
   the packed buffer holds assignment ``sorted_token_ids[r]``, or padding when that is the
   sentinel ``numel``). So alignment is reused, not redone, and one scatter kernel copies the rows
   and writes ``m_indices`` (expert of each row, -1 on padding, DeepGEMM's convention) and
   ``src2dst`` (row of each assignment, SGLang's name).
2. :func:`grouped_gemm_contiguous` - ``[M_pad, K] x w[e]^T`` where each ``BLOCK_M`` tile belongs to
   one expert, read from ``m_indices``; tiles of padding exit at once, padding rows are never
   read or written. With ``silu_mul=True`` it computes the gate and up halves of ``w1`` together
   and stores only ``silu(gate) * up``, so the ``[M_pad, 2F]`` intermediate never exists.
3. :func:`unpermute` - gathers each token's ``k`` rows, multiplies by the routing weights in
   float32, sums, and casts once (SGLang's ``post_reorder_deepgemm_triton_kernel`` does the same;
   sgl-project/sglang ``python/sglang/kernels/ops/moe/ep_moe_kernels.py``).

:func:`permute_experts` chains them with no host synchronisation on the GPU: every size comes from
the shapes. Expert ids are validated the way :func:`moe_kernels.align.moe_align_block_size`
does it (``validate_ids``, on by default: one device-to-host read on the GPU; turn it off only
where the ids are known good, e.g. under CUDA-graph capture). Unchecked out-of-range ids land in no segment, keep ``src2dst = -1``, and add nothing to their
token's output (SGLang's gather skips ``dst < 0`` the same way), so no kernel touches memory out
of bounds. The packed buffer has :func:`max_padded_rows` rows, the most any routing of ``T*k``
assignments can need (SGLang's ``_get_compact_all_tokens``), which is at most vLLM's
``numel + E*(align-1)`` and far less when ``T*k`` is small. :func:`torch_grouped_mm_experts` runs
the same permute/unpermute around ``torch.nn.functional.grouped_mm`` as a baseline.

A worked example: three tokens, ``k = 2``, three experts, segments aligned to 4 rows::

    >>> import torch
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> ids = torch.tensor([[1, 0], [1, 2], [0, 1]])   # expert 0: 2 rows, 1: 3 rows, 2: 1 row
    >>> p = permute(x, ids, num_experts=3, align=4)
    >>> p.m_indices.tolist()                           # 4-row segments, padding marked -1
    [0, 0, -1, -1, 1, 1, 1, -1, 2, -1, -1, -1]
    >>> p.segment_starts.tolist(), p.segment_counts.tolist()
    ([0, 4, 8], [2, 3, 1])
    >>> torch.equal(p.rows[p.src2dst[1, 1]], x[1])      # token 1's second choice went to expert 2
    True
    >>> torch.equal(unpermute(p.rows, p.src2dst, torch.full((3, 2), 0.5)), x)   # the round trip
    True

At DeepSeek-V3's width (``d = 7168``), 512 tokens and ``k = 8`` in fp8, the permute writes
``B*k*d = 29.4 MB`` (after reading the 3.7 MB of token rows once); the unpermute gathers as
many bytes back and writes 3.7 MB (counted in one dtype, for simplicity)::

    >>> cost = permute_copy_bytes(512, 8, 7168, torch.float8_e4m3fn)
    >>> round(cost.permute / 1e6, 1), round(cost.unpermute / 1e6, 1)
    (33.0, 33.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _runtime
from ._checks import FLOAT_DTYPES, ID_DTYPES, check_dispatch_inputs, check_int, check_moe_inputs, check_tensor, fail
from ._runtime import HAS_TRITON, tl, triton, use_triton
from .align import moe_align_block_size, moe_align_block_size_reference

__all__ = [
    "CopyBytes", "PermutedRows", "TileConfig", "default_tile_config", "grouped_gemm_contiguous",
    "max_padded_rows", "permute", "permute_copy_bytes", "permute_experts", "permute_reference",
    "torch_grouped_mm_experts", "unpermute", "unpermute_reference",
]

#: Activation and weight dtypes the grouped GEMMs accept (fp8 needs scales: not handled here).
COMPUTE_DTYPES = FLOAT_DTYPES
ROUTING_WEIGHT_DTYPES = FLOAT_DTYPES


# --------------------------------------------------------------------------------------------
# Sizes and costs (pure arithmetic: usable at real shapes on any machine)
# --------------------------------------------------------------------------------------------


def max_padded_rows(num_assignments: int, num_experts: int, align: int) -> int:
    """The most rows the aligned segments can need, over every routing of the assignments.

    An expert with ``c >= 1`` rows takes ``ceil(c/align) = 1 + (c-1)//align`` blocks; summed over
    ``J`` non-empty experts that is at most ``J + (n-J)//align``, which grows with ``J``, so the
    worst case has ``J = min(n, E)``. Sizing the packed buffer by this bound keeps its shape a
    function of ``(n, E, align)`` only, so no host sync is needed (and CUDA graphs see one shape).
    SGLang uses the same bound (``_get_compact_all_tokens`` in
    ``python/sglang/srt/layers/moe/moe_runner/deep_gemm.py``); vLLM's ``numel + E*(align-1)``
    is never smaller.

        >>> max_padded_rows(8, 256, 128)      # one decode token, top-8: 8 blocks, not 32,520 rows
        1024
        >>> max_padded_rows(4096, 256, 128)   # 512 tokens, top-8
        36608
    """
    func = "max_padded_rows"
    check_int(func, "num_assignments", num_assignments, lo=0)
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "align", align, lo=1)
    nonempty = min(num_assignments, num_experts)
    return align * (nonempty + (num_assignments - nonempty) // align)


class CopyBytes(NamedTuple):
    """Bytes of activation rows that the permute and the unpermute move through memory."""

    permute: int
    unpermute: int


def permute_copy_bytes(num_tokens: int, topk: int, hidden_size: int, dtype: torch.dtype) -> CopyBytes:
    """Bytes the copy costs: what the index-gather layout never spends.

    ``permute`` reads each token row once and writes ``k`` copies; ``unpermute`` reads the ``k``
    result rows of each token and writes one. Padding rows are neither read nor written, and the
    int32 index traffic (about 12 bytes per assignment) is left out: at real widths it is well
    under 1%.
    """
    func = "permute_copy_bytes"
    check_int(func, "num_tokens", num_tokens, lo=0)
    check_int(func, "topk", topk, lo=1)
    check_int(func, "hidden_size", hidden_size, lo=1)
    row = hidden_size * dtype.itemsize
    moved = num_tokens * (1 + topk) * row
    return CopyBytes(permute=moved, unpermute=moved)


# --------------------------------------------------------------------------------------------
# GEMM tile configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch parameters of the grouped GEMMs (one config serves both GEMMs).

    ``block_n`` counts output columns: with the fused SiLU·mul a GEMM1 tile reads ``2*block_n``
    weight rows (gate and up). ``block_m`` must divide the segment alignment, so that a tile never
    straddles two experts.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_tile_config(dtype: torch.dtype, align: int = 128) -> TileConfig:
    """128x128x64 for 16-bit inputs (128x128x32 in fp32, whose operands are twice as wide).

    ``block_m`` is lowered to the largest power of two dividing ``align`` (at least 16, the
    smallest ``tl.dot`` tile).
    """
    block_m = 128
    while align % block_m and block_m > 16:
        block_m //= 2
    block_k = 32 if dtype == torch.float32 else 64
    return TileConfig(block_m=block_m, block_k=block_k)


def check_tile_config(func: str, config: object, align: int | None) -> TileConfig:
    if not isinstance(config, TileConfig):
        fail(func, "config", "must be a TileConfig", type(config).__name__, TypeError)
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(config, name)
        if size < 16 or size & (size - 1):
            fail(func, f"config.{name}", "must be a power of two >= 16 (tl.dot tile)", size)
    if align is not None and align % config.block_m:
        fail(func, "config.block_m", f"must divide align={align} (a tile must not straddle two "
             "experts' segments)", config.block_m)
    return config


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently run as TF32 (10-bit mantissa) by default: ask for true fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_cannot_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """The CPU interpreter's ``tl.dot`` multiplies bf16 bit patterns (triton #11584)."""
    return dtype == torch.bfloat16 and _runtime.INTERPRET and device.type == "cpu"


# --------------------------------------------------------------------------------------------
# Argument checks shared by the public entry points (masked.py uses them too)
# --------------------------------------------------------------------------------------------


def check_out(func: str, out: object, shape: tuple, dtype: torch.dtype, device: torch.device):
    """Check a caller-provided output buffer (or return None to allocate one)."""
    if out is None:
        return None
    check_tensor(func, "out", out, dtypes=(dtype,), device=device)
    if tuple(out.shape) != tuple(shape):
        fail(func, "out", f"must have shape {tuple(shape)}", f"shape {tuple(out.shape)}")
    return out


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _permute_rows_kernel(
        hidden_ptr, stride_ht, stride_hd,
        sorted_ids_ptr, block_experts_ptr,
        rows_ptr, stride_rm, stride_rd,
        m_indices_ptr, src2dst_ptr,
        num_rows, num_assignments, topk, hidden_size, align,
        BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # Row-driven: each packed row looks up which assignment it holds, so padding rows cost
        # one index load and no data movement.
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        in_range = rows < num_rows
        assignment = tl.load(sorted_ids_ptr + rows, mask=in_range, other=num_assignments)
        real = in_range & (assignment < num_assignments)
        expert = tl.load(block_experts_ptr + rows // align, mask=in_range, other=-1)
        tl.store(m_indices_ptr + rows, tl.where(real, expert, -1), mask=in_range)
        tl.store(src2dst_ptr + assignment, rows, mask=real)
        src = (assignment // topk).to(tl.int64) * stride_ht
        dst = rows.to(tl.int64) * stride_rm
        for d0 in range(0, hidden_size, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = real[:, None] & (cols < hidden_size)[None, :]
            values = tl.load(hidden_ptr + src[:, None] + cols[None, :] * stride_hd, mask=mask)
            tl.store(rows_ptr + dst[:, None] + cols[None, :] * stride_rd, values, mask=mask)

    @triton.jit
    def expert_tile_gemm(
        a_ptr, a_rows, stride_ak,
        w_ptr, stride_wn, stride_wk,
        out_ptr, out_rows, stride_on,
        row_mask, pid_n, N, K,
        SILU_MUL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One ``[BLOCK_M, BLOCK_N]`` output tile of ``a[rows] @ w^T`` for one expert's ``w``.

        ``a_rows``/``out_rows`` are int64 element offsets of the tile's rows; rows outside
        ``row_mask`` are neither loaded (they read as 0) nor stored. With ``SILU_MUL`` the tile
        also computes the up-projection columns ``N + cols`` and stores ``silu(gate) * up``.
        Shared by the contiguous (this module) and masked (``masked.py``) layouts, which differ
        only in how a tile finds its expert and its rows.
        """
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] + ks[None, :] * stride_ak
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SILU_MUL:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_up_ptrs = w_ptrs + N * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k_mask = ks < K - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
            if SILU_MUL:
                w_up = tl.load(w_up_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=INPUT_PRECISION)
                w_up_ptrs += BLOCK_K * stride_wk
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if SILU_MUL:
            # In fp32, before the single rounding to the output dtype.
            acc = acc * tl.sigmoid(acc) * acc_up
        out_ptrs = out_ptr + out_rows[:, None] + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _contiguous_gemm_kernel(
        a_ptr, stride_am, stride_ak,
        w_ptr, stride_we, stride_wn, stride_wk,
        out_ptr, stride_om, stride_on,
        m_indices_ptr, num_rows, N, K,
        SILU_MUL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Axis 0 (M tiles) varies fastest, so consecutive programs are consecutive tiles of the
        # same expert and find that expert's weight tile in L2.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_experts = tl.load(m_indices_ptr + rows, mask=rows < num_rows, other=-1)
        # A tile lies inside one segment (block_m divides align), so its real rows share one
        # expert; padding rows are -1. A tile of padding only has nothing to do.
        expert = tl.max(row_experts, axis=0)
        if expert < 0:
            return
        row_offsets = rows.to(tl.int64)
        expert_tile_gemm(
            a_ptr, row_offsets * stride_am, stride_ak,
            w_ptr + expert.to(tl.int64) * stride_we, stride_wn, stride_wk,
            out_ptr, row_offsets * stride_om, stride_on,
            row_experts >= 0, pid_n, N, K,
            SILU_MUL, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )

    @triton.jit
    def _unpermute_kernel(
        y_ptr, stride_ym, stride_yd,
        src2dst_ptr, weights_ptr, stride_wt, stride_wk,
        out_ptr, stride_ot, stride_od,
        topk, hidden_size,
        BLOCK_TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        slots = tl.arange(0, BLOCK_TOPK)
        slot_mask = slots < topk
        src_rows = tl.load(src2dst_ptr + token * topk + slots, mask=slot_mask, other=-1)
        slot_mask = slot_mask & (src_rows >= 0)
        weights = tl.load(weights_ptr + token * stride_wt + slots * stride_wk, mask=slot_mask,
                          other=0.0).to(tl.float32)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_mask = cols < hidden_size
        y = tl.load(y_ptr + src_rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yd,
                    mask=slot_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        total = tl.sum(y * weights[:, None], axis=0)
        tl.store(out_ptr + token * stride_ot + cols * stride_od,
                 total.to(out_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------
# permute
# --------------------------------------------------------------------------------------------


class PermutedRows(NamedTuple):
    """The contiguous layout: what :func:`permute` returns.

    * ``rows`` ``[M_pad, d]``: expert ``e``'s rows are ``rows[segment_starts[e] :
      segment_starts[e] + segment_counts[e]]``; padding rows are left unwritten (whatever the
      buffer held) and no kernel reads them.
    * ``m_indices`` int32 ``[M_pad]``: the expert of each row, -1 on padding rows.
    * ``src2dst`` int32 ``[T, k]``: the row that holds assignment ``(t, j)`` (-1 for an
      out-of-range id left unvalidated, which no segment holds).
    * ``segment_starts`` int32 ``[E]``: first row of each segment, a multiple of ``align``.
    * ``segment_counts`` int32 ``[E]``: real rows in each segment (tokens routed to the expert).
    """

    rows: torch.Tensor
    m_indices: torch.Tensor
    src2dst: torch.Tensor
    segment_starts: torch.Tensor
    segment_counts: torch.Tensor


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert (int32 ``[E]``) with no host sync; ids outside ``[0, E)`` are not counted."""
    flat = topk_ids.flatten().to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, torch.where(valid, flat, 0), valid.to(torch.int64))
    return counts.to(torch.int32)


def _segments(topk_ids: torch.Tensor, num_experts: int, align: int):
    """Aligned segment starts and real row counts per expert, without leaving the device."""
    counts = expert_counts(topk_ids, num_experts)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    return starts.to(torch.int32), counts


def _check_permute_args(func, hidden_states, topk_ids, num_experts, align):
    check_dispatch_inputs(func, hidden_states, topk_ids, num_experts)
    check_int(func, "align", align, lo=1)


def permute(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    align: int = 128,
    *,
    out: torch.Tensor | None = None,
    validate_ids: bool = True,
) -> PermutedRows:
    """Copy each assignment's activation row into its expert's ``align``-row-aligned segment.

    ``hidden_states`` ``[T, d]``, ``topk_ids`` ``[T, k]`` (0-based expert ids). ``out``, if given,
    is the ``[max_padded_rows(T*k, E, align), d]`` buffer to fill. ``validate_ids`` is passed to
    :func:`moe_kernels.align.moe_align_block_size`, which this function calls (default: check, which
    costs one device-to-host read on the GPU; unchecked, a bad id's ``src2dst`` stays -1).
    """
    func = "permute"
    _check_permute_args(func, hidden_states, topk_ids, num_experts, align)
    num_tokens, hidden_size = hidden_states.shape
    topk = topk_ids.shape[1]
    num_assignments = num_tokens * topk
    num_rows = max_padded_rows(num_assignments, num_experts, align)
    device = hidden_states.device
    rows = check_out(func, out, (num_rows, hidden_size), hidden_states.dtype, device)
    if rows is None:
        rows = torch.empty(num_rows, hidden_size, dtype=hidden_states.dtype, device=device)
    sorted_ids, block_experts, _ = moe_align_block_size(topk_ids, align, num_experts,
                                                        validate_ids=validate_ids)
    segment_starts, segment_counts = _segments(topk_ids, num_experts, align)
    if not use_triton(hidden_states, topk_ids, rows):
        m_indices, src2dst = _permute_rows_reference(hidden_states, sorted_ids, block_experts,
                                                     rows, topk, align)
        return PermutedRows(rows, m_indices, src2dst, segment_starts, segment_counts)
    m_indices = torch.empty(num_rows, dtype=torch.int32, device=device)
    src2dst = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    block_rows, block_d = 16, min(triton.next_power_of_2(hidden_size), 256)
    _permute_rows_kernel[(triton.cdiv(num_rows, block_rows),)](
        hidden_states, hidden_states.stride(0), hidden_states.stride(1),
        sorted_ids, block_experts,
        rows, rows.stride(0), rows.stride(1),
        m_indices, src2dst,
        num_rows, num_assignments, topk, hidden_size, align,
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=4,
    )
    return PermutedRows(rows, m_indices, src2dst, segment_starts, segment_counts)


def _permute_rows_reference(hidden_states, sorted_ids, block_experts, rows, topk, align):
    """Torch reference of the scatter kernel: fills ``rows``; returns ``(m_indices, src2dst)``."""
    num_rows = rows.shape[0]
    num_assignments = hidden_states.shape[0] * topk
    assignment = sorted_ids[:num_rows].to(torch.int64)
    real = assignment < num_assignments
    row_index = torch.arange(num_rows, device=rows.device)
    m_indices = torch.where(real, block_experts.to(torch.int64)[row_index // align], -1)
    rows[real] = hidden_states[assignment[real] // topk]
    src2dst = torch.full((num_assignments,), -1, dtype=torch.int32, device=rows.device)
    src2dst[assignment[real]] = row_index[real].to(torch.int32)
    return m_indices.to(torch.int32), src2dst.view(-1, topk)


def permute_reference(hidden_states, topk_ids, num_experts, align=128):
    """Torch reference for :func:`permute` (same outputs; padding rows are zero here)."""
    _check_permute_args("permute", hidden_states, topk_ids, num_experts, align)
    topk = topk_ids.shape[1]
    num_rows = max_padded_rows(topk_ids.numel(), num_experts, align)
    rows = hidden_states.new_zeros(num_rows, hidden_states.shape[1])
    sorted_ids, block_experts, _ = moe_align_block_size_reference(topk_ids, align, num_experts)
    m_indices, src2dst = _permute_rows_reference(hidden_states, sorted_ids, block_experts, rows,
                                                 topk, align)
    return PermutedRows(rows, m_indices, src2dst, *_segments(topk_ids, num_experts, align))


# --------------------------------------------------------------------------------------------
# the grouped GEMM over contiguous segments
# --------------------------------------------------------------------------------------------


def gemm_output_width(func: str, w: torch.Tensor, silu_mul: bool) -> int:
    """Output columns of a grouped GEMM: ``N_w``, or ``N_w/2`` when SiLU·mul halves it."""
    if not silu_mul:
        return w.shape[1]
    if w.shape[1] % 2:
        fail(func, "w", "must have an even number of rows [gate | up] when silu_mul=True",
             f"shape {tuple(w.shape)}")
    return w.shape[1] // 2


def grouped_gemm_contiguous(
    x: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    align: int,
    *,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``out[r] = x[r] @ w[m_indices[r]]^T`` for every row with ``m_indices[r] >= 0``.

    ``x`` ``[M_pad, K]`` holds ``align``-aligned expert segments (from :func:`permute`), ``w``
    ``[E, N_w, K]``. Returns ``[M_pad, N_w]``, or ``[M_pad, N_w/2]`` holding
    ``silu(gate) * up`` when ``silu_mul`` (``w`` = ``w1``, gate rows then up rows). Rows with
    ``m_indices == -1`` are not read and not written (``out`` keeps what it held there).
    Under the CPU interpreter, bf16 runs in float32 and is rounded to bf16 once at the end.
    """
    func = "grouped_gemm_contiguous"
    check_tensor(func, "x", x, ndim=2, dtypes=COMPUTE_DTYPES)
    check_tensor(func, "w", w, ndim=3, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
    check_tensor(func, "m_indices", m_indices, ndim=1, dtypes=(torch.int32,), device=x.device,
                 contiguous=True)
    check_int(func, "align", align, lo=1)
    num_rows, k = x.shape
    if w.shape[2] != k:
        fail(func, "w", f"must have shape [E, N, {k}] to match x", f"shape {tuple(w.shape)}")
    if m_indices.shape[0] != num_rows or num_rows % align:
        fail(func, "m_indices", f"must have one entry per row of x ({num_rows}, a multiple of "
             f"align={align})", f"shape {tuple(m_indices.shape)}")
    n = gemm_output_width(func, w, silu_mul)
    config = check_tile_config(func, config or default_tile_config(x.dtype, align), align)
    result = check_out(func, out, (num_rows, n), x.dtype, x.device)
    if result is None:
        result = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if not use_triton(x, w, m_indices, result):
        return _grouped_gemm_contiguous_reference(x, w, m_indices, silu_mul, result)
    if interpreter_cannot_dot(x.dtype, x.device):
        wide = result.float()
        grouped_gemm_contiguous(x.float(), w.float(), m_indices, align, silu_mul=silu_mul,
                                out=wide, config=config)
        return result.copy_(wide)
    grid = (num_rows // config.block_m, triton.cdiv(n, config.block_n))
    _contiguous_gemm_kernel[grid](
        x, x.stride(0), x.stride(1),
        w, w.stride(0), w.stride(1), w.stride(2),
        result, result.stride(0), result.stride(1),
        m_indices, num_rows, n, k,
        SILU_MUL=silu_mul, INPUT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return result


def expert_rows_product(x_rows: torch.Tensor, w_expert: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    """Torch reference of one expert's tile product, in float32 like the kernels' accumulators."""
    h = x_rows.float() @ w_expert.float().T
    if silu_mul:
        gate, up = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
    return h


def _grouped_gemm_contiguous_reference(x, w, m_indices, silu_mul, out):
    for e in range(w.shape[0]):
        rows = m_indices == e
        out[rows] = expert_rows_product(x[rows], w[e], silu_mul).to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------
# unpermute
# --------------------------------------------------------------------------------------------


def unpermute(
    y_rows: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * y_rows[src2dst[t, j]]``, in float32, cast once.

    ``y_rows`` ``[R, d]`` (any layout whose rows ``src2dst`` names: the packed segments here,
    the flattened ``[E*m_max, d]`` masked buffer in ``masked.py``); returns ``[T, d]`` in
    ``y_rows.dtype``. ``src2dst`` must come from :func:`permute` or
    :func:`moe_kernels.masked.masked_dispatch`: its rows are trusted, not checked (that would cost
    a host sync); a negative row means "no row" and adds nothing.
    """
    func = "unpermute"
    check_tensor(func, "y_rows", y_rows, ndim=2, dtypes=COMPUTE_DTYPES)
    check_tensor(func, "src2dst", src2dst, ndim=2, dtypes=(torch.int32,), device=y_rows.device,
                 contiguous=True)
    check_tensor(func, "topk_weights", topk_weights, ndim=2, dtypes=ROUTING_WEIGHT_DTYPES,
                 device=y_rows.device, last_dim_contiguous=True)
    if topk_weights.shape != src2dst.shape:
        fail(func, "topk_weights", f"must have the shape of src2dst {tuple(src2dst.shape)}",
             f"shape {tuple(topk_weights.shape)}")
    num_tokens, topk = src2dst.shape
    hidden_size = y_rows.shape[1]
    result = check_out(func, out, (num_tokens, hidden_size), y_rows.dtype, y_rows.device)
    if result is None:
        result = torch.empty(num_tokens, hidden_size, dtype=y_rows.dtype, device=y_rows.device)
    if not use_triton(y_rows, src2dst, topk_weights, result):
        return result.copy_(unpermute_reference(y_rows, src2dst, topk_weights))
    block_d = min(triton.next_power_of_2(hidden_size), 512)
    _unpermute_kernel[(num_tokens, triton.cdiv(hidden_size, block_d))](
        y_rows, y_rows.stride(0), y_rows.stride(1),
        src2dst, topk_weights, topk_weights.stride(0), topk_weights.stride(1),
        result, result.stride(0), result.stride(1),
        topk, hidden_size,
        BLOCK_TOPK=triton.next_power_of_2(topk), BLOCK_D=block_d, num_warps=4,
    )
    return result


def unpermute_reference(y_rows, src2dst, topk_weights):
    """Torch reference for :func:`unpermute`."""
    present = src2dst >= 0
    gathered = y_rows[src2dst.to(torch.int64).clamp(min=0)].float()
    weights = torch.where(present, topk_weights.float(), 0.0)
    return (gathered * weights[..., None]).sum(dim=1).to(y_rows.dtype)


# --------------------------------------------------------------------------------------------
# the whole experts step
# --------------------------------------------------------------------------------------------


def permute_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    align: int = 128,
    config: TileConfig | None = None,
    validate_ids: bool = True,
) -> torch.Tensor:
    """The MoE experts step in the contiguous layout: permute, two grouped GEMMs, unpermute.

    Same arguments and result as vLLM's ``fused_experts`` (``w1`` ``[E, 2F, d]``, ``w2``
    ``[E, d, F]``): ``[T, d]`` in ``hidden_states.dtype``. No host sync on the GPU when
    ``validate_ids=False`` (see :func:`permute`). Live intermediates: ``[M_pad, d]`` and
    ``[M_pad, F]`` (GEMM2 writes into the packed input, which GEMM1 has finished with).
    """
    func = "permute_experts"
    _, _, num_experts, _, _ = check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids)
    check_int(func, "align", align, lo=1)
    config = check_tile_config(func, config or default_tile_config(hidden_states.dtype, align),
                               align)
    permuted = permute(hidden_states, topk_ids, num_experts, align, validate_ids=validate_ids)
    activated = grouped_gemm_contiguous(permuted.rows, w1, permuted.m_indices, align,
                                        silu_mul=True, config=config)
    y = grouped_gemm_contiguous(activated, w2, permuted.m_indices, align, out=permuted.rows,
                                config=config)
    return unpermute(y, permuted.src2dst, topk_weights)


def _grouped_mm():
    """``torch.nn.functional.grouped_mm`` (public where it exists), else ``torch._grouped_mm``."""
    op = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if op is None:
        raise NotImplementedError(
            f"torch_grouped_mm_experts: torch {torch.__version__} has no grouped_mm "
            "(torch._grouped_mm appeared in 2.8); use permute_experts instead")
    return op


def torch_grouped_mm_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    align: int = 128,
    validate_ids: bool = True,
) -> torch.Tensor:
    """:func:`permute_experts` with PyTorch's grouped GEMM in place of ours: the baseline.

    ``grouped_mm`` takes the packed rows plus ``offs`` (int32 cumulative segment ends), so the
    padded segments go in as they are; its padding rows compute garbage that nobody reads.
    SiLU·mul is a separate torch op here, on a materialised ``[M_pad, 2F]``. PyTorch's fast path
    is bf16 on sm90 (torch >= 2.8); other dtype/device pairs run only where that torch build
    implements them (recent CPU builds do). Where it does not, this raises NotImplementedError.
    """
    func = "torch_grouped_mm_experts"
    _, _, num_experts, _, _ = check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids)
    check_int(func, "align", align, lo=1)
    grouped_mm = _grouped_mm()
    permuted = permute(hidden_states, topk_ids, num_experts, align, validate_ids=validate_ids)
    padded = (permuted.segment_counts + align - 1) // align * align
    offs = torch.cumsum(padded, 0, dtype=torch.int32)
    try:
        gate_up = grouped_mm(permuted.rows, w1.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        y = grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    except RuntimeError as err:
        raise NotImplementedError(
            f"{func}: this torch build ({torch.__version__}) has no grouped_mm for "
            f"{hidden_states.dtype} on {hidden_states.device}: {err}") from err
    return unpermute(y, permuted.src2dst, topk_weights)

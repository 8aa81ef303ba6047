"""Permute: copy every assignment's row into its expert's contiguous, aligned segment.

The index-gather layout (:mod:`moe_kernels.kernels.index_gather`) leaves the activations where they are and lets each
GEMM tile gather its rows through an index list. This module is the other answer, the one SGLang
uses in front of DeepGEMM's ``m_grouped_*_gemm_nt_contiguous``: physically copy the rows so that
each expert owns one contiguous segment of a packed buffer, every segment starting on an
``align``-row boundary (DeepGEMM wants 128). A GEMM tile then covers rows of one expert only and
reads them with plain strided loads; the price is the copy in (``permute``) and the copy back
(:func:`moe_kernels.kernels.combine.unpermute`), which
:func:`moe_kernels.model.buffers.permute_copy_bytes` counts.

The pipeline, each step a Triton kernel with a torch reference beside it:

1. :func:`permute` - where the rows go is exactly what :func:`moe_kernels.kernels.align.moe_align_block_size`
   computes with ``block_size=align``: its ``sorted_token_ids`` *is* the permutation (row ``r`` of
   the packed buffer holds assignment ``sorted_token_ids[r]``, or padding when that is the
   sentinel ``numel``). So alignment is reused, not redone, and one scatter kernel copies the rows
   and writes ``m_indices`` (expert of each row, -1 on padding, DeepGEMM's convention) and
   ``src2dst`` (row of each assignment, SGLang's name).
2. :func:`grouped_gemm_contiguous` - ``[M_pad, K] x w[e]^T`` where each ``BLOCK_M`` tile belongs to
   one expert, read from ``m_indices``; tiles of padding exit at once and padding rows are never
   stored. The tile product is the core every layout shares (:mod:`moe_kernels.kernels._tile_gemm`). With ``silu_mul=True`` it computes the gate and up halves of ``w1`` together
   and stores only ``silu(gate) * up``, so the ``[M_pad, 2F]`` intermediate never exists.
3. :func:`~moe_kernels.kernels.combine.unpermute` - gathers each token's ``k`` rows, multiplies by the routing weights in
   float32, sums, and casts once (SGLang's ``post_reorder_deepgemm_triton_kernel`` does the same;
   sgl-project/sglang ``python/sglang/kernels/ops/moe/ep_moe_kernels.py``). Or, with
   ``config.sum_in_gemm``, GEMM 2 does it in its epilogue: each row times its routing weight,
   added with fp32 atomics into its token's row (``PermutedRows.row_assignments`` says which), so
   neither GEMM 2's ``[M_pad, d]`` output nor the pass that reads it back exists.

With ``tiles.persistent`` the GEMMs run one program per SM, which walks only the tiles of the
rows the segments use (``PermutedRows.rows_used``, read on the device).

:func:`permute_experts` chains them with no host synchronisation on the GPU: every size comes from
the shapes, and the id check (``validate_ids``, on by default) is a device-side assert. Ids out of
range, checked or not, land in no segment, keep ``src2dst = -1`` and add nothing (SGLang's gather
skips ``dst < 0`` the same way), so no kernel touches memory out of bounds. The packed buffer has
:func:`~moe_kernels.model.buffers.max_padded_rows` rows, the most any routing of ``T*k``
assignments can need (SGLang's ``_get_compact_all_tokens``), which is at most vLLM's
``numel + E*(align-1)`` and far less when ``T*k`` is small. :func:`moe_kernels.bench.baselines.torch_grouped_mm_experts`
runs the same permute/unpermute around ``torch.nn.functional.grouped_mm`` as a baseline.

A worked example: three tokens, ``k = 2``, three experts, segments aligned to 4 rows::

    >>> import torch
    >>> from moe_kernels.kernels.combine import unpermute
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> ids = torch.tensor([[1, 0], [1, 2], [0, 1]])   # expert 0: 2 rows, 1: 3 rows, 2: 1 row
    >>> p = permute(x, ids, 3, align=4)
    >>> p.m_indices.tolist()                           # 4-row segments, padding marked -1
    [0, 0, -1, -1, 1, 1, 1, -1, 2, -1, -1, -1]
    >>> p.segment_starts.tolist(), p.segment_counts.tolist()
    ([0, 4, 8], [2, 3, 1])
    >>> torch.equal(p.rows[p.src2dst[1, 1]], x[1])      # token 1's second choice went to expert 2
    True
    >>> torch.equal(unpermute(p.rows, p.src2dst, torch.full((3, 2), 0.5)), x)   # the round trip
    True
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import check_dispatch_inputs, check_int, check_moe_inputs, check_tensor, fail
from .._runtime import HAS_TRITON, cdiv, kernel, next_power_of_2, note_launch, tl, use_triton
from ..model.buffers import expert_counts, max_padded_rows
from ._tile_gemm import (check_operands, check_out, dequantized, dot_precision, expert_rows_product, gemm_width,
                         in_float32_under_interpreter, output_dtype, programs_per_device, rows_descriptor,
                         weight_descriptor)
from .align import align_checked, moe_align_block_size_reference
from .combine import unpermute
from .config import MoEConfig, check_config, get_config
from .formats import WeightFormat

if HAS_TRITON:
    from ._tile_gemm import add_tile, expert_tile_product, scale_rows, store_tile, tile_position

    # >>> book: permute-scatter
    @kernel
    def copy_rows(src_ptr, src_rows, dst_ptr, dst_rows, row_mask, width, BLOCK_D: tl.constexpr):
        """Copy ``width`` elements of each row at element offset ``src_rows`` to ``dst_rows``
        (rows outside ``row_mask`` untouched): the data movement of every dispatch."""
        for d0 in range(0, width, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = row_mask[:, None] & (cols < width)[None, :]
            values = tl.load(src_ptr + src_rows[:, None] + cols[None, :], mask=mask)
            tl.store(dst_ptr + dst_rows[:, None] + cols[None, :], values, mask=mask)

    @kernel
    def _permute_rows_kernel(
        hidden_ptr, stride_ht, sorted_ids_ptr, block_experts_ptr, rows_ptr, stride_rm,
        m_indices_ptr, src2dst_ptr, num_rows, num_assignments, topk, hidden_size, align,
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
        copy_rows(hidden_ptr, (assignment // topk).to(tl.int64) * stride_ht, rows_ptr, rows.to(tl.int64) * stride_rm,
                  real, hidden_size, BLOCK_D)
    # <<< book: permute-scatter

    @kernel
    def _contiguous_tile(
        pid_m, pid_n, split, a_ptr, stride_am, w_ptr, stride_we, stride_wn, out_ptr, stride_om,
        m_indices_ptr, num_rows, num_experts, N, K,
        a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
        GATED: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCALES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
        w_desc, TMA_W: tl.constexpr, a_desc, TMA_A: tl.constexpr, SWAP_AB: tl.constexpr,
        row_assign_ptr, topk_weights_ptr, SUM_TOP_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):
        """Tile (``pid_m``, ``pid_n``), K slice ``split``, of the contiguous grouped GEMM: stored
        row for row, or (``SUM_TOP_K`` = k) times each row's routing weight and added into its
        token's row of an fp32 ``[T, N]`` output (the top-k sum in GEMM 2's epilogue)."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_experts = tl.load(m_indices_ptr + rows, mask=rows < num_rows, other=-1)
        # A tile lies inside one segment (BLOCK_M divides align), so its real rows share one
        # expert and its padding rows are -1. A tile of padding, or one naming an expert that does
        # not exist, has nothing to do: an id is never used as an address unchecked.
        expert = tl.max(row_experts, axis=0)
        if (expert >= 0) & (expert < num_experts):
            # A segment's real rows come first, so the tile's first row is real: padding rows read
            # it (loads need no row mask, and never see the buffer's unwritten garbage) and are not
            # stored. Through the copy engine (TMA_A) a tile reads its rows as they are, padding
            # included: a row of the product depends on its own row of A only, and padding rows
            # are never stored.
            row_real = row_experts == expert
            offsets = rows.to(tl.int64)
            a_rows = tl.where(row_real, offsets, pid_m * BLOCK_M) * stride_am
            acc = expert_tile_product(a_ptr, a_rows, w_ptr + expert.to(tl.int64) * stride_we,
                                      stride_wn, pid_n, N, K,
                                      a_scale_ptr, tl.where(row_real, offsets, pid_m * BLOCK_M) * stride_as,
                                      w_scale_ptr + expert.to(tl.int64) * stride_wse, stride_wsn, stride_wsk,
                                      GATED, EVEN_K, INPUT_PRECISION, SCALES, BLOCK_M, BLOCK_N, BLOCK_K,
                                      split=split, SPLIT_K=SPLIT_K,
                                      w_desc=w_desc, w_desc_row=(expert * (N * (1 + GATED)) + pid_n * BLOCK_N)
                                      .to(tl.int32), TMA_W=TMA_W, SCALE_BN=SCALE_BN, SCALE_BK=SCALE_BK,
                                      SWAP_AB=SWAP_AB, a_desc=a_desc, a_desc_row=pid_m * BLOCK_M, TMA_A=TMA_A)
            if SUM_TOP_K == 0:
                store_tile(out_ptr, offsets * stride_om, row_real, acc, pid_n, N, BLOCK_N)
            else:
                # Row r holds assignment a = (token a // k, slot a % k): the scatter-add that
                # replaces the unpermute pass (its [M_pad, N] write and [T*k, N] read).
                assignments = tl.load(row_assign_ptr + rows, mask=row_real, other=0)
                acc = scale_rows(acc, topk_weights_ptr, assignments, row_real)
                add_tile(out_ptr, (assignments // SUM_TOP_K).to(tl.int64) * stride_om, row_real, acc, pid_n, N,
                         BLOCK_N)

    @kernel
    def _contiguous_gemm_kernel(
        a_ptr, stride_am, w_ptr, stride_we, stride_wn, out_ptr, stride_om,
        m_indices_ptr, num_rows, num_experts, N, K,
        a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
        GATED: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCALES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
        w_desc, TMA_W: tl.constexpr, a_desc, TMA_A: tl.constexpr, SWAP_AB: tl.constexpr,
        rows_used_ptr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
        row_assign_ptr, topk_weights_ptr, SUM_TOP_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):
        if PERSISTENT == 0:
            # One program per tile (and K slice) of the whole buffer. Axis 0 (M tiles) varies
            # fastest, so consecutive programs are consecutive tiles of the same expert and find
            # that expert's weight tile in L2; tiles past the last segment exit at once.
            _contiguous_tile(tl.program_id(0), tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K,
                             a_ptr, stride_am, w_ptr, stride_we, stride_wn,
                             out_ptr, stride_om, m_indices_ptr, num_rows, num_experts, N, K,
                             a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                             GATED, EVEN_K, INPUT_PRECISION, SCALES, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN, SCALE_BK,
                             w_desc, TMA_W, a_desc, TMA_A, SWAP_AB, row_assign_ptr, topk_weights_ptr, SUM_TOP_K,
                             SPLIT_K)
        else:
            # One program per SM, walking only the tiles of the rows the segments use (their
            # padded total, which the alignment wrote on the device: no host sync), GROUP_M
            # M-blocks down one N-tile at a time. The buffer's spare tail, sized for the worst
            # routing, costs nothing. (2: the tile and K loops flattened into one pipeline.)
            num_m_blocks = tl.minimum(tl.load(rows_used_ptr), num_rows) // BLOCK_M
            num_tiles = num_m_blocks * tl.cdiv(N, BLOCK_N) * SPLIT_K
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=PERSISTENT == 2):
                pid_m, pid_n, split = tile_position(tile, num_m_blocks, N, BLOCK_N, GROUP_M, SPLIT_K)
                _contiguous_tile(pid_m, pid_n, split, a_ptr, stride_am, w_ptr, stride_we, stride_wn,
                                 out_ptr, stride_om, m_indices_ptr, num_rows, num_experts, N, K,
                                 a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                                 GATED, EVEN_K, INPUT_PRECISION, SCALES, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN,
                                 SCALE_BK, w_desc, TMA_W, a_desc, TMA_A, SWAP_AB, row_assign_ptr, topk_weights_ptr,
                                 SUM_TOP_K, SPLIT_K)


class PermutedRows(NamedTuple):
    """The contiguous layout: what :func:`permute` returns.

    * ``rows`` ``[M_pad, d]``: expert ``e``'s rows are ``rows[segment_starts[e] :
      segment_starts[e] + segment_counts[e]]``; padding rows are left unwritten (whatever the
      buffer held) and nothing that is stored depends on them.
    * ``m_indices`` int32 ``[M_pad]``: the expert of each row, -1 on padding rows.
    * ``src2dst`` int32 ``[T, k]``: the row that holds assignment ``(t, j)`` (-1 for an
      out-of-range id left unvalidated, which no segment holds).
    * ``segment_starts`` int32 ``[E]``: first row of each segment, a multiple of ``align``.
    * ``segment_counts`` int32 ``[E]``: real rows in each segment (tokens routed to the expert).
    * ``rows_used`` int32 ``[1]``: the rows the segments span, padding included (the alignment's
      ``num_tokens_post_padded``); rows past it belong to no segment. It stays on the device: a
      persistent GEMM reads it there to walk only these rows' tiles.
    * ``row_assignments`` int32 ``[M_pad]``: the assignment each row holds (``t * k + j``), ``T*k``
      on padding rows: the inverse of ``src2dst``, by which GEMM 2 can add each row into its token.
    """

    rows: torch.Tensor
    m_indices: torch.Tensor
    src2dst: torch.Tensor
    segment_starts: torch.Tensor
    segment_counts: torch.Tensor
    rows_used: torch.Tensor
    row_assignments: torch.Tensor


def _segments(topk_ids: torch.Tensor, num_experts: int, align: int):
    """Aligned segment starts and real row counts per expert, without leaving the device."""
    counts = expert_counts(topk_ids, num_experts)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    return starts.to(torch.int32), counts


def _check_permute_args(func, hidden_states, topk_ids, num_experts, align):
    check_dispatch_inputs(func, hidden_states, topk_ids, num_experts)
    check_int(func, "align", align, lo=1)


def permute(hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, align: int = 128,
            out: torch.Tensor | None = None, validate_ids: bool = True) -> PermutedRows:
    """Copy each assignment's activation row into its expert's ``align``-row-aligned segment.

    ``hidden_states`` ``[T, d]``, ``topk_ids`` ``[T, k]`` (0-based expert ids). ``out``, if given,
    is the ``[max_padded_rows(T*k, E, align), d]`` buffer to fill. ``validate_ids`` checks the ids
    as :func:`moe_kernels.kernels.index_gather.fused_experts` does (on a GPU inside the alignment
    kernel, which reads every id anyway: no launch, no host sync).
    """
    func = "permute"
    _check_permute_args(func, hidden_states, topk_ids, num_experts, align)
    num_tokens, hidden_size = hidden_states.shape
    topk = topk_ids.shape[1]
    num_assignments = num_tokens * topk
    num_rows = max_padded_rows(num_assignments, num_experts, align)
    rows = check_out(func, out, (num_rows, hidden_size), hidden_states)
    sorted_ids, block_experts, rows_used = align_checked(func, topk_ids, align, num_experts, validate_ids)
    segment_starts, segment_counts = _segments(topk_ids, num_experts, align)
    if not use_triton(hidden_states, topk_ids, rows):
        m_indices, src2dst = _permute_rows_reference(hidden_states, sorted_ids, block_experts, rows, topk, align)
        return PermutedRows(rows, m_indices, src2dst, segment_starts, segment_counts, rows_used,
                            sorted_ids[:num_rows])
    m_indices = torch.empty(num_rows, dtype=torch.int32, device=rows.device)
    src2dst = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=rows.device)
    if num_rows:
        block_rows, block_d = 16, min(next_power_of_2(max(hidden_size, 1)), 256)
        _permute_rows_kernel[(cdiv(num_rows, block_rows),)](
            hidden_states, hidden_states.stride(0), sorted_ids, block_experts, rows, rows.stride(0),
            m_indices, src2dst, num_rows, num_assignments, topk, hidden_size, align,
            BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=4,
        )
    return PermutedRows(rows, m_indices, src2dst, segment_starts, segment_counts, rows_used, sorted_ids[:num_rows])


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


def permute_reference(hidden_states, topk_ids, num_experts, *, align=128):
    """Torch reference for :func:`permute` (same outputs; padding rows are zero here)."""
    _check_permute_args("permute", hidden_states, topk_ids, num_experts, align)
    topk = topk_ids.shape[1]
    num_rows = max_padded_rows(topk_ids.numel(), num_experts, align)
    rows = hidden_states.new_zeros(num_rows, hidden_states.shape[1])
    sorted_ids, block_experts, rows_used = moe_align_block_size_reference(topk_ids, align, num_experts)
    m_indices, src2dst = _permute_rows_reference(hidden_states, sorted_ids, block_experts, rows, topk, align)
    return PermutedRows(rows, m_indices, src2dst, *_segments(topk_ids, num_experts, align), rows_used,
                        sorted_ids[:num_rows])


def grouped_gemm_contiguous(x: torch.Tensor, w: torch.Tensor, m_indices: torch.Tensor, *, align: int,
                            silu_mul: bool = False, out: torch.Tensor | None = None,
                            config: MoEConfig | None = None, which: str = "gate_up",
                            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None, rows_used: torch.Tensor | None = None,
                            sum_slots: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``out[r] = x[r] @ w[m_indices[r]]^T`` for every row whose ``m_indices`` is in ``[0, E)``.

    ``x`` ``[M_pad, K]`` holds ``align``-aligned expert segments (from :func:`permute`), ``w``
    ``[E, N_w, K]``. Returns ``[M_pad, N_w]``, or ``[M_pad, N_w/2]`` holding ``silu(gate) * up``
    when ``silu_mul`` (``w`` = ``w1``, gate rows then up rows). Other rows are not written (``out``
    keeps what it held there). ``which`` picks the GEMM tiles of ``config`` (``gate_up``/``down``).
    fp8 operands come with ``x_scale`` (per row of ``x``) and ``w_scale`` and write ``out_dtype``.
    ``rows_used`` (:attr:`PermutedRows.rows_used`, on the device) lets a persistent grid
    (``tiles.persistent``) skip the buffer's rows past the last segment; without it every row's
    tile is visited. ``sum_slots`` = ``(row_assignments, topk_weights)`` (GEMM 2 only: from
    :class:`PermutedRows` and the router) makes it the top-k sum as well: each row times its
    routing weight is added into its token's row of ``out``, an fp32 ``[T, N_w]`` buffer the caller
    has zeroed (with ``config.down.split_k`` > 1 each K slice adds its part).
    """
    func = "grouped_gemm_contiguous"
    fmt = check_operands(func, "x", x, "w", w, x_scale, w_scale)
    check_tensor(func, "m_indices", m_indices, ndim=1, dtypes=(torch.int32,), device=x.device, contiguous=True)
    check_int(func, "align", align, lo=1)
    num_rows, k = x.shape
    if w.shape[2] != k:
        fail(func, "w", f"must have shape [E, N, {k}] to match x", f"shape {tuple(w.shape)}")
    if m_indices.shape[0] != num_rows or num_rows % align:
        fail(func, "m_indices", f"must have one entry per row of x ({num_rows}, a multiple of align={align})",
             f"shape {tuple(m_indices.shape)}")
    n = gemm_width(func, w, silu_mul)
    if rows_used is not None:
        check_tensor(func, "rows_used", rows_used, ndim=1, dtypes=(torch.int32,), device=x.device)
        if rows_used.shape[0] != 1:
            fail(func, "rows_used", "must hold one count (PermutedRows.rows_used)", f"shape {tuple(rows_used.shape)}")
    if config is None:
        config = get_config(num_rows, w.shape[0], n, k, output_dtype(x, out_dtype), x.device, layout="permute",
                            align=align)
    if which not in ("gate_up", "down"):
        fail(func, "which", "must be 'gate_up' or 'down'", repr(which))
    tiles = fmt.gemm_tiles(getattr(check_config(func, config, align=align, layout="permute"), which))
    top_k = 0
    if sum_slots is None:
        if tiles.split_k != 1:
            fail(func, "config.down.split_k", "must be 1 unless GEMM 2 sums the slots (sum_slots given)",
                 tiles.split_k)
        result = check_out(func, out, (num_rows, n), x, dtype=output_dtype(x, out_dtype))
    else:
        row_assignments, topk_weights = _check_sum_slots(func, sum_slots, num_rows, x.device, silu_mul)
        top_k = topk_weights.shape[1]
        if out is None:
            fail(func, "out", "must be the zeroed fp32 [T, N] buffer GEMM 2 adds into when sum_slots is given", None)
        result = check_out(func, out, (topk_weights.shape[0], n), x, dtype=torch.float32)
    if not use_triton(x, w, m_indices, result):
        xf, wf = dequantized(x, w, x_scale, w_scale, fmt)
        if sum_slots is not None:
            return _summed_contiguous_reference(xf, wf, m_indices, row_assignments, topk_weights, result)
        return _grouped_gemm_contiguous_reference(xf, wf, m_indices, silu_mul, result)
    rerun = lambda x, w, out: grouped_gemm_contiguous(  # noqa: E731
        x, w, m_indices, align=align, silu_mul=silu_mul, out=out, config=config, which=which, x_scale=x_scale,
        w_scale=w_scale, out_dtype=out.dtype, rows_used=rows_used, sum_slots=sum_slots)
    if num_rows == 0 or in_float32_under_interpreter(rerun, result, x, w) is not None:
        return result
    scales = fmt.scale_arguments(x, w, x_scale, w_scale)
    # Contiguous rows: with tiles.tma both operands come through the copy engine (TMA), not only
    # the weights as in the index-gather layout, whose gathered rows cannot (gather is Blackwell's).
    w_desc, a_desc = weight_descriptor(w, tiles), rows_descriptor(x, config.block_m, tiles)
    num_m_blocks, num_n_tiles = num_rows // config.block_m, cdiv(n, tiles.block_n) * tiles.split_k
    if tiles.persistent:
        grid = (min(num_m_blocks * num_n_tiles, programs_per_device(x.device)),)
        if rows_used is None:   # (every row's tile, as the one-program-per-tile grid visits)
            rows_used = torch.full((1,), num_rows, dtype=torch.int32, device=x.device)
    else:
        grid = (num_m_blocks, num_n_tiles)
    note_launch("permute.gemm", gemm=which, block_m=config.block_m, tiles=tiles, scales=scales[6],
                tma_w=w_desc is not None, tma_a=a_desc is not None, grid=grid)
    _contiguous_gemm_kernel[grid](
        x, x.stride(0), w, w.stride(0), w.stride(1), result, result.stride(0),
        m_indices, num_rows, w.shape[0], n, k, *scales[:6],
        GATED=silu_mul, EVEN_K=k % tiles.block_k == 0, INPUT_PRECISION=dot_precision(x.dtype), SCALES=scales[6],
        BLOCK_M=config.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SCALE_BN=scales[7], SCALE_BK=scales[8],
        w_desc=w if w_desc is None else w_desc, TMA_W=w_desc is not None, a_desc=x if a_desc is None else a_desc,
        TMA_A=a_desc is not None, SWAP_AB=tiles.swap_ab,
        rows_used_ptr=m_indices if rows_used is None else rows_used, GROUP_M=tiles.group_m,
        PERSISTENT=tiles.persistent, row_assign_ptr=m_indices if sum_slots is None else row_assignments,
        topk_weights_ptr=result if sum_slots is None else topk_weights, SUM_TOP_K=top_k, SPLIT_K=tiles.split_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return result


def _check_sum_slots(func, sum_slots, num_rows, device, silu_mul):
    if silu_mul:
        fail(func, "sum_slots", "must be None for GEMM 1 (the top-k sum follows GEMM 2)", "given")
    if not isinstance(sum_slots, tuple) or len(sum_slots) != 2:
        fail(func, "sum_slots", "must be (row_assignments, topk_weights)", type(sum_slots).__name__, TypeError)
    row_assignments, topk_weights = sum_slots
    check_tensor(func, "sum_slots[0]", row_assignments, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    if row_assignments.shape[0] != num_rows:
        fail(func, "sum_slots[0]", f"must hold one assignment per row of x ({num_rows}: PermutedRows.row_assignments)",
             f"shape {tuple(row_assignments.shape)}")
    check_tensor(func, "sum_slots[1]", topk_weights, ndim=2, device=device, contiguous=True)
    return row_assignments, topk_weights


def _summed_contiguous_reference(x, w, m_indices, row_assignments, topk_weights, out):
    """Torch reference of GEMM 2 with the top-k sum: each real row, weighted, added into its token."""
    top_k = topk_weights.shape[1]
    for e in range(w.shape[0]):
        rows = m_indices == e
        assignment = row_assignments[rows].to(torch.int64)
        weighted = expert_rows_product(x[rows], w[e], False) * topk_weights.flatten()[assignment, None].float()
        out.index_add_(0, assignment // top_k, weighted.to(out.dtype))
    return out


def _grouped_gemm_contiguous_reference(x, w, m_indices, silu_mul, out):
    for e in range(w.shape[0]):
        rows = m_indices == e
        out[rows] = expert_rows_product(x[rows], w[e], silu_mul).to(out.dtype)
    return out


def permute_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, align: int = 128, config: MoEConfig | None = None,
                    validate_ids: bool = True, w1_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE experts step in the contiguous layout: permute, two grouped GEMMs, unpermute.

    Same arguments and result as :func:`moe_kernels.kernels.index_gather.fused_experts` (fp8
    weights included: the permute then copies fp8 rows, half the bytes, and their scales): ``[T, d]``
    in ``hidden_states.dtype``. No host sync on the GPU. Live intermediates: ``[M_pad, d]`` and
    ``[M_pad, F]`` (GEMM 2 writes into the packed input, which GEMM 1 has finished with).
    """
    func = "permute_experts"
    num_tokens, _, num_experts, d, f = check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids)
    check_int(func, "align", align, lo=1)
    fmt = WeightFormat.of_pair(func, w1, w2, w1_scale, w2_scale)
    if config is None:
        if align % 16:
            fail(func, "align", "must be a multiple of 16 (the smallest M tile) for the default tiles", align)
        config = get_config(num_tokens, num_experts, f, d, w1.dtype, hidden_states.device, layout="permute",
                            align=align)
    check_config(func, config, align=align, layout="permute")
    if not fmt.quantized:
        permuted = permute(hidden_states, topk_ids, num_experts, align=align, validate_ids=validate_ids)
        activated = grouped_gemm_contiguous(permuted.rows, w1, permuted.m_indices, align=align, silu_mul=True,
                                            config=config, which="gate_up", rows_used=permuted.rows_used)
        if config.sum_in_gemm:
            return _down_and_sum(activated, w2, permuted, topk_weights, config, align, hidden_states.dtype)
        y = grouped_gemm_contiguous(activated, w2, permuted.m_indices, align=align, out=permuted.rows,
                                    config=config, which="down", rows_used=permuted.rows_used)
        return unpermute(y, permuted.src2dst, topk_weights)
    x, x_scale = fmt.quantize_activations(hidden_states)
    permuted = permute(x, topk_ids, num_experts, align=align, validate_ids=validate_ids)
    rows_scale = _permute_scales(x_scale, permuted, topk_ids.shape[1])
    # Every activation scale is per row, so the padding rows' garbage reaches no real row's scale.
    activated = grouped_gemm_contiguous(permuted.rows, w1, permuted.m_indices, align=align, silu_mul=True,
                                        config=config, which="gate_up", x_scale=rows_scale, w_scale=w1_scale,
                                        out_dtype=hidden_states.dtype, rows_used=permuted.rows_used)
    a, a_scale = fmt.quantize_activations(activated)
    if config.sum_in_gemm:
        return _down_and_sum(a, w2, permuted, topk_weights, config, align, hidden_states.dtype, a_scale, w2_scale)
    y = grouped_gemm_contiguous(a, w2, permuted.m_indices, align=align, config=config, which="down",
                                x_scale=a_scale, w_scale=w2_scale, out_dtype=hidden_states.dtype,
                                rows_used=permuted.rows_used)
    return unpermute(y, permuted.src2dst, topk_weights)


def _down_and_sum(a, w2, permuted: PermutedRows, topk_weights, config, align, dtype, a_scale=None, w2_scale=None):
    """GEMM 2 adding each row, times its routing weight, into its token (``config.sum_in_gemm``):
    no ``[M_pad, d]`` output and no unpermute pass; one cast of the fp32 sums at the end."""
    summed = torch.zeros(topk_weights.shape[0], w2.shape[1], dtype=torch.float32, device=a.device)
    grouped_gemm_contiguous(a, w2, permuted.m_indices, align=align, config=config, which="down", x_scale=a_scale,
                            w_scale=w2_scale, out=summed, rows_used=permuted.rows_used,
                            sum_slots=(permuted.row_assignments, topk_weights))
    return summed.to(dtype)


def _permute_scales(x_scale: torch.Tensor, permuted: PermutedRows, topk: int) -> torch.Tensor:
    """The per-row activation scales in the packed rows' order."""
    rows = permuted.rows.shape[0]
    # Row r of the packed buffer holds assignment src2dst^-1(r); unmatched (padding) rows keep 1.
    packed = x_scale.new_ones((rows + 1,) + tuple(x_scale.shape[1:]))
    dst = permuted.src2dst.flatten().to(torch.int64)
    dst = torch.where(dst >= 0, dst, rows)   # an unvalidated bad id lands in the spare last row
    tokens = torch.arange(dst.numel(), device=dst.device) // topk
    packed.index_copy_(0, dst, x_scale[tokens])
    return packed[:rows]



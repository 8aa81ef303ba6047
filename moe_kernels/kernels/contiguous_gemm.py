"""The grouped GEMM over contiguous expert segments (the permute layout's GEMMs).

Rows of one expert sit together in an ``align``-aligned segment of a packed buffer
(:func:`moe_kernels.kernels.permute.permute` puts them there), so a ``BLOCK_M`` tile (``BLOCK_M``
divides ``align``) holds rows of one expert only, read with plain strided loads or, being
consecutive, through Hopper's copy engine (``tiles.tma``, both operands). A tile finds its expert
in ``m_indices`` (-1 on padding rows); tiles of padding exit at once and padding rows are never
stored. The tile product is the core every layout shares (:mod:`moe_kernels.kernels._tile_gemm`).

* GEMM 1 (``silu_mul=True``) computes the gate and up halves of ``w1`` together and stores only
  ``silu(gate) * up``, in the packed rows' order: GEMM 2's input is contiguous too.
* GEMM 2 stores its rows in the same order, or (``sum_slots``) multiplies each by its routing
  weight and adds it with fp32 atomics into its token's row of a ``[T, d]`` output: the top-k sum
  in the epilogue, K split over ``config.down.split_k`` programs if asked.
* ``tiles.persistent``: one program per SM walks only the tiles of the rows the segments use
  (``rows_used``, the alignment's padded total, read on the device), ``group_m`` M-blocks down
  one N-tile at a time so that an expert's weight tile is reused from L2.
* ``config.short_last_tile``: a segment's last tile with at most ``BLOCK_M / 2`` real rows is left
  by the full tiles' launch to a second launch of ``BLOCK_M / 2``-row tiles, which multiplies only
  its first half: a segment's rows are then computed rounded up to half a tile, not a whole one (at
  4,096 DeepSeek-V3 tokens in 128-row tiles, about 1.24 times the real rows instead of 1.48).

A worked example, two experts, segments of 16 rows::

    >>> import torch
    >>> from moe_kernels.kernels.config import GemmTiles, MoEConfig
    >>> x = torch.ones(32, 8)
    >>> w = torch.stack([torch.eye(8), 2 * torch.eye(8)])           # expert 1 doubles
    >>> m_indices = torch.tensor([0] * 3 + [-1] * 13 + [1] * 2 + [-1] * 14, dtype=torch.int32)
    >>> tiles = GemmTiles(16, 16)
    >>> out = grouped_gemm_contiguous(x, w, m_indices, align=16, config=MoEConfig(16, tiles, tiles),
    ...                               out=torch.zeros(32, 8))
    >>> out[[0, 2, 3, 16, 17, 18], 0].tolist()                       # padding rows untouched
    [1.0, 1.0, 0.0, 2.0, 2.0, 0.0]
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import FLOAT_DTYPES, check_int, check_tensor, fail
from .._runtime import HAS_TRITON, cdiv, kernel, note_launch, tl, use_triton
from ._gemm_operands import (check_operands, check_out, dequantized, expert_rows_product, gemm_width,
                             in_float32_under_interpreter, output_dtype)
from ._tile_gemm import dot_precision, programs_per_device, rows_descriptor, weight_descriptor
from .config import MoEConfig, check_config, get_config

if HAS_TRITON:
    from ._tile_gemm import add_tile, expert_tile_product, scale_rows, store_tile, tile_position

    @kernel
    def _contiguous_tile(
        pid_m, pid_n, split, a_ptr, stride_am, w_ptr, stride_we, stride_wn, out_ptr, stride_om,
        m_indices_ptr, num_rows, num_experts, N, K,
        a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
        GATED: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCALES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
        w_desc, TMA_W: tl.constexpr, a_desc, TMA_A: tl.constexpr, SWAP_AB: tl.constexpr,
        row_assign_ptr, topk_weights_ptr, num_assignments, SUM_TOP_K: tl.constexpr, SPLIT_K: tl.constexpr,
        GATHER_TOP_K: tl.constexpr, SHORT_LAST: tl.constexpr, FLAT: tl.constexpr = False,
    ):
        """Tile (``pid_m``, ``pid_n``), K slice ``split``, of the contiguous grouped GEMM: stored
        row for row, or (``SUM_TOP_K`` = k) times each row's routing weight and added into its
        token's row of an fp32 ``[T, N]`` output (the top-k sum in GEMM 2's epilogue). With
        ``GATHER_TOP_K`` = k, ``A`` is the ``[T, K]`` token rows and row ``r`` reads token
        ``row_assign[r] // k`` (rows through the permutation, not copied into the segments).
        ``SHORT_LAST`` (``MoEConfig.short_last_tile``): 1, the full tiles' launch, leaves a tile whose
        second half holds no real row to 2, the launch of half-height tiles (``BLOCK_M`` halved,
        ``pid_m`` the first half of a full tile), which runs those tiles' first halves. ``FLAT``: called
        from a tile loop that Triton flattens with the K loop into one pipeline (see below)."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_experts = tl.load(m_indices_ptr + rows, mask=rows < num_rows, other=-1)
        # A tile lies inside one segment (BLOCK_M divides align), so its real rows share one
        # expert and its padding rows are -1. A tile of padding, or one naming an expert that does
        # not exist, has nothing to do: an id is never used as an address unchecked.
        expert = tl.max(row_experts, axis=0)
        run = (expert >= 0) & (expert < num_experts)
        # >>> book: short-last-tile
        if SHORT_LAST == 1:
            # Full tiles: a tile with no real row in its second half is the half launch's.
            second_half = tl.arange(0, BLOCK_M) >= BLOCK_M // 2
            run = run & (tl.max(tl.where(second_half, row_experts, -1), axis=0) == expert)
        elif SHORT_LAST == 2:
            # Half-height tiles (BLOCK_M is half the full tile, pid_m even: the first halves):
            # run where the full tile's second half has no row of this tile's expert.
            after = rows + BLOCK_M
            second = tl.load(m_indices_ptr + after, mask=after < num_rows, other=-1)
            run = run & (tl.max((second == expert).to(tl.int32), axis=0) == 0)
        # <<< book: short-last-tile
        if FLAT:
            # Triton flattens the tile loop and the K loop only if the K loop sits under no branch:
            # every tile enters, and one that must not run (all padding, or an unknown expert)
            # multiplies expert 0's weights, an address that exists, and stores no row.
            expert = tl.where(run, expert, 0)
        if run | FLAT:
            # A segment's real rows come first, so the tile's first row is real: padding rows read
            # it (loads need no row mask, and never see the buffer's unwritten garbage; a FLAT tile
            # that does not run reads its own rows, padding, and stores none) and are not
            # stored. Through the copy engine (TMA_A) a tile reads its rows as they are, padding
            # included: a row of the product depends on its own row of A only, and padding rows
            # are never stored.
            row_real = row_experts == expert
            if FLAT:
                row_real = tl.where(run, row_real, False)
            offsets = rows.to(tl.int64)
            if GATHER_TOP_K > 0:
                # Row r holds assignment a = (token a // k, slot a % k): read the token's row of A
                # where it is. Padding rows read the tile's first row's token (never stored); an
                # assignment outside the routing is never used as an address.
                assignment = tl.load(row_assign_ptr + rows, mask=row_real, other=0)
                first = tl.load(row_assign_ptr + pid_m * BLOCK_M)
                usable = row_real & (assignment >= 0) & (assignment < num_assignments)
                assignment = tl.where(usable, assignment, first)
                assignment = tl.minimum(tl.maximum(assignment, 0), num_assignments - 1)
                source = (assignment // GATHER_TOP_K).to(tl.int64)
            else:
                source = tl.where(row_real, offsets, pid_m * BLOCK_M)
            a_rows = source * stride_am
            acc = expert_tile_product(a_ptr, a_rows, w_ptr + expert.to(tl.int64) * stride_we,
                                      stride_wn, pid_n, N, K,
                                      a_scale_ptr, source * stride_as,
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
                # An assignment outside the routing (a caller's mismatched arguments) is never used
                # as an address.
                assignments = tl.load(row_assign_ptr + rows, mask=row_real, other=0)
                summed = row_real & (assignments >= 0) & (assignments < num_assignments)
                acc = scale_rows(acc, topk_weights_ptr, assignments, summed)
                add_tile(out_ptr, (assignments // SUM_TOP_K).to(tl.int64) * stride_om, summed, acc, pid_n, N,
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
        row_assign_ptr, topk_weights_ptr, num_assignments, SUM_TOP_K: tl.constexpr, SPLIT_K: tl.constexpr,
        GATHER_TOP_K: tl.constexpr = 0, SHORT_LAST: tl.constexpr = 0, M_STEP: tl.constexpr = 1,
    ):
        # (M_STEP 2: the half launch of short last tiles visits the first half of each full tile only.)
        if PERSISTENT == 0:
            # One program per tile (and K slice) of the whole buffer. Axis 0 (M tiles) varies
            # fastest, so consecutive programs are consecutive tiles of the same expert and find
            # that expert's weight tile in L2; tiles past the last segment exit at once.
            _contiguous_tile(tl.program_id(0) * M_STEP, tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K,
                             a_ptr, stride_am, w_ptr, stride_we, stride_wn,
                             out_ptr, stride_om, m_indices_ptr, num_rows, num_experts, N, K,
                             a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                             GATED, EVEN_K, INPUT_PRECISION, SCALES, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN, SCALE_BK,
                             w_desc, TMA_W, a_desc, TMA_A, SWAP_AB, row_assign_ptr, topk_weights_ptr,
                             num_assignments, SUM_TOP_K, SPLIT_K, GATHER_TOP_K, SHORT_LAST)
        else:
            # One program per SM, walking only the tiles of the rows the segments use (their
            # padded total, which the alignment wrote on the device: no host sync), GROUP_M
            # M-blocks down one N-tile at a time. The buffer's spare tail, sized for the worst
            # routing, costs nothing. (2: the tile and K loops flattened into one pipeline, so that
            # the next tile's first loads start under this tile's epilogue; not with short last
            # tiles, whose launches skip tiles by a test around the K loop, nor with split-K, whose
            # K slices have bounds that differ by tile: Triton 3.6 then keeps the loops nested.)
            num_m_blocks = tl.cdiv(tl.minimum(tl.load(rows_used_ptr), num_rows), BLOCK_M * M_STEP)
            num_tiles = num_m_blocks * tl.cdiv(N, BLOCK_N) * SPLIT_K
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=PERSISTENT == 2):
                pid_m, pid_n, split = tile_position(tile, num_m_blocks, N, BLOCK_N, GROUP_M, SPLIT_K)
                _contiguous_tile(pid_m * M_STEP, pid_n, split, a_ptr, stride_am, w_ptr, stride_we, stride_wn,
                                 out_ptr, stride_om, m_indices_ptr, num_rows, num_experts, N, K,
                                 a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                                 GATED, EVEN_K, INPUT_PRECISION, SCALES, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN,
                                 SCALE_BK, w_desc, TMA_W, a_desc, TMA_A, SWAP_AB, row_assign_ptr, topk_weights_ptr,
                                 num_assignments, SUM_TOP_K, SPLIT_K, GATHER_TOP_K, SHORT_LAST,
                                 (PERSISTENT == 2) and (SHORT_LAST == 0) and (SPLIT_K == 1))


def grouped_gemm_contiguous(x: torch.Tensor, w: torch.Tensor, m_indices: torch.Tensor, *, align: int,
                            silu_mul: bool = False, out: torch.Tensor | None = None,
                            config: MoEConfig | None = None, which: str = "gate_up",
                            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None, rows_used: torch.Tensor | None = None,
                            sum_slots: tuple | None = None, gather_from=None) -> torch.Tensor:
    """``out[r] = x[r] @ w[m_indices[r]]^T`` for every row whose ``m_indices`` is in ``[0, E)``.

    ``x`` ``[M_pad, K]`` holds ``align``-aligned expert segments (from :func:`permute`), ``w``
    ``[E, N_w, K]``. Returns ``[M_pad, N_w]``, or ``[M_pad, N_w/2]`` holding ``silu(gate) * up``
    when ``silu_mul`` (``w`` = ``w1``, gate rows then up rows). Other rows are not written (``out``
    keeps what it held there). ``which`` picks the GEMM tiles of ``config`` (``gate_up``/``down``).
    fp8 operands come with ``x_scale`` (per row of ``x``) and ``w_scale`` and write ``out_dtype``.
    ``rows_used`` (:attr:`PermutedRows.rows_used`, on the device) lets a persistent grid
    (``tiles.persistent``) skip the buffer's rows past the last segment; without it every row's
    tile is visited. ``sum_slots`` = ``(permuted, topk_weights)`` (GEMM 2 only: the
    :class:`~moe_kernels.kernels.permute.PermutedRows` ``x`` came from, and the router's
    weights) makes it the top-k sum as well: each row times its routing weight is added into its
    token's row of ``out``, an fp32 ``[T, N_w]`` buffer the caller has zeroed (with
    ``config.down.split_k`` > 1 each K slice adds its part; without ``sum_slots`` a split-K
    config runs whole). ``gather_from`` (a :class:`~moe_kernels.kernels.permute.PermutedRows`,
    made with ``copy=False``): ``x`` is the ``[T, K]`` token rows themselves (``x_scale`` per token)
    and row ``r`` reads token ``row_assignments[r] // k``, through pointer loads: the segments'
    rows are never copied (``MoEConfig.gather_rows``).
    """
    func = "grouped_gemm_contiguous"
    fmt = check_operands(func, "x", x, "w", w, x_scale, w_scale)
    check_tensor(func, "m_indices", m_indices, ndim=1, dtypes=(torch.int32,), device=x.device, contiguous=True)
    check_int(func, "align", align, lo=1)
    num_rows, k = x.shape
    if w.shape[2] != k:
        fail(func, "w", f"must have shape [E, N, {k}] to match x", f"shape {tuple(w.shape)}")
    gather_top_k = 0
    if gather_from is not None:
        row_assignments, gather_top_k = _check_gather_from(func, gather_from, x, m_indices, sum_slots)
        num_rows = m_indices.shape[0]
    if m_indices.shape[0] != num_rows or num_rows % align:
        fail(func, "m_indices", f"must have one entry per row of x ({num_rows}, a multiple of align={align})",
             f"shape {tuple(m_indices.shape)}")
    n = gemm_width(func, w, silu_mul)
    if silu_mul:   # (a tile's up half reads one scale block: it must start one)
        fmt.check_gated(func, "w", w)
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
        # Split-K partial products need a sum to land in: a config made for the summed GEMM 2
        # runs whole here (as separate_sum_tiles does for index-gather).
        tiles = dataclasses.replace(tiles, split_k=1)
        result = check_out(func, out, (num_rows, n), x, dtype=output_dtype(x, out_dtype))
    else:
        row_assignments, topk_weights = _check_sum_slots(func, sum_slots, num_rows, x.device, silu_mul)
        top_k = topk_weights.shape[1]
        if out is None:
            fail(func, "out", "must be the zeroed fp32 [T, N] buffer GEMM 2 adds into when sum_slots is given", None)
        result = check_out(func, out, (topk_weights.shape[0], n), x, dtype=torch.float32)
    if not use_triton(x, w, m_indices, result):
        xf, wf = dequantized(x, w, x_scale, w_scale, fmt)
        if gather_from is not None:   # the rows the kernel reads, as a copy
            xf = xf[_gathered_tokens(row_assignments, gather_top_k, x.shape[0])]
        if sum_slots is not None:
            return _summed_contiguous_reference(xf, wf, m_indices, row_assignments, topk_weights, result)
        return _grouped_gemm_contiguous_reference(xf, wf, m_indices, silu_mul, result)
    rerun = lambda x, w, out: grouped_gemm_contiguous(  # noqa: E731
        x, w, m_indices, align=align, silu_mul=silu_mul, out=out, config=config, which=which, x_scale=x_scale,
        w_scale=w_scale, out_dtype=out.dtype, rows_used=rows_used, sum_slots=sum_slots, gather_from=gather_from)
    if num_rows == 0 or in_float32_under_interpreter(rerun, result, x, w) is not None:
        return result
    scales = fmt.scale_arguments(x, w, x_scale, w_scale)
    # Contiguous rows: with tiles.tma both operands come through the copy engine (TMA), not only
    # the weights as in the index-gather layout, whose gathered rows cannot (gather is Blackwell's).
    # (gathered rows are not consecutive: pointer loads, as in the index-gather layout)
    w_desc = weight_descriptor(w, tiles)
    # With config.short_last_tile the full tiles' launch leaves the tiles with at most half their rows
    # real to a second launch of half-height tiles: their padding rows are not multiplied.
    for block_m, short_last in _launches(config):
        a_desc = None if gather_top_k else rows_descriptor(x, block_m, tiles)
        # (the half launch's programs take the first half of each full tile: as many as the full launch's)
        num_m_blocks, num_n_tiles = num_rows // config.block_m, cdiv(n, tiles.block_n) * tiles.split_k
        if tiles.persistent:
            grid = (min(num_m_blocks * num_n_tiles, programs_per_device(x.device)),)
            if rows_used is None:   # (every row's tile, as the one-program-per-tile grid visits)
                rows_used = torch.full((1,), num_rows, dtype=torch.int32, device=x.device)
        else:
            grid = (num_m_blocks, num_n_tiles)
        note_launch("permute.gemm", gemm=which, block_m=block_m, tiles=tiles, scales=scales[6], sum_top_k=top_k,
                    gather_top_k=gather_top_k, tma_w=w_desc is not None, tma_a=a_desc is not None, grid=grid,
                    short_last=short_last)
        _contiguous_gemm_kernel[grid](
            x, x.stride(0), w, w.stride(0), w.stride(1), result, result.stride(0),
            m_indices, num_rows, w.shape[0], n, k, *scales[:6],
            GATED=silu_mul, EVEN_K=k % tiles.block_k == 0, INPUT_PRECISION=dot_precision(x.dtype), SCALES=scales[6],
            BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SCALE_BN=scales[7], SCALE_BK=scales[8],
            w_desc=w if w_desc is None else w_desc, TMA_W=w_desc is not None, a_desc=x if a_desc is None else a_desc,
            TMA_A=a_desc is not None, SWAP_AB=tiles.swap_ab,
            rows_used_ptr=m_indices if rows_used is None else rows_used, GROUP_M=tiles.group_m,
            PERSISTENT=tiles.persistent,
            row_assign_ptr=m_indices if sum_slots is None and gather_from is None else row_assignments,
            topk_weights_ptr=result if sum_slots is None else topk_weights,
            num_assignments=(topk_weights.numel() if sum_slots is not None
                             else gather_from.src2dst.numel() if gather_from is not None else 0),
            SUM_TOP_K=top_k, SPLIT_K=tiles.split_k, GATHER_TOP_K=gather_top_k, SHORT_LAST=short_last,
            M_STEP=config.block_m // block_m,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return result


def _launches(config: MoEConfig) -> tuple:
    """``(BLOCK_M, SHORT_LAST)`` of each launch of one GEMM: the full tiles, then, with
    ``config.short_last_tile``, the half-height ones."""
    if config.short_last_tile:
        return (config.block_m, 1), (config.block_m // 2, 2)
    return ((config.block_m, 0),)


def _check_gather_from(func, gather_from, x, m_indices, sum_slots):
    """``(row_assignments, k)`` of ``gather_from`` (a PermutedRows for token rows ``x [T, K]``)."""
    if sum_slots is not None:
        fail(func, "gather_from", "must be None when sum_slots is given (GEMM 1 gathers, GEMM 2 sums)", "given")
    if not all(hasattr(gather_from, name) for name in ("row_assignments", "src2dst")):
        fail(func, "gather_from", "must be the PermutedRows of the routing (permute(..., copy=False))",
             type(gather_from).__name__, TypeError)
    row_assignments = gather_from.row_assignments
    check_tensor(func, "gather_from.row_assignments", row_assignments, ndim=1, dtypes=(torch.int32,),
                 device=x.device, contiguous=True)
    check_tensor(func, "gather_from.src2dst", gather_from.src2dst, ndim=2, device=x.device)
    tokens, top_k = gather_from.src2dst.shape
    if x.shape[0] != tokens:
        fail(func, "x", f"must be the [T, K] token rows the permutation was made for (T = {tokens}) with "
             "gather_from", f"shape {tuple(x.shape)}")
    if row_assignments.shape[0] != m_indices.shape[0]:
        fail(func, "m_indices", f"must have one entry per row of the permutation ({row_assignments.shape[0]})",
             f"shape {tuple(m_indices.shape)}")
    return row_assignments, top_k


def _gathered_tokens(row_assignments, top_k, num_tokens):
    """The token each row reads (padding rows, and assignments outside the routing: token 0)."""
    assignment = row_assignments.to(torch.int64)
    usable = (assignment >= 0) & (assignment < num_tokens * top_k)
    return torch.where(usable, assignment // top_k, 0)


def _check_sum_slots(func, sum_slots, num_rows, device, silu_mul):
    """``(row_assignments, topk_weights)`` from ``sum_slots = (permuted, topk_weights)``, checked:
    the weights must be the routing's own ``[T, k]`` (``permuted.src2dst``'s shape), since the
    kernel scales and addresses by assignment ``t * k + j``."""
    if silu_mul:
        fail(func, "sum_slots", "must be None for GEMM 1 (the top-k sum follows GEMM 2)", "given")
    if not isinstance(sum_slots, tuple) or len(sum_slots) != 2 or not all(
            hasattr(sum_slots[0], name) for name in ("row_assignments", "src2dst")):
        fail(func, "sum_slots", "must be (PermutedRows, topk_weights)", type(sum_slots).__name__, TypeError)
    permuted, topk_weights = sum_slots
    row_assignments = permuted.row_assignments
    check_tensor(func, "sum_slots[0].row_assignments", row_assignments, ndim=1, dtypes=(torch.int32,), device=device,
                 contiguous=True)
    if row_assignments.shape[0] != num_rows:
        fail(func, "sum_slots[0]", f"must be the PermutedRows of x (one assignment per row of x, {num_rows})",
             f"{row_assignments.shape[0]} rows")
    check_tensor(func, "sum_slots[1]", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=device, contiguous=True)
    if tuple(topk_weights.shape) != tuple(permuted.src2dst.shape):
        fail(func, "sum_slots[1]", f"must be the routing weights of the routing x was permuted for, shape "
             f"{tuple(permuted.src2dst.shape)} [T, k]", f"shape {tuple(topk_weights.shape)}")
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

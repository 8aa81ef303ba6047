"""One tile of the index-gather layout: the program that finds its rows through ``sorted_token_ids``.

Split out of :mod:`moe_kernels.kernels.index_gather` so that two launchers can share it: the
layout's own grouped GEMM (one GEMM per launch) and :mod:`moe_kernels.kernels.streamed_pair`
(both GEMMs in one launch), which the layout's ``run_experts`` calls. ``_index_gather_tile`` owns
one ``(M-block, N-tile)``: it reads the block's rows and expert, computes the tile on the common
core (:func:`~moe_kernels.kernels._tile_gemm.expert_tile_product`) and stores it; blocks past the
last one in use store nothing, and an expert id outside ``[0, E)`` is never used as an address.
``_prefetch_tile_weights`` asks L2 for the weight rows a tile will read (see
:mod:`moe_kernels.kernels._pdl`). Both are ``@kernel`` functions called from other kernels; the
tests run them through their launchers. :func:`rows_reference` is the tile's torch reference: the
rows of one GEMM as a block map assigns them, in float32.
"""

from __future__ import annotations

import torch

from .._runtime import HAS_TRITON, kernel, tl
from ._gemm_operands import expert_rows_product
from .blocks import BlockAssignment, assignments_by_block

if HAS_TRITON:
    from ._pdl import prefetch_rows_to_l2
    from ._tile_gemm import add_tile, expert_tile_product, scale_rows, store_tile
    from ._tile_gemm import tile_position as _tile_position
    from .quant import store_group_quantized

if HAS_TRITON:

    @kernel
    def _prefetch_tile_weights(tile, w_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, num_m_blocks, num_experts,
                               N, K, stride_we, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, NAIVE_BLOCKS: tl.constexpr,
                               DENSE: tl.constexpr, LINE: tl.constexpr):
        """Ask L2 for the weight rows ``tile`` will read (see :mod:`moe_kernels.kernels._pdl`): the
        block map it reads here was final before this kernel launched."""
        pid_m, pid_n, _ = _tile_position(tile, num_m_blocks, N, BLOCK_N, GROUP_M, SPLIT_K)
        if DENSE:
            expert = pid_m.to(tl.int64) * 0
            in_use = True
        else:
            expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            if NAIVE_BLOCKS:
                in_use = True
            else:
                in_use = pid_m * BLOCK_M < tl.load(num_tokens_post_padded_ptr)
        if in_use & (expert >= 0) & (expert < num_experts):
            # Rows past the last (N not a multiple of BLOCK_N) ask for the last row again: a
            # prefetch must not point past the weights, even one L2 never answers.
            rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
            # (8 lines of each row per step of the prefetch loop: BLOCK_N x 8 instructions at a time)
            prefetch_rows_to_l2(w_ptr + expert * stride_we + rows.to(tl.int64) * stride_wn, K, LINE, 8)

    @kernel
    def _naive_group_rows(expert_ids_ptr, pid_m, num_valid_rows, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
        """The rows block ``pid_m`` of the naive map computes when it takes its expert's other
        assignments too, and whether it computes any (``GROUP``: a power of two >= the assignments).

        On the naive map block m is assignment m, so two tokens on one expert are two blocks and
        each reads the expert's weights whole. Here the assignments on block m's expert are
        ranked in order; the block of rank 0 (and of rank BLOCK_M, 2 BLOCK_M, ..) takes the next
        BLOCK_M of them as its rows, and the others are not in use: the weights are read once per
        BLOCK_M assignments, as on an aligned map, with no alignment launched."""
        js = tl.arange(0, GROUP)
        ids = tl.load(expert_ids_ptr + js, mask=js < num_valid_rows, other=0)
        same = (ids == tl.load(expert_ids_ptr + pid_m)) & (js < num_valid_rows)
        rank = tl.cumsum(same.to(tl.int32), axis=0) - 1   # each assignment's place on its expert
        mine = tl.sum((same & (js < pid_m)).to(tl.int32), axis=0)   # block m's place
        pick = same[None, :] & (rank[None, :] == mine + tl.arange(0, BLOCK_M)[:, None])   # [BLOCK_M, GROUP]
        rows = tl.sum(tl.where(pick, js[None, :], 0), axis=1)
        rows = tl.where(tl.sum(pick.to(tl.int32), axis=1) > 0, rows, num_valid_rows)
        return rows.to(tl.int64), mine % BLOCK_M == 0

    @kernel
    def _index_gather_tile(
        tile, a_ptr, w_ptr, out_ptr, topk_weights_ptr,
        sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
        num_m_blocks, num_valid_rows, num_experts, N, K,
        stride_am, stride_we, stride_wn, stride_om,
        a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        TOP_K: tl.constexpr, NAIVE_BLOCKS: tl.constexpr, DENSE: tl.constexpr, GATED: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        SCALES: tl.constexpr, SUM_TOP_K: tl.constexpr, SPLIT_K: tl.constexpr, w_desc, TMA_W: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, ID_CHECK: tl.constexpr, SWAP_AB: tl.constexpr,
        out_scale_ptr, stride_os, QUANT_GROUP: tl.constexpr, ROUND_TO: tl.constexpr, FLAT: tl.constexpr = False,
        NAIVE_GROUP: tl.constexpr = 0, K_CHUNKS: tl.constexpr = 1,
    ):
        # out[row] = A[row // TOP_K] @ W[expert]^T for the rows of one M-block; W is [E, N', K].
        # FLAT: called from a loop over tiles that Triton is asked to flatten with this K loop into one
        # software pipeline (the next tile's loads under this tile's epilogue): see below.
        # QUANT_GROUP > 0 (GEMM 1, fp8 block weights): out is GEMM 2's fp8 input, with its 1 x
        # QUANT_GROUP scales at out_scale_ptr, quantised here instead of by a separate launch.
        # SUM_TOP_K > 0: out[row // SUM_TOP_K] += that instead (fp32 atomics), over SPLIT_K K slices.
        pid_m, pid_n, split = _tile_position(tile, num_m_blocks, N, BLOCK_N, GROUP_M, SPLIT_K)

        # >>> book: index-gather-rows
        offs_m = tl.arange(0, BLOCK_M)
        if NAIVE_BLOCKS:
            if NAIVE_GROUP > 0:
                # Block m with the other assignments of its expert: the first block of each
                # BLOCK_M of them computes their rows, the rest nothing (an expert read once).
                rows, in_use = _naive_group_rows(expert_ids_ptr, pid_m, num_valid_rows, BLOCK_M,
                                                 NAIVE_GROUP)
            else:
                # Block m is assignment m alone: row 0 is real, the others are padding.
                rows = tl.where(offs_m == 0, pid_m, num_valid_rows).to(tl.int64)
                in_use = True
        elif DENSE:
            # One expert that every token uses (a shared expert):
            # block m is rows m*BLOCK_M onward.
            rows = (pid_m * BLOCK_M + offs_m).to(tl.int64)
            in_use = True
        else:
            # The early exit: blocks past the last one in use read no ids (the id buffer may end
            # inside the last block of the grid) and store nothing.
            rows_used = tl.load(num_tokens_post_padded_ptr)
            in_use = pid_m * BLOCK_M < rows_used
            slots = pid_m * BLOCK_M + offs_m
            rows = tl.load(sorted_token_ids_ptr + slots, mask=slots < rows_used,
                           other=num_valid_rows).to(tl.int64)
        row_real = rows < num_valid_rows
        if DENSE:
            expert = pid_m.to(tl.int64) * 0   # expert 0, as an int64 scalar like a loaded id
        else:
            expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        # -1: the block's expert is computed elsewhere (vLLM, under expert parallelism);
        # an id out of range (unchecked input) must not become an address. Its rows are zero.
        known = (expert >= 0) & (expert < num_experts)
        if FLAT:
            # Triton flattens the tile loop and this K loop only if the K loop sits
            # under no branch and runs as many steps in every tile. Every tile the
            # flattened loop visits is in use (it ends at the last block in use); one
            # whose expert is unknown multiplies expert 0 (an address that exists)
            # and keeps zeros.
            expert = tl.where(known, expert, 0)
        if (in_use & known) | FLAT:
            # Padding rows read row 0 (never stored), so the loads need no row mask.
            a_row = tl.where(row_real, rows // TOP_K, 0)
            acc = expert_tile_product(
                a_ptr, a_row * stride_am, w_ptr + expert * stride_we, stride_wn, pid_n, N, K,
                a_scale_ptr, a_row * stride_as, w_scale_ptr + expert * stride_wse, stride_wsn,
                stride_wsk, GATED, EVEN_K, INPUT_PRECISION, SCALES, BLOCK_M, BLOCK_N, BLOCK_K,
                split, SPLIT_K, w_desc,
                (expert * (N * (1 + GATED)) + pid_n * BLOCK_N).to(tl.int32), TMA_W,
                SCALE_BN, SCALE_BK, SWAP_AB, K_CHUNKS=K_CHUNKS)
            if MUL_ROUTED_WEIGHT:
                acc = scale_rows(acc, topk_weights_ptr, rows, row_real)
            if FLAT:   # (after the routed weight: zero times an inf weight would be NaN)
                acc = tl.where(known, acc, 0.0)
            if QUANT_GROUP > 0:
                store_group_quantized(out_ptr, rows * stride_om, out_scale_ptr,
                                      rows * stride_os, row_real, acc, pid_n, N, BLOCK_M,
                                      BLOCK_N, QUANT_GROUP, ROUND_TO)
            elif SUM_TOP_K == 0:
                store_tile(out_ptr, rows * stride_om, row_real, acc, pid_n, N, BLOCK_N)
            else:
                add_tile(out_ptr, (rows // SUM_TOP_K) * stride_om, row_real, acc, pid_n, N,
                         BLOCK_N)
        elif in_use & (SUM_TOP_K == 0):   # (a summed output starts at zero: nothing to add)
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if QUANT_GROUP > 0:
                store_group_quantized(out_ptr, rows * stride_om, out_scale_ptr,
                                      rows * stride_os, row_real, zeros, pid_n, N, BLOCK_M,
                                      BLOCK_N, QUANT_GROUP, ROUND_TO)
            else:
                store_tile(out_ptr, rows * stride_om, row_real, zeros, pid_n, N, BLOCK_N)
        if NAIVE_BLOCKS:
            if ID_CHECK != "":
                # The naive map's labels are the caller's ids, which no kernel before the
                # GEMMs reads: one GEMM reports a bad one (NAIVE_ID_CHECK_IN). At the end of
                # the tile, where nothing waits for it; `known` above is what keeps a bad id
                # from becoming an address, checked or not.
                tl.device_assert(known, ID_CHECK)
        # <<< book: index-gather-rows


def rows_reference(x, w, blocks: BlockAssignment, numel: int, top_k: int, routed_weights=None) -> torch.Tensor:
    """float32 rows of one GEMM as the block map assigns them: GEMM 1 (``top_k`` rows share a
    token, SiLU·mul) or GEMM 2 (``top_k=1``, times the routing weight); rows that no block holds
    stay zero. The caller rounds the result into its output buffer."""
    rows, experts = assignments_by_block(blocks, numel)
    width = w.shape[1] if routed_weights is not None else w.shape[1] // 2
    out = torch.zeros(numel, width, dtype=torch.float32, device=x.device)
    for e in torch.unique(experts[(experts >= 0) & (experts < w.shape[0])]).tolist():
        mine = rows[experts == e]
        product = expert_rows_product(x[mine // top_k], w[e], silu_mul=routed_weights is None)
        out[mine] = product if routed_weights is None else routed_weights[mine, None] * product
    return out


def naive_group_rows_reference(expert_ids: torch.Tensor, block_m: int) -> tuple[list, list]:
    """``_naive_group_rows`` in Python, for every block of a naive map: ``(rows, in_use)``, where
    ``rows[m]`` lists the assignments block ``m`` computes (padded with ``len(expert_ids)``; none
    where it is not in use, whatever the kernel's unused rows hold) and ``in_use[m]`` whether it
    computes any. An expert's assignments, in order, go to its first
    block, ``block_m`` at a time; its other blocks compute nothing.

        >>> naive_group_rows_reference(torch.tensor([5, 1, 5]), 2)
        ([[0, 2], [1, 3], [3, 3]], [True, True, False])
    """
    ids = expert_ids.tolist()
    numel = len(ids)
    rows, in_use = [], []
    for m, e in enumerate(ids):
        same = [j for j in range(numel) if ids[j] == e]
        rank = same.index(m)
        mine = same[rank:rank + block_m] if rank % block_m == 0 else []
        rows.append(mine + [numel] * (block_m - len(mine)))
        in_use.append(rank % block_m == 0)
    return rows, in_use

"""The Gluon grouped GEMM for a few tokens an expert (decode), block-fp8 or bf16: the product transposed, so
that the weights fill wgmma's 128-row M side and an expert's 16 (or 32, 64) tokens its N side, on a persistent
grid whose ring of TMA loads runs on across tiles (as :mod:`moe_kernels.kernels._gluon_block_fp8_persistent`).

Why: at decode an expert gets a handful of tokens, and wgmma's M side is at least 64 rows; a 128-row token
tile would multiply mostly padding. Computing ``C^T = W X^T`` puts the expert's weights on M (a tile of 128
weight rows, gated: 64 gate rows and the 64 matching up rows) and its tokens on N (wgmma takes N = 8 to
256 in steps of 8). The time is the weights' bytes: the ring streams them with TMA across tiles, so a
program never waits for a tile's first loads after the first tile (Qwen3-30B-A3B's GEMM 2 has six K steps
of 128 a tile; Triton's per-tile pipelines refill from empty at every tile). The tokens' rows come in the
permute layout's segments (:func:`~moe_kernels.kernels.permute.permute` with ``align = BLOCK_T``): each
tile's ``BLOCK_T`` rows are contiguous, one TMA box a step like the weights'.

Block-fp8 (``SCALED``): a step's product is promoted with the weights' block scale (one per tile row: gate
and up rows differ) times each token's scale (one per column), under the next step's MMA as in the per-tile
kernel. bf16: each MMA accumulates into the one before, one left in flight. The epilogue writes the fp32
tile to shared memory and reads it back transposed, so that each thread stores 8 consecutive output
columns (a token's row of the output) as 16 bytes; gated, it reads the gate rows and the up rows as two
halves and stores ``silu(gate) * up``.
"""

from __future__ import annotations

import torch

from ._gluon_block_fp8_kernel import GLUON_HOPPER, GROUP_M, TILE_K

#: Programs of the persistent grid: None, one per SM. (Tests set a few, so that each program walks many tiles.)
PROGRAMS = None
#: The weight rows of a tile: wgmma's M side (gated: half gate rows, half up rows).
TILE_W = 128
#: Warps a program: None for :func:`warps_for`'s rule (tests and the A/B set 4 or 8).
NUM_WARPS = None


def warps_for(block_t: int) -> int:
    """4 warps (one warpgroup issuing both m64 halves of the tile) below 64 tokens a tile, 8 at 64, where the fp8
    kernel's one warpgroup would hold 3 x 64 accumulator registers a thread (the tile and two products in
    flight) and spill (ptxas: 255 registers and 340 bytes of spills at 4 warps, 252 and none at 8). (bf16, one
    accumulator, would fit 4 warps there too; it takes the same rule, tested and timed as one.)"""
    return NUM_WARPS or (8 if block_t >= 64 else 4)

if GLUON_HOPPER:
    from triton.experimental import gluon

    from .._runtime import gluon_kernel
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ._gluon_block_fp8_kernel import _grouped_tile, _load_into, compile_kernel_for_sm90
    from ._gluon_block_fp8_persistent import _drained, _quantized_group, _scale_pointers

    BLOCK_W = gl.constexpr(TILE_W)

    @gluon.constexpr_function
    def _acc_layout(block_t, num_warps, instr_k):
        """The transposed tile's accumulator, ``[128 weight rows, block_t tokens]``: warps stacked along the
        weight rows (4 warps: one warpgroup issuing two m64 wgmmas a K step), each spanning the tokens; wgmma's
        K is 32 bytes, ``instr_k`` elements (fp8 32, bf16 16)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, block_t, instr_k])

    @gluon.constexpr_function
    def _row_store_layout(width, num_warps):
        """The epilogue's layout of a ``[tokens, width]`` output tile: 8 consecutive bf16 (16 bytes) per thread."""
        across = min(width // 8, 32)
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // across, across],
                                warps_per_cta=[num_warps, 1], order=[1, 0])

    @gluon.jit
    def _transposed_origin(local_tile, pid, nprog, num_pid_t, num_pid_n, m_indices_ptr, BLOCK_T: gl.constexpr,
                           OUT_ROWS: gl.constexpr, GROUP: gl.constexpr, PAIRS: gl.constexpr):
        """This program's tile ``local_tile`` (tiles ``pid``, ``pid + P``, ... in the grouped order: GROUP token
        tiles, mostly of one expert, share each weight tile while it is in L2): its first token row, its first
        output column and its expert (its first row's). ``PAIRS``: the program takes the two column tiles of a
        128-column group back to back (``pid``'s pair, then ``pid + P``'s, ...)."""
        if PAIRS:
            pid_t, pair_n = _grouped_tile(pid + (local_tile // 2) * nprog, num_pid_t, num_pid_n // 2, GROUP)
            pid_n = 2 * pair_n + local_tile % 2
        else:
            pid_t, pid_n = _grouped_tile(pid + local_tile * nprog, num_pid_t, num_pid_n, GROUP)
        off_t = pid_t * BLOCK_T
        return off_t, pid_n * OUT_ROWS, gl.load(m_indices_ptr + off_t)

    @gluon.jit
    def _known_tiles(t, walk, m_indices_ptr, N, BLOCK_T: gl.constexpr, OUT_ROWS: gl.constexpr, GROUP: gl.constexpr,
                     PAIRS: gl.constexpr):
        """``(known, off_n, expert)`` of tile ``t``, as the persistent grid's ``_known_tiles`` (token rows)."""
        pid, nprog, my_tiles, num_pid_t, num_pid_n = walk
        off_t, off_n, expert = _transposed_origin(t, pid, nprog, num_pid_t, num_pid_n, m_indices_ptr, BLOCK_T,
                                                  OUT_ROWS, GROUP, PAIRS)
        next_t, next_n, next_expert = _transposed_origin(gl.minimum(t + 1, my_tiles - 1), pid, nprog, num_pid_t,
                                                         num_pid_n, m_indices_ptr, BLOCK_T, OUT_ROWS, GROUP, PAIRS)
        return (t, off_t, expert * N + off_n, next_t, next_expert * N + next_n), off_n, expert

    @gluon.jit
    def _load_transposed(x_desc, w_desc, x_bufs, w_bufs, ready, g, num_k, walk, m_indices_ptr, N, known,
                         BLOCK_T: gl.constexpr, OUT_ROWS: gl.constexpr, GROUP: gl.constexpr,
                         PAIRS: gl.constexpr, NUM_STAGES: gl.constexpr, GATED: gl.constexpr):
        """TMA loads of global step ``g`` (step ``g % num_k`` of tile ``g // num_k``): the tile's token rows and
        weight rows (gated: gate rows, then the matching up rows) into stage ``g % NUM_STAGES``; nothing past the
        program's last tile; the tiles ``known`` holds need no read of ``m_indices`` (see ``_load_global``)."""
        pid, nprog, my_tiles, num_pid_t, num_pid_n = walk
        tile, off_t, w_row, next_t, next_w_row = known
        first = tile * num_k   # (the known tile's step 0: comparisons, no division, on the two tiles' steps)
        local_tile = tile
        step = g - first
        if step >= num_k:
            if step < 2 * num_k:
                off_t, w_row, local_tile, step = next_t, next_w_row, tile + 1, step - num_k
            else:   # (a ring longer than the K loop; past the last tile: its addresses, no copy)
                local_tile, step = g // num_k, g % num_k
                off_t, far_n, expert = _transposed_origin(gl.minimum(local_tile, my_tiles - 1), pid, nprog,
                                                          num_pid_t, num_pid_n, m_indices_ptr, BLOCK_T, OUT_ROWS,
                                                          GROUP, PAIRS)
                w_row = expert * N + far_n
        _load_into(x_desc, w_desc, x_bufs, w_bufs, ready, g % NUM_STAGES, off_t, w_row, w_row + N // 2, step,
                   local_tile < my_tiles, GATED)

    @gluon.jit
    def _issue_transposed(x_bufs, w_bufs, ready, g, acc, NUM_STAGES: gl.constexpr, ACCUMULATE: gl.constexpr):
        """Wait for global step ``g``'s tiles, then issue ``W_tile @ X_tile^T`` (the weights as wgmma's A, K-major;
        the tokens' rows, K contiguous, viewed as its K-major B): into a fresh product whose registers are
        ``acc``'s (fp8, promoted before it is added), or ``ACCUMULATE`` into ``acc`` (bf16)."""
        stage = g % NUM_STAGES
        mbarrier.wait(ready.index(stage), (g // NUM_STAGES) & 1)
        return warpgroup_mma(w_bufs.index(stage), x_bufs.index(stage).permute((1, 0)), acc, use_acc=ACCUMULATE,
                             is_async=True)

    @gluon.jit
    def _transposed_scale(xs_ptrs, ws_ptr, ws_up_ptr, step, num_k, layout: gl.constexpr, GATED: gl.constexpr):
        """Step ``step``'s scales (clamped to the last step; the loop loads one ahead): each weight row's
        (gated: the gate block's on the first 64 rows, the up block's on the others) and each token's."""
        s = gl.minimum(step, num_k - 1)
        tokens = gl.load(xs_ptrs + s)
        if GATED:
            rows = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, layout))
            weights = gl.where(rows < BLOCK_W // 2, gl.load(ws_ptr + s), gl.load(ws_up_ptr + s))
        else:
            weights = gl.zeros([BLOCK_W], gl.float32, layout=gl.SliceLayout(1, layout)) + gl.load(ws_ptr + s)
        return weights, tokens

    @gluon.jit
    def _promote_transposed(acc, done, scale):
        """``acc + done * scale``, the scale each weight row's times each token's."""
        weights, tokens = scale
        return acc + done * (weights[:, None] * tokens[None, :])

    @gluon.jit
    def _transposed_step(base, step, num_k, inflight, inflight_scale, dead, scale, acc, ring, walk, xs_ptrs, ws_ptr,
                         ws_up_ptr, m_indices_ptr, N, known, layout: gl.constexpr, BLOCK_T: gl.constexpr,
                         OUT_ROWS: gl.constexpr, GROUP: gl.constexpr, PAIRS: gl.constexpr,
                         NUM_STAGES: gl.constexpr, GATED: gl.constexpr):
        """The persistent kernel's overlapped step, transposed: MMA ``base + step`` issued, MMA ``base + step -
        1`` waited for (one left in flight) and promoted under it; its stage refilled with global step ``base +
        step - 1 + NUM_STAGES``, of this tile or a later one."""
        x_desc, w_desc, x_bufs, w_bufs, ready = ring
        following = _transposed_scale(xs_ptrs, ws_ptr, ws_up_ptr, step + 1, num_k, layout, GATED)
        issued = _issue_transposed(x_bufs, w_bufs, ready, base + step, dead, NUM_STAGES, False)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(inflight, ))
        gl.thread_barrier()   # (every warpgroup past MMA step - 1 before its stage is refilled)
        _load_transposed(x_desc, w_desc, x_bufs, w_bufs, ready, base + step - 1 + NUM_STAGES, num_k, walk,
                      m_indices_ptr, N, known, BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
        acc = _promote_transposed(acc, done, inflight_scale)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))   # (the compiler fence: see _overlapped_step)
        return issued, scale, done, following, acc

    @gluon.jit
    def _store_transposed(acc, tile, out_ptr, m_indices_ptr, off_t, off_n, stride_om, quant, BLOCK_T: gl.constexpr,
                       GATED: gl.constexpr, QUANT_OUT: gl.constexpr, NUM_WARPS: gl.constexpr):
        """The tile's output rows (one per token, only the real ones): the fp32 tile through shared memory, read
        back transposed (gated: the gate half and the up half, then ``silu(gate) * up`` rounded once).
        ``QUANT_OUT``: ``quant`` is ``(half, stash, out_scale_ptr, stride_os)``; the group's first half waits in
        the stash, and the second quantises both (:func:`_store_quantized_pair`)."""
        tile.store(acc)
        gl.thread_barrier()
        if GATED:
            layout: gl.constexpr = _row_store_layout(BLOCK_W // 2, NUM_WARPS)
            gate = tile.slice(0, BLOCK_W // 2).permute((1, 0)).load(layout)
            up = tile.slice(BLOCK_W // 2, BLOCK_W // 2).permute((1, 0)).load(layout)
            out = gate * (1.0 / (1.0 + gl.exp(-gate))) * up
            width: gl.constexpr = BLOCK_W // 2
        else:
            layout: gl.constexpr = _row_store_layout(BLOCK_W, NUM_WARPS)
            out = tile.permute((1, 0)).load(layout)
            width: gl.constexpr = BLOCK_W
        tokens = off_t + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, layout))
        cols = off_n + gl.arange(0, width, layout=gl.SliceLayout(0, layout))
        real = gl.load(m_indices_ptr + tokens) >= 0
        offsets = tokens.to(gl.int64)[:, None] * stride_om + cols[None, :]
        if QUANT_OUT:
            _store_quantized_pair(out.to(gl.bfloat16), quant, out_ptr, offsets, tokens, real, off_n, width)
        else:
            gl.store(out_ptr + offsets, out.to(gl.bfloat16), mask=real[:, None] & (cols >= 0)[None, :])

    @gluon.jit
    def _store_quantized_pair(y, quant, out_ptr, offsets, tokens, real, off_n, WIDTH: gl.constexpr):
        """GEMM 2's fp8 input from a pair of gated tiles (columns ``off_n - 64``... and ``off_n``...: one 128-column
        group): the first tile's ``y`` (bf16, as the unfused path stores it) waits in the stash; the second's
        quantises the group's 128 columns per token (``_quantized_group``, the persistent grid's) and stores both
        halves in fp8 and each token's scale."""
        half, stash, out_scale_ptr, stride_os = quant
        if half == 0:
            stash.store(y)
        else:
            gl.thread_barrier()   # (every thread's share of the first half stored)
            first, second, scale = _quantized_group(stash.load(y.type.layout), y)
            mask = real[:, None] & (offsets >= 0)   # (the tokens', broadcast over the tile)
            gl.store(out_ptr + offsets - WIDTH, first, mask=mask)
            gl.store(out_ptr + offsets, second, mask=mask)
            gl.store(out_scale_ptr + tokens.to(gl.int64) * stride_os + off_n // 128, scale, mask=real)

    @gluon.jit
    def _promoted_product(base, num_k, known, off_n, expert, ring, walk, x_scale_ptr, stride_xs, w_scale_ptr,
                          stride_wse, stride_wsn, m_indices_ptr, N, layout: gl.constexpr, BLOCK_T: gl.constexpr,
                          OUT_ROWS: gl.constexpr, GROUP: gl.constexpr, PAIRS: gl.constexpr,
                          NUM_STAGES: gl.constexpr, GATED: gl.constexpr):
        """A block-fp8 tile's product at global steps ``base``..., each step promoted under the next step's MMA
        (the per-tile kernel's overlapped loop, two steps an iteration: see ``_block_fp8_grouped_kernel``); the
        last step's stage refilled before it returns."""
        x_desc, w_desc, x_bufs, w_bufs, ready = ring
        off_t = known[1]
        xs_ptrs, ws_ptr, ws_up_ptr = _scale_pointers(   # (the tokens' scales along the tile's columns)
            off_t + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout)), x_scale_ptr, stride_xs, w_scale_ptr,
            expert, off_n, N, stride_wse, stride_wsn)
        acc = gl.zeros([BLOCK_W, BLOCK_T], gl.float32, layout=layout)
        y_dead = warpgroup_mma_wait(num_outstanding=0, deps=(gl.zeros([BLOCK_W, BLOCK_T], gl.float32,
                                                                      layout=layout), ))
        x_scale = _transposed_scale(xs_ptrs, ws_ptr, ws_up_ptr, 0, num_k, layout, GATED)
        x_tok = _issue_transposed(x_bufs, w_bufs, ready, base, gl.zeros([BLOCK_W, BLOCK_T], gl.float32,
                                                                     layout=layout), NUM_STAGES, False)
        scale = _transposed_scale(xs_ptrs, ws_ptr, ws_up_ptr, 1, num_k, layout, GATED)
        for pair in range((num_k - 1) // 2):
            step = 1 + 2 * pair
            y_tok, y_scale, x_dead, scale, acc = _transposed_step(
                base, step, num_k, x_tok, x_scale, y_dead, scale, acc, ring, walk, xs_ptrs, ws_ptr, ws_up_ptr,
                m_indices_ptr, N, known, layout, BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
            x_tok, x_scale, y_dead, scale, acc = _transposed_step(
                base, step + 1, num_k, y_tok, y_scale, x_dead, scale, acc, ring, walk, xs_ptrs, ws_ptr,
                ws_up_ptr, m_indices_ptr, N, known, layout, BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
        if (num_k - 1) % 2 == 1:
            y_tok, y_scale, x_dead, scale, acc = _transposed_step(
                base, num_k - 1, num_k, x_tok, x_scale, y_dead, scale, acc, ring, walk, xs_ptrs, ws_ptr,
                ws_up_ptr, m_indices_ptr, N, known, layout, BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
            last, last_scale = _drained(y_tok, y_scale)
        else:
            last, last_scale = _drained(x_tok, x_scale)
        # the last stage refilled (with a later tile's step) before the epilogue
        gl.thread_barrier()
        _load_transposed(x_desc, w_desc, x_bufs, w_bufs, ready, base + num_k - 1 + NUM_STAGES, num_k, walk,
                         m_indices_ptr, N, known, BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
        acc = _promote_transposed(acc, last, last_scale)
        return acc


    @gluon.jit
    def _chained_product(base, num_k, ring, walk, m_indices_ptr, N, known, layout: gl.constexpr, BLOCK_T: gl.constexpr,
                         OUT_ROWS: gl.constexpr, GROUP: gl.constexpr, PAIRS: gl.constexpr,
                         NUM_STAGES: gl.constexpr, GATED: gl.constexpr):
        """A bf16 tile's product at global steps ``base``...: each MMA accumulates into the one before it, one
        left in flight (``wait_group 1``) while the stage of the one before is refilled; the last step's stage
        refilled before it returns."""
        x_desc, w_desc, x_bufs, w_bufs, ready = ring
        acc = _issue_transposed(x_bufs, w_bufs, ready, base, gl.zeros([BLOCK_W, BLOCK_T], gl.float32, layout=layout),
                                NUM_STAGES, False)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))   # (returns at once: the handle as a tensor)
        for step in range(1, num_k):
            acc = _issue_transposed(x_bufs, w_bufs, ready, base + step, acc, NUM_STAGES, True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))   # (MMA step - 1 complete)
            gl.thread_barrier()   # (every warpgroup past MMA step - 1 before its stage is refilled)
            _load_transposed(x_desc, w_desc, x_bufs, w_bufs, ready, base + step - 1 + NUM_STAGES, num_k, walk,
                             m_indices_ptr, N, known, BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()
        _load_transposed(x_desc, w_desc, x_bufs, w_bufs, ready, base + num_k - 1 + NUM_STAGES, num_k, walk,
                         m_indices_ptr, N, known, BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
        return acc


    @gluon_kernel   # (gluon.jit, launched through the package's shortcut: a recorded call replays it)
    def _transposed_kernel(x_desc, w_desc, out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr, rows_used_ptr,
                           out_scale_ptr, N, K, stride_om, stride_xs, stride_wse, stride_wsn, stride_os,
                           NUM_STAGES: gl.constexpr, GROUP: gl.constexpr, GATED: gl.constexpr = False,
                           SCALED: gl.constexpr = True, QUANT_OUT: gl.constexpr = False):
        """``out[r] = dequant(x[r]) @ dequant(w[m_indices[r]])^T`` for the real rows below ``rows_used``, computed
        transposed on tiles of 128 weight rows by ``BLOCK_T`` token rows (``BLOCK_T``: the x box's rows, the
        segments' alignment), each program walking tiles ``pid, pid + P, ...`` with its loads running ahead
        across tiles. ``GATED``: ``w`` holds ``N = 2F`` rows (gate, then up); a tile multiplies 64 gate rows and
        the 64 matching up rows and stores ``silu(gate) * up``, 64 columns of ``[M_pad, F]``. ``SCALED``: fp8
        operands with block scales (a K step of 128); else bf16 (a K step of 64, the 128-byte rows' width), no
        scales (their pointers unused). ``QUANT_OUT`` (fp8, gated): the output quantised as GEMM 2 reads it, fp8
        with one float32 scale per token per 128 columns (``out_scale_ptr``), bit for bit what the bf16 output
        then the quantiser give; the program takes a group's two 64-column tiles back to back."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        layout: gl.constexpr = _acc_layout(BLOCK_T, NUM_WARPS, 32 if SCALED else 16)
        OUT_ROWS: gl.constexpr = BLOCK_W // 2 if GATED else BLOCK_W   # (the output columns of a tile)
        gl.static_assert(w_desc.block_type.shape[0] == OUT_ROWS)
        gl.static_assert(NUM_STAGES >= 2)
        gl.static_assert(not QUANT_OUT or (GATED and SCALED))   # (two 64-column tiles a 128-column group)
        PAIRS: gl.constexpr = QUANT_OUT

        num_pid_t = gl.load(rows_used_ptr) // BLOCK_T
        num_pid_n = (N // 2 if GATED else N) // OUT_ROWS
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        if PAIRS:   # pairs of column tiles, two tiles each
            my_tiles = 2 * (gl.maximum(num_pid_t * (num_pid_n // 2) - pid + nprog - 1, 0) // nprog)
        else:
            my_tiles = gl.maximum(num_pid_t * num_pid_n - pid + nprog - 1, 0) // nprog
        num_k = K // BLOCK_K
        walk = (pid, nprog, my_tiles, num_pid_t, num_pid_n)

        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_T, BLOCK_K], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_W, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
        # The epilogue's tile: its own memory, since the next tile's loads are landing in the ring meanwhile.
        # Rows swizzled (each 4-row phase of 16 XORs the column): read back transposed, 8 rows of one column a
        # thread, it meets 1 bank conflict a wavefront where the plain layout met 15 (gl.bank_conflicts; the
        # store's are unchanged: 1 at 16 tokens, 3 at 32 and 64). The pattern repeats every 64 rows, so the up
        # half's slice starts on it.
        tile = gl.allocate_shared_memory(gl.float32, [BLOCK_W, BLOCK_T], gl.SwizzledSharedLayout(
            vec=1, per_phase=4, max_phase=16, order=[1, 0]))
        if QUANT_OUT:   # a group's first half, bf16, until its second half is done
            stash = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, OUT_ROWS], gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        else:
            stash = ready   # (unused)
        ring = (x_desc, w_desc, x_bufs, w_bufs, ready)
        if my_tiles > 0:   # fill the ring: global steps 0 .. NUM_STAGES - 1 (across tiles where K is short)
            first, _, _ = _known_tiles(0, walk, m_indices_ptr, N, BLOCK_T, OUT_ROWS, GROUP, PAIRS)
            for fill in gl.static_range(NUM_STAGES):
                _load_transposed(x_desc, w_desc, x_bufs, w_bufs, ready, fill, num_k, walk, m_indices_ptr, N, first,
                                 BLOCK_T, OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)

        for t in range(my_tiles):
            known, off_n, expert = _known_tiles(t, walk, m_indices_ptr, N, BLOCK_T, OUT_ROWS, GROUP, PAIRS)
            off_t = known[1]
            if SCALED:
                acc = _promoted_product(t * num_k, num_k, known, off_n, expert, ring, walk, x_scale_ptr, stride_xs,
                                        w_scale_ptr, stride_wse, stride_wsn, m_indices_ptr, N, layout, BLOCK_T,
                                        OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
            else:
                acc = _chained_product(t * num_k, num_k, ring, walk, m_indices_ptr, N, known, layout, BLOCK_T,
                                       OUT_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
            # (the next tile's K loop passes a barrier every step before this tile's memory is written again)
            _store_transposed(acc, tile, out_ptr, m_indices_ptr, off_t, off_n, stride_om,
                              (t % 2, stash, out_scale_ptr, stride_os), BLOCK_T, GATED, QUANT_OUT, NUM_WARPS)

        for stage in gl.static_range(NUM_STAGES):   # every fill was waited for: no copy is left in flight
            mbarrier.invalidate(ready.index(stage))

    def _descriptors(x, w, block_t, gated):
        """TMA descriptors of ``x`` ([M_pad, K], boxes of block_t rows) and of ``w`` viewed as ``[E * N, K]``
        (boxes of 128 rows, gated 64), both 128-byte swizzled: a box's K width is 128 bytes (128 fp8, 64 bf16)."""
        e, n, k = w.shape
        dtype, box_k = (gl.float8e4nv, TILE_K) if w.dtype == torch.float8_e4m3fn else (gl.bfloat16, TILE_K // 2)
        x_layout = gl.NVMMASharedLayout.get_default_for([block_t, box_k], dtype)
        w_layout = gl.NVMMASharedLayout.get_default_for([TILE_W, box_k], dtype)
        return (TensorDescriptor.from_tensor(x, [block_t, box_k], x_layout),
                TensorDescriptor.from_tensor(w.view(e * n, k), [TILE_W // 2 if gated else TILE_W, box_k], w_layout))

    def compile_for_sm90(block_t, stages, num_warps, gated=False, scaled=True, quant_out=False):
        """The kernel compiled for sm_90a (as the per-tile kernel's ``compile_for_sm90``); ``scaled=False``: bf16."""
        dtype = torch.float8_e4m3fn if scaled else torch.bfloat16
        x = torch.empty(block_t, TILE_K, dtype=dtype)
        w = torch.empty(1, 2 * TILE_W, TILE_K, dtype=dtype)
        pointers = {"rows_used_ptr": "*i32", "out_scale_ptr": "*fp32"}
        if not scaled:
            pointers.update(x_scale_ptr="*bf16", w_scale_ptr="*bf16")
        if quant_out:
            pointers["out_ptr"] = "*fp8e4nv"
        return compile_kernel_for_sm90(_transposed_kernel, None, gated, num_warps,
                                       {"NUM_STAGES": stages, "SCALED": scaled, "QUANT_OUT": quant_out}, pointers,
                                       descriptors=_descriptors(x, w, block_t, gated))

    def launch(x, x_scale, w, w_scale, m_indices, rows_used, out, *, block_t, stages, num_warps, gated=False,
               out_scale=None):
        """One program per SM (or per tile, or pair of tiles with ``out_scale``, where there are fewer) on checked
        arguments; ``x_scale`` and ``w_scale`` None for bf16 operands."""
        num_rows, k = x.shape
        n = w.shape[1]
        x_desc, w_desc = _descriptors(x, w, block_t, gated)
        most_tiles = num_rows // block_t * (out.shape[1] // (TILE_W // 2 if gated else TILE_W))
        if out_scale is not None:   # (a program per pair of tiles)
            most_tiles //= 2
        programs = PROGRAMS or torch.cuda.get_device_properties(x.device).multi_processor_count
        grid = (max(1, min(programs, most_tiles)), )
        scaled = x_scale is not None
        quant_out = out_scale is not None
        _transposed_kernel[grid](
            x_desc, w_desc, out, x_scale if scaled else x, w_scale if scaled else x, m_indices, rows_used,
            out_scale if quant_out else rows_used, n, k, out.stride(0), x_scale.stride(0) if scaled else 0,
            w_scale.stride(0) if scaled else 0, w_scale.stride(1) if scaled else 0,
            out_scale.stride(0) if quant_out else 0, NUM_STAGES=stages, GROUP=GROUP_M, GATED=gated, SCALED=scaled,
            QUANT_OUT=quant_out, num_warps=num_warps)

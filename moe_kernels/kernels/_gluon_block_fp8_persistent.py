"""The Gluon block-fp8 grouped GEMM on a persistent grid: one program per SM walks its tiles, and the TMA
loads run ahead across tile boundaries, so that a tile's first K steps are already in shared memory while
the tile before it promotes its last step and stores its output.

Why: one program per tile (:mod:`moe_kernels.kernels._gluon_block_fp8_kernel`) pays, at every tile, the
latency of its first loads and of its epilogue with nothing to overlap them (a 128 x 128 tile with two
products in flight takes about 240 registers a thread at 8 warps: one program an SM). Where the K loop is
short that is a large share: Qwen3-30B-A3B's GEMM 2 (K = 768, six steps of about 0.44 us) ran at 612 TFLOP/s
where its GEMM 1 (16 steps) ran at 885 (``gluon-block-fp8-ab.json``). Here the ring of stages is indexed by
a step count that runs on across the program's tiles: global step ``g`` is step ``g % num_k`` of the
program's tile ``g // num_k``, in stage ``g % NUM_STAGES`` and barrier phase ``(g // NUM_STAGES) & 1``. A
stage freed by MMA ``g`` is refilled with step ``g + NUM_STAGES`` whichever tile that belongs to.

Tiles are the output's 128-row by ``BLOCK_N``-column tiles over the rows the segments use (``rows_used``,
read on the device: no padding tile is visited), in the same grouped order as the per-tile kernel; program
``p`` takes tiles ``p``, ``p + P``, ... A tile's expert is its first row's (a segment starts on a tile and
its last tile's padding follows its real rows, so a tile below ``rows_used`` starts on a real row).

``HALF_TILES``: a tile whose second 64 rows are all padding (row 64 holds -1: a segment's last tile with at
most 64 real rows) multiplies its first 64 rows only. Its accumulator is ``[64, BLOCK_N]`` with the two
warpgroups side by side along N (each an m64 n``BLOCK_N/2`` wgmma), so the tensor cores do half a tile's
work; the loads stay whole 128-row boxes, so the ring does not need to know which tiles are halves. Rounding
each segment's MMA work up to 64 rows instead of 128 takes DeepSeek-V3's routed rows (uniform routing) from
1.47 to 1.24 times the real ones at 4,096 tokens and from 1.13 to 1.06 at 16,384.
"""

from __future__ import annotations

from ._gluon_block_fp8_kernel import GLUON_HOPPER, GROUP_M, TILE_M

#: Programs of the persistent grid: None, one per SM. (Tests set a few, so that each program walks many tiles.)
PROGRAMS = None

if GLUON_HOPPER:
    import triton.language as tl
    from triton.experimental import gluon

    from .._runtime import gluon_kernel
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

    from . import _gluon_block_fp8_kernel as per_tile
    from ._gluon_block_fp8_kernel import (BLOCK_K, BLOCK_M, _descriptors, _grouped_tile, _half_mma_layout,
                                          _issue_mma, _load_into, _mma_layout, _promote, _silu_mul_tile,
                                          _step_scale, _store_gated, _store_plain, compile_kernel_for_sm90)

    HALF_M = gl.constexpr(TILE_M // 2)

    @gluon.jit
    def _drained(token, scale):
        """The last step's product, every MMA complete (``wgmma.wait_group 0``), with its scales."""
        return warpgroup_mma_wait(num_outstanding=0, deps=(token, )), scale


    @gluon.jit
    def _scale_pointers(rows, x_scale_ptr, stride_xs, w_scale_ptr, expert, off_n, N, stride_wse, stride_wsn):
        """A tile's scales, a step's offset from each: its ``rows``' activation scales, and its weight block's
        (gated also the up half's, of weight rows ``N/2 + off_n``...), for output columns ``off_n``..."""
        ws_ptr = w_scale_ptr + expert * stride_wse + (off_n // 128) * stride_wsn
        ws_up_ptr = w_scale_ptr + expert * stride_wse + ((N // 2 + off_n) // 128) * stride_wsn
        return x_scale_ptr + rows * stride_xs, ws_ptr, ws_up_ptr


    @gluon.jit
    def _tile_origin(local_tile, pid, nprog, num_pid_m, num_pid_n, m_indices_ptr, W_ROWS: gl.constexpr,
                     GROUP: gl.constexpr, PAIRS: gl.constexpr):
        """This program's tile ``local_tile`` (its tiles: ``pid``, ``pid + P``, ... in the per-tile kernel's
        grouped order): first row, first output column and expert. ``PAIRS``: the program takes the two column
        tiles of a 128-column group back to back (``pid``'s pair, then ``pid + P``'s, ...)."""
        if PAIRS:
            pid_m, pair_n = _grouped_tile(pid + (local_tile // 2) * nprog, num_pid_m, num_pid_n // 2, GROUP)
            pid_n = 2 * pair_n + local_tile % 2
        else:
            pid_m, pid_n = _grouped_tile(pid + local_tile * nprog, num_pid_m, num_pid_n, GROUP)
        off_m = pid_m * BLOCK_M
        return off_m, pid_n * W_ROWS, gl.load(m_indices_ptr + off_m)


    @gluon.jit
    def _known_tiles(t, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr, N, W_ROWS: gl.constexpr,
                     GROUP: gl.constexpr, PAIRS: gl.constexpr):
        """``(known, off_n, expert)`` of this program's tile ``t``: ``known`` is ``(t, its first row, its first
        weight row, the next tile's first row, its first weight row)``, what :func:`_load_global` needs to load a
        step of either tile without reading ``m_indices`` (the next tile past the last is the last)."""
        off_m, off_n, expert = _tile_origin(t, pid, nprog, num_pid_m, num_pid_n, m_indices_ptr, W_ROWS, GROUP, PAIRS)
        next_m, next_n, next_expert = _tile_origin(gl.minimum(t + 1, my_tiles - 1), pid, nprog, num_pid_m, num_pid_n,
                                                   m_indices_ptr, W_ROWS, GROUP, PAIRS)
        return (t, off_m, expert * N + off_n, next_m, next_expert * N + next_n), off_n, expert


    @gluon.jit
    def _load_global(x_desc, w_desc, a_bufs, b_bufs, ready, g, num_k, pid, nprog, my_tiles, num_pid_m, num_pid_n,
                     m_indices_ptr, N, known, W_ROWS: gl.constexpr, GROUP: gl.constexpr, PAIRS: gl.constexpr,
                     NUM_STAGES: gl.constexpr, GATED: gl.constexpr, INTERLEAVED: gl.constexpr = False):
        """TMA loads of global step ``g`` (step ``g % num_k`` of this program's tile ``g // num_k``) into stage
        ``g % NUM_STAGES``; nothing past the program's last tile. A step of the tiles ``known`` holds
        (:func:`_known_tiles`: the one in the K loop and the next, all a ring no longer than the K loop reaches)
        takes its addresses from there. Reading the tile's expert from ``m_indices`` at every step, as this did
        before, put a global load's latency between every step's MMA wait and its promotion."""
        tile, off_m, w_row, next_m, next_w_row = known
        first = tile * num_k   # (the known tile's step 0: comparisons, no division, on the two tiles' steps)
        local_tile = tile
        step = g - first
        if step >= num_k:
            if step < 2 * num_k:
                off_m, w_row, local_tile, step = next_m, next_w_row, tile + 1, step - num_k
            else:   # (a ring longer than the K loop; past the last tile: its addresses, no copy)
                local_tile, step = g // num_k, g % num_k
                off_m, far_n, expert = _tile_origin(gl.minimum(local_tile, my_tiles - 1), pid, nprog, num_pid_m,
                                                    num_pid_n, m_indices_ptr, W_ROWS, GROUP, PAIRS)
                w_row = expert * N + far_n
        _load_into(x_desc, w_desc, a_bufs, b_bufs, ready, g % NUM_STAGES, off_m, w_row, w_row + N // 2, step,
                   local_tile < my_tiles, GATED, INTERLEAVED)


    @gluon.jit
    def _fill_ring(ring, walk, num_k, m_indices_ptr, N, W_ROWS: gl.constexpr, GROUP: gl.constexpr,
                   PAIRS: gl.constexpr, NUM_STAGES: gl.constexpr, GATED: gl.constexpr,
                   INTERLEAVED: gl.constexpr = False):
        """The ring's first fill: global steps 0 .. NUM_STAGES - 1 (across tiles where K is short), if the program
        has a tile."""
        x_desc, w_desc, a_bufs, b_bufs, ready = ring
        pid, nprog, my_tiles, num_pid_m, num_pid_n = walk
        if my_tiles > 0:
            first, _, _ = _known_tiles(0, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr, N, W_ROWS, GROUP,
                                       PAIRS)
            for fill in gl.static_range(NUM_STAGES):
                _load_global(x_desc, w_desc, a_bufs, b_bufs, ready, fill, num_k, pid, nprog, my_tiles, num_pid_m,
                             num_pid_n, m_indices_ptr, N, first, W_ROWS, GROUP, PAIRS, NUM_STAGES, GATED, INTERLEAVED)


    @gluon.jit
    def _persistent_step(base, step, num_k, inflight, inflight_scale, dead, scale, acc, x_desc, w_desc, a_bufs,
                         b_bufs, ready, xs_ptrs, ws_ptr, ws_up_ptr, pid, nprog, my_tiles, num_pid_m, num_pid_n,
                         m_indices_ptr, N, known, W_ROWS: gl.constexpr, GROUP: gl.constexpr, PAIRS: gl.constexpr,
                         NUM_STAGES: gl.constexpr, GATED: gl.constexpr):
        """The per-tile kernel's overlapped step (``_overlapped_step``) at global step ``base + step``: its MMA
        issued, MMA ``base + step - 1`` waited for (one left in flight) and promoted under it; the freed stage
        refilled with global step ``base + step - 1 + NUM_STAGES``, of this tile or of a later one."""
        following = _step_scale(xs_ptrs, ws_ptr, step + 1, num_k, ws_up_ptr, GATED)
        issued = _issue_mma(a_bufs, b_bufs, ready, base + step, dead, NUM_STAGES)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(inflight, ))
        gl.thread_barrier()   # (both warpgroups past MMA step - 1 before its stage is refilled)
        _load_global(x_desc, w_desc, a_bufs, b_bufs, ready, base + step - 1 + NUM_STAGES, num_k, pid, nprog,
                     my_tiles, num_pid_m, num_pid_n, m_indices_ptr, N, known, W_ROWS, GROUP, PAIRS, NUM_STAGES, GATED)
        acc = _promote(acc, done, inflight_scale, GATED)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))   # (the compiler fence: see _overlapped_step)
        return issued, scale, done, following, acc


    @gluon.jit
    def _store_quantized_half(acc, half, stash, out_ptr, out_scale_ptr, m_indices_ptr, off_m, off_n, stride_om,
                              stride_os, HALF: gl.constexpr, NUM_WARPS: gl.constexpr):
        """A gated tile's ``silu(gate) * up``, rounded to bf16 as the unfused path stores it. The group's first
        half (``half`` 0) waits in ``stash``; the second quantises the group's 128 columns with the quantiser's
        arithmetic (:mod:`moe_kernels.kernels.quant`: amax, scale, divide, clamp, round) and stores both halves
        in fp8 and the rows' scales."""
        y, rows, real, cols = _silu_mul_tile(acc, m_indices_ptr, off_m, off_n, HALF, NUM_WARPS)
        y = y.to(gl.bfloat16)
        kept = stash.slice(0, y.shape[0])   # (a half tile's 64 rows, or all 128)
        if half == 0:
            kept.store(y)
        else:
            gl.thread_barrier()   # (every thread's share of the first half stored)
            first, second, scale = _quantized_group(kept.load(y.type.layout), y)
            offsets = rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
            mask = real[:, None] & (cols >= 0)[None, :]   # (the rows', broadcast over the tile)
            gl.store(out_ptr + offsets - HALF, first, mask=mask)
            gl.store(out_ptr + offsets, second, mask=mask)
            gl.store(out_scale_ptr + rows.to(gl.int64) * stride_os + off_n // 128, scale, mask=real)

    @gluon.jit
    def _quantized_group(first, second):
        """A 128-column group's two bf16 halves in fp8, and each row's float32 scale, with the quantiser's
        arithmetic (:mod:`moe_kernels.kernels.quant`: amax, scale, divide, clamp, round)."""
        first = first.to(gl.float32)
        second = second.to(gl.float32)
        amax = gl.maximum(gl.max(gl.abs(first), axis=1), gl.max(gl.abs(second), axis=1))
        scale = gl.maximum(amax, 1e-10) / 448.0
        # tl.clamp, as the quantiser: min.xorsign.abs (a max/min pair would store -448 for a NaN, it +448)
        first = tl.clamp(first / scale[:, None], -448.0, 448.0)
        second = tl.clamp(second / scale[:, None], -448.0, 448.0)
        return first.to(gl.float8e4nv), second.to(gl.float8e4nv), scale


    @gluon.jit
    def _persistent_tile(t, num_k, known, off_n, expert, ring, walk, tensors, sizes, ROWS: gl.constexpr,
                         mma_layout: gl.constexpr, BLOCK_N: gl.constexpr, W_ROWS: gl.constexpr, GROUP: gl.constexpr,
                         NUM_STAGES: gl.constexpr, GATED: gl.constexpr, QUANT_OUT: gl.constexpr,
                         NUM_WARPS: gl.constexpr, TMA_STORE: gl.constexpr = False):
        """This program's tile ``t``: its K loop (the per-tile kernel's overlapped loop, two steps an
        iteration: see ``_block_fp8_grouped_kernel``) at global steps ``t * num_k`` on, then its epilogue
        while the next tile's first steps land. ``ROWS``: 128, or 64 for a half tile (``mma_layout`` is then
        :func:`_half_mma_layout`'s); only the rows of the expert are stored. (The kernel's arguments come in
        tuples: ``ring`` the descriptors, buffers and barriers, ``walk`` the program's place in the grid,
        ``tensors`` the pointers and the stash, ``sizes`` N, the output's columns and the strides.)"""
        x_desc, w_desc, a_bufs, b_bufs, ready = ring
        pid, nprog, my_tiles, num_pid_m, num_pid_n = walk
        out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr, out_scale_ptr, stash, out_desc = tensors
        N, OUT_N, stride_om, stride_xs, stride_wse, stride_wsn, stride_os = sizes
        base = t * num_k   # the global step of this tile's step 0
        off_m = known[1]
        xs_ptrs, ws_ptr, ws_up_ptr = _scale_pointers(
            off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout)), x_scale_ptr, stride_xs, w_scale_ptr,
            expert, off_n, N, stride_wse, stride_wsn)

        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=mma_layout)
        y_dead = warpgroup_mma_wait(num_outstanding=0, deps=(gl.zeros([ROWS, BLOCK_N], gl.float32,
                                                                      layout=mma_layout), ))
        scale = _step_scale(xs_ptrs, ws_ptr, 0, num_k, ws_up_ptr, GATED)
        x_tok = _issue_mma(a_bufs, b_bufs, ready, base, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=mma_layout),
                                NUM_STAGES)
        x_scale = scale
        scale = _step_scale(xs_ptrs, ws_ptr, 1, num_k, ws_up_ptr, GATED)
        for pair in range((num_k - 1) // 2):
            step = 1 + 2 * pair
            y_tok, y_scale, x_dead, scale, acc = _persistent_step(
                base, step, num_k, x_tok, x_scale, y_dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs, ready,
                xs_ptrs, ws_ptr, ws_up_ptr, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr,
                N, known, W_ROWS, GROUP, QUANT_OUT, NUM_STAGES, GATED)
            x_tok, x_scale, y_dead, scale, acc = _persistent_step(
                base, step + 1, num_k, y_tok, y_scale, x_dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs, ready,
                xs_ptrs, ws_ptr, ws_up_ptr, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr,
                N, known, W_ROWS, GROUP, QUANT_OUT, NUM_STAGES, GATED)
        if (num_k - 1) % 2 == 1:
            y_tok, y_scale, x_dead, scale, acc = _persistent_step(
                base, num_k - 1, num_k, x_tok, x_scale, y_dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs, ready,
                xs_ptrs, ws_ptr, ws_up_ptr, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr,
                N, known, W_ROWS, GROUP, QUANT_OUT, NUM_STAGES, GATED)
            last, last_scale = _drained(y_tok, y_scale)
        else:
            last, last_scale = _drained(x_tok, x_scale)
        # the last step's stage is free: refill it (a later tile's step) before this tile's epilogue
        gl.thread_barrier()
        _load_global(x_desc, w_desc, a_bufs, b_bufs, ready, base + num_k - 1 + NUM_STAGES, num_k, pid, nprog,
                     my_tiles, num_pid_m, num_pid_n, m_indices_ptr, N, known, W_ROWS, GROUP, QUANT_OUT, NUM_STAGES,
                     GATED)
        acc = _promote(acc, last, last_scale, GATED)

        # Epilogue, while the next tile's first steps land: the rows of the expert only.
        if QUANT_OUT:
            _store_quantized_half(acc, t % 2, stash, out_ptr, out_scale_ptr, m_indices_ptr, off_m, off_n,
                                  stride_om, stride_os, W_ROWS, NUM_WARPS)
        elif GATED:
            _store_gated(acc, out_ptr, m_indices_ptr, off_m, off_n, OUT_N, stride_om, W_ROWS, NUM_WARPS)
        elif TMA_STORE and ROWS == BLOCK_M:   # (whole tiles; a half tile stores its rows as below)
            _store_whole_tile(acc, out_desc, stash, off_m, off_n)
        else:
            _store_plain(acc, out_ptr, m_indices_ptr, off_m, off_n, N, stride_om, NUM_WARPS)


    @gluon.jit
    def _store_whole_tile(acc, out_desc, tile, off_m, off_n):
        """A plain tile's epilogue by TMA: the bf16 tile into shared memory, then one asynchronous copy of all its
        rows (padding included) to the output, which runs on while the next tile's MMAs start. The copy before
        it must have read ``tile`` first (``store_wait``, then a barrier: only the threads that issued it wait)."""
        tma.store_wait(0)
        gl.thread_barrier()
        tile.store(acc.to(gl.bfloat16))
        fence_async_shared()   # (the threads' stores, visible to the copy engine)
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], tile)


    @gluon_kernel   # (gluon.jit, launched through the package's shortcut: a recorded call replays it)
    def _block_fp8_grouped_persistent_kernel(x_desc, w_desc, out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr,
                                             rows_used_ptr, out_scale_ptr, N, K, stride_om, stride_xs, stride_wse,
                                             stride_wsn, stride_os, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                                             GROUP: gl.constexpr, GATED: gl.constexpr = False,
                                             QUANT_OUT: gl.constexpr = False, HALF_TILES: gl.constexpr = False,
                                             counter_ptr=None, COUNT_HALVES: gl.constexpr = False, out_desc=None,
                                             TMA_STORE: gl.constexpr = False):
        """The per-tile kernel's product (``_block_fp8_grouped_kernel``, promotion overlapped) over this program's
        tiles ``pid, pid + P, ...`` of the rows used, the loads running ahead across tiles. ``QUANT_OUT`` (gated
        only): the output quantised as GEMM 2 reads it, fp8 with one float32 scale per row per 128 columns
        (``out_scale_ptr``), bit for bit what the bf16 output then the quantiser give; the program takes a
        group's two 64-column tiles back to back, the first's values waiting in shared memory. ``HALF_TILES``:
        a tile with no real row in its second half multiplies 64 rows (the module's docstring)."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        mma_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
        half_layout: gl.constexpr = _half_mma_layout(BLOCK_N, NUM_WARPS)
        W_ROWS: gl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
        gl.static_assert(w_desc.block_type.shape[0] == W_ROWS)
        gl.static_assert(128 % W_ROWS == 0)
        gl.static_assert(NUM_STAGES >= 2)

        gl.static_assert(not QUANT_OUT or (GATED and W_ROWS == 64))   # (two tiles a 128-column group)
        num_pid_m = gl.load(rows_used_ptr) // BLOCK_M
        OUT_N = N // 2 if GATED else N
        num_pid_n = OUT_N // W_ROWS
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        if QUANT_OUT:   # pairs of column tiles, two tiles each
            my_tiles = 2 * (gl.maximum(num_pid_m * (num_pid_n // 2) - pid + nprog - 1, 0) // nprog)
        else:
            my_tiles = gl.maximum(num_pid_m * num_pid_n - pid + nprog - 1, 0) // nprog
        num_k = K // BLOCK_K

        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
        gl.static_assert(not TMA_STORE or not (GATED or QUANT_OUT))   # (plain tiles: GEMM 2)
        if QUANT_OUT:   # a group's first half, bf16, until its second half is done
            stash = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, W_ROWS], gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        elif TMA_STORE:   # the tile the TMA store copies out (the copy engine's own layout)
            stash = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], out_desc.layout)
        else:
            stash = ready   # (unused)
        ring = (x_desc, w_desc, a_bufs, b_bufs, ready)
        walk = (pid, nprog, my_tiles, num_pid_m, num_pid_n)
        _fill_ring(ring, walk, num_k, m_indices_ptr, N, W_ROWS, GROUP, QUANT_OUT, NUM_STAGES, GATED)
        tensors = (out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr, out_scale_ptr, stash, out_desc)
        sizes = (N, OUT_N, stride_om, stride_xs, stride_wse, stride_wsn, stride_os)
        for t in range(my_tiles):
            known, off_n, expert = _known_tiles(t, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr, N,
                                                W_ROWS, GROUP, QUANT_OUT)
            off_m = known[1]
            # (static: a kernel without half tiles must not hold their branch, which Triton 3.6 fails to lower
            # under a constant condition; a pair's two tiles share their rows, so both are halves or neither)
            if HALF_TILES:
                if gl.load(m_indices_ptr + off_m + HALF_M) < 0:
                    if COUNT_HALVES:
                        gl.atomic_add(counter_ptr, 1)
                    _persistent_tile(t, num_k, known, off_n, expert, ring, walk, tensors, sizes, HALF_M, half_layout,
                                     BLOCK_N, W_ROWS, GROUP, NUM_STAGES, GATED, QUANT_OUT, NUM_WARPS, TMA_STORE)
                else:
                    _persistent_tile(t, num_k, known, off_n, expert, ring, walk, tensors, sizes, BLOCK_M, mma_layout,
                                     BLOCK_N, W_ROWS, GROUP, NUM_STAGES, GATED, QUANT_OUT, NUM_WARPS, TMA_STORE)
            else:
                _persistent_tile(t, num_k, known, off_n, expert, ring, walk, tensors, sizes, BLOCK_M, mma_layout,
                                 BLOCK_N, W_ROWS, GROUP, NUM_STAGES, GATED, QUANT_OUT, NUM_WARPS, TMA_STORE)

        for stage in gl.static_range(NUM_STAGES):   # every fill was waited for: no copy is left in flight
            mbarrier.invalidate(ready.index(stage))
        if TMA_STORE:   # the last tile's copy has left shared memory before the program ends
            tma.store_wait(0)


    def _out_descriptor(out, block_n):
        """``out``'s TMA descriptor (bf16, boxes of 128 rows by ``block_n`` columns), for the TMA store."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        layout = gl.NVMMASharedLayout.get_default_for([TILE_M, block_n], gl.bfloat16)
        return TensorDescriptor.from_tensor(out, [TILE_M, block_n], layout)


    def compile_for_sm90(block_n, stages, num_warps, gated=False, quant_out=False, half_tiles=False, count=False,
                         tma_store=False):
        """The kernel compiled for sm_90a (as the per-tile kernel's ``compile_for_sm90``)."""
        import torch
        from triton.runtime.jit import mangle_type

        out = torch.empty(TILE_M, block_n, dtype=torch.bfloat16)   # (a host tensor to spell the descriptor's type)
        pointers = {"rows_used_ptr": "*i32", "out_scale_ptr": "*fp32", "counter_ptr": "*i32",
                    "out_desc": mangle_type(_out_descriptor(out, block_n))}
        if quant_out:
            pointers["out_ptr"] = "*fp8e4nv"
        return compile_kernel_for_sm90(_block_fp8_grouped_persistent_kernel, block_n, gated, num_warps,
                                       {"NUM_STAGES": stages, "QUANT_OUT": quant_out, "HALF_TILES": half_tiles,
                                        "COUNT_HALVES": count, "TMA_STORE": tma_store},
                                       pointers)

    def launch(x, x_scale, w, w_scale, m_indices, rows_used, out, *, block_n, stages, num_warps, gated=False,
               out_scale=None, half_tiles=False, tma_store=False):
        """One program per SM (or per tile, where there are fewer tiles than SMs) on checked arguments."""
        import torch

        num_rows, k = x.shape
        n = w.shape[1]
        x_desc, w_desc = _descriptors(x, w, block_n, gated)
        most_tiles = num_rows // TILE_M * (out.shape[1] // (block_n // 2 if gated else block_n))
        if out_scale is not None:   # (a program per pair of tiles)
            most_tiles //= 2
        programs = PROGRAMS or torch.cuda.get_device_properties(x.device).multi_processor_count
        grid = (max(1, min(programs, most_tiles)), )
        _block_fp8_grouped_persistent_kernel[grid](
            x_desc, w_desc, out, x_scale, w_scale, m_indices, rows_used, x_scale if out_scale is None else out_scale,
            n, k, out.stride(0), x_scale.stride(0), w_scale.stride(0), w_scale.stride(1),
            0 if out_scale is None else out_scale.stride(0), BLOCK_N=block_n, NUM_STAGES=stages, GROUP=GROUP_M,
            GATED=gated, QUANT_OUT=out_scale is not None, HALF_TILES=half_tiles, counter_ptr=per_tile.HALF_TILE_COUNTER,
            COUNT_HALVES=per_tile.HALF_TILE_COUNTER is not None and half_tiles,
            out_desc=_out_descriptor(out, block_n) if tma_store else None, TMA_STORE=tma_store, num_warps=num_warps)

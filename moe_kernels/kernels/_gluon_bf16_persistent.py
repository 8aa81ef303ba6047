"""The bf16 grouped GEMM on the persistent grid (Gluon, Triton 3.6, Hopper): the block-fp8 kernel's walk
(:mod:`moe_kernels.kernels._gluon_block_fp8_persistent`: one program per SM over the 128-row tiles of the rows
the segments use, its TMA ring running ahead across tile boundaries) with bf16 operands. There is no promotion:
each K step's MMA accumulates into the one before it, and one MMA is left in flight while the stage the MMA
before it read is refilled (a K step is 64 bf16, the 128 bytes of one swizzled box).

Why: bf16 prefill (issue 18) ran the permute layout's two GEMMs on the Triton kernel at 0.85-0.87x a balanced
``torch.bmm`` at 16,384 tokens on the H200, and the transposed Gluon kernel's 64-row tiles reached 349 TFLOP/s
there on the H100. This is the 128-row persistent kernel that ran block-fp8 at 720-830 TFLOP/s, without the
scales.

Tiles: 128 rows by ``BLOCK_N`` weight rows, one accumulator, one wgmma a K step. Gated (GEMM 1,
``silu(gate) * up``): ``BLOCK_N / 2`` gate rows and the matching up rows, loaded as two TMA boxes, the gate rows
then the up rows: a whole tile's warpgroups each hold all ``BLOCK_N`` columns of their 64 rows, so each gate column
and its up column, half the tile apart, lie in the same thread. Half tiles, whose warpgroups split N, load quarters
(gate, up, the next gate rows, their up rows: four boxes), so that each warpgroup holds whole pairs; quarters cost
the K loop two more TMA copies a step, and Triton 3.6 puts a CTA barrier between consecutive copies (before session
35 every gated tile took quarters: ``INTERLEAVE_GATED``). The epilogue pairs them in registers
(a reshape, a transpose and a split of the accumulator, which the compiler lays out with no shared memory) and
computes the activation in fp32. (Two accumulators, gate and up, cost two wgmmas a step, each re-reading the A
tile from shared memory; pairing halves of one accumulator through shared memory would take the fp32 tile, 128
KiB at ``BLOCK_N`` 256, more than the ring leaves.) The epilogue stores the rows of the expert (pointer stores),
or each whole tile by one TMA copy that runs on under the next tile's MMAs (``TMA_STORE``: padding rows written
too). ``HALF_TILES``: a tile whose rows 64-127 are padding multiplies 64 rows, the two warpgroups side by side
along N (gated: each holds whole quarters, so its gate and up columns stay together).

``GATHER``: the A rows come from their tokens, not from a packed copy. Row ``r`` of a tile is token
``row_assignments[r] // top_k`` of ``x`` (``[T, K]``; a padding row, ``row_assignments[r] >= T * top_k``, reads
zeros), loaded by ``cp.async`` pointer copies of 16 bytes, four a thread a K step at 8 warps (Hopper's TMA cannot gather
rows), while the weights keep their TMA boxes. Each thread waits for its own copies of a step
(``cp.async.wait_group``, the groups committed one a step), fences them for the tensor cores' proxy, and a CTA
barrier makes every thread's copies visible before the step's wgmma. Why: the permute layout's scatter of the
input writes each token ``k`` times (537 MB at Qwen3-30B-A3B's 16,384 tokens in bf16: 218 us of a 2,431-us layer on
an H100, ``layer-profile-no-graph-copies-s35.json``); gathered, GEMM 1 reads the tokens where they are. (The
Triton kernel's gathered rows, session 23, cost GEMM 1 12-21%, more than the copy.)
"""

from __future__ import annotations

from ._gluon_block_fp8_kernel import GLUON_HOPPER, GROUP_M, TILE_K, TILE_M

#: The K step in bf16 elements: one 128-byte box row (the fp8 kernels' 128 one-byte elements).
TILE_K_BF16 = TILE_K // 2
#: Gated whole tiles load W in quarters too (as half tiles must), four TMA copies a step instead of two: each copy
#: costs the K loop a CTA barrier (Triton 3.6 puts one between consecutive copies), so halves are the default; the
#: switch is for the A/B (``tools/gather_gemm1_ab.py``).
INTERLEAVE_GATED = False

if GLUON_HOPPER:
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .._runtime import gluon_kernel
    from . import _gluon_block_fp8_kernel as per_tile, _gluon_block_fp8_persistent as persistent
    from ._gluon_block_fp8_kernel import BLOCK_M, _store_plain, compile_kernel_for_sm90
    from ._gluon_block_fp8_persistent import (HALF_M, _fill_ring, _known_tiles, _load_global, _out_descriptor,
                                              _store_whole_tile, _tile_origin)

    @gluon.constexpr_function
    def _bf16_layout(rows, columns, num_warps):
        """wgmma's bf16 accumulator for a ``[rows, columns]`` product (k16 instructions): 128 rows with the warps
        stacked along M (two warpgroups of 64 rows, m64 n``columns`` each); a half tile's 64 rows with the
        warpgroups side by side along N (m64 n``columns / 2`` each), as the fp8 kernel's half tiles."""
        if rows == TILE_M:
            return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                             instr_shape=[16, columns, 16])
        groups = num_warps // 4
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups],
                                         instr_shape=[16, columns // groups, 16])

    @gluon.constexpr_function
    def _gather_layout(num_warps):
        """A gathered A tile as 16-byte pieces: eight to a row of 64 bf16, four rows a warp, ``num_warps`` warps a pass
        (at 8 warps 32 rows, four passes)."""
        return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    @gluon.jit
    def _token_rows(off_m, gather, NUM_WARPS: gl.constexpr):
        """Where tile ``off_m``'s rows start in ``x`` (elements: ``row_assignments // top_k`` times its row stride)
        and which of them are real (a padding row holds ``T * top_k``)."""
        x_ptr, row_assignments_ptr, num_assignments, top_k, stride_x = gather
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _gather_layout(NUM_WARPS)))
        assignment = gl.load(row_assignments_ptr + rows)
        # (whole 16-byte pieces: the launch checks that rows start on 16 bytes)
        return gl.multiple_of((assignment // top_k).to(gl.int64) * stride_x, 8), assignment < num_assignments

    @gluon.jit
    def _load_gathered(ring, walk, gather, g, num_k, known, sources, m_indices_ptr, N, W_ROWS: gl.constexpr,
                       GROUP: gl.constexpr, NUM_STAGES: gl.constexpr, GATED: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Global step ``g``'s loads into stage ``g % NUM_STAGES`` (:func:`_load_global`'s walk): the W tile by TMA
        (gated: gate and up halves, or quarters), the A rows from their tokens by ``cp.async`` (``sources``: the known
        tile's and the next one's, :func:`_token_rows`), committed as one group; past the program's last tile the
        copies are masked (zero-filled, nothing read) and the group is still committed, one a step."""
        x_desc, w_desc, a_bufs, b_bufs, ready = ring
        pid, nprog, my_tiles, num_pid_m, num_pid_n = walk
        tile, off_m, w_row, next_m, next_w_row = known
        start, real, next_start, next_real = sources
        local_tile = tile
        step = g - tile * num_k
        if step >= num_k:
            if step < 2 * num_k:
                w_row, local_tile, step = next_w_row, tile + 1, step - num_k
                start, real = next_start, next_real
            else:   # (a ring longer than the K loop: the tile's rows read here)
                local_tile, step = g // num_k, g % num_k
                far_m, far_n, expert = _tile_origin(gl.minimum(local_tile, my_tiles - 1), pid, nprog, num_pid_m,
                                                    num_pid_n, m_indices_ptr, W_ROWS, GROUP, False)
                w_row = expert * N + far_n
                start, real = _token_rows(far_m, gather, NUM_WARPS)
        pred = local_tile < my_tiles
        stage = g % NUM_STAGES
        k = step * x_desc.block_type.shape[1]
        bar = ready.index(stage)
        # the W tile in boxes: one (plain), gate rows then up rows (gated), or quarters, gate, up, the next gate
        # rows, their up rows (gated, interleaved)
        box: gl.constexpr = w_desc.block_type.shape[0]
        parts: gl.constexpr = b_bufs.shape[1] // box
        mbarrier.expect(bar, parts * w_desc.block_type.nbytes, pred=pred)
        for part in gl.static_range(parts):
            row = w_row + (part % 2) * (N // 2) + (part // 2) * box
            tma.async_copy_global_to_shared(w_desc, [row, k], bar, b_bufs.index(stage).slice(part * box, box), pred)
        # >>> book: bf16-gathered-rows
        along_k: gl.constexpr = gl.SliceLayout(0, _gather_layout(NUM_WARPS))
        columns = k + gl.arange(0, x_desc.block_type.shape[1], layout=along_k)
        pieces = gather[0] + start[:, None] + columns[None, :]
        async_copy.async_copy_global_to_shared(a_bufs.index(stage), pieces,
                                               mask=(real & pred)[:, None])
        async_copy.commit_group()
        # <<< book: bf16-gathered-rows

    @gluon.jit
    def _rows_landed(NUM_STAGES: gl.constexpr):
        """Before a step's wgmma on gathered rows: this thread's copies of the step done (the groups committed after
        it may stay in flight), fenced for the tensor cores' proxy, and every thread's (a CTA barrier)."""
        async_copy.wait_group(NUM_STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _refill(ring, walk, gather, g, num_k, known, sources, m_indices_ptr, N, W_ROWS: gl.constexpr,
                GROUP: gl.constexpr, NUM_STAGES: gl.constexpr, GATED: gl.constexpr, GATHER: gl.constexpr,
                NUM_WARPS: gl.constexpr, INTERLEAVED: gl.constexpr):
        """Global step ``g``'s loads: gathered A rows, or both operands by TMA (gated: the W tile in halves, or in
        quarters where ``INTERLEAVED``)."""
        if GATHER:
            _load_gathered(ring, walk, gather, g, num_k, known, sources, m_indices_ptr, N, W_ROWS, GROUP, NUM_STAGES,
                           GATED, NUM_WARPS)
        else:
            x_desc, w_desc, a_bufs, b_bufs, ready = ring
            pid, nprog, my_tiles, num_pid_m, num_pid_n = walk
            _load_global(x_desc, w_desc, a_bufs, b_bufs, ready, g, num_k, pid, nprog, my_tiles, num_pid_m, num_pid_n,
                         m_indices_ptr, N, known, W_ROWS, GROUP, False, NUM_STAGES, GATED, INTERLEAVED)

    @gluon.jit
    def _issue(a_bufs, b_bufs, ready, g, acc, use_acc, NUM_STAGES: gl.constexpr):
        """Wait for global step ``g``'s tiles, then issue its MMA into ``acc`` (``use_acc``: onto what it holds):
        A is the box's first ``acc.shape[0]`` rows (a half tile's 64), W's tile ``[BLOCK_N, 64]`` with K
        contiguous, viewed as the K-major ``[64, BLOCK_N]`` B."""
        stage = g % NUM_STAGES
        mbarrier.wait(ready.index(stage), (g // NUM_STAGES) & 1)
        return warpgroup_mma(a_bufs.index(stage).slice(0, acc.shape[0]), b_bufs.index(stage).permute((1, 0)), acc,
                             use_acc=use_acc, is_async=True)

    @gluon.jit
    def _tile_product(base, num_k, known, sources, ring, walk, gather, m_indices_ptr, N, ROWS: gl.constexpr,
                      layout: gl.constexpr, BLOCK_N: gl.constexpr, W_ROWS: gl.constexpr, GROUP: gl.constexpr,
                      NUM_STAGES: gl.constexpr, GATED: gl.constexpr, GATHER: gl.constexpr, NUM_WARPS: gl.constexpr,
                      INTERLEAVED: gl.constexpr):
        """This program's tile at global steps ``base``...: each MMA accumulates into the one before it, one left
        in flight (``wait_group 1``) while the stage of the one before is refilled, with a step of this tile or of a
        later one; the last step's stage refilled before the epilogue. (``GATHER``: each step's rows waited for
        first, :func:`_rows_landed`.)"""
        x_desc, w_desc, a_bufs, b_bufs, ready = ring
        if GATHER:
            _rows_landed(NUM_STAGES)
        acc = _issue(a_bufs, b_bufs, ready, base, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=layout), False,
                     NUM_STAGES)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))   # (returns at once: the handle as a tensor)
        # >>> book: bf16-k-loop
        for step in range(1, num_k):
            if GATHER:
                _rows_landed(NUM_STAGES)
            acc = _issue(a_bufs, b_bufs, ready, base + step, acc, True, NUM_STAGES)
            # MMA step - 1 complete, MMA step in flight
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # both warpgroups past MMA step - 1 before its stage is refilled
            gl.thread_barrier()
            # its stage takes global step base + step - 1 + NUM_STAGES (this tile or a later)
            _refill(ring, walk, gather, base + step - 1 + NUM_STAGES, num_k, known,
                    sources, m_indices_ptr, N, W_ROWS, GROUP, NUM_STAGES, GATED,
                    GATHER, NUM_WARPS, INTERLEAVED)
        # <<< book: bf16-k-loop
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()
        _refill(ring, walk, gather, base + num_k - 1 + NUM_STAGES, num_k, known, sources, m_indices_ptr, N, W_ROWS,
                GROUP, NUM_STAGES, GATED, GATHER, NUM_WARPS, INTERLEAVED)
        return acc

    @gluon.jit
    def _activated(acc, W_ROWS: gl.constexpr, INTERLEAVED: gl.constexpr):
        """``silu(gate) * up`` in fp32 (the Triton kernel's arithmetic) of a gated product: its columns are (gate or
        up, column), or where ``INTERLEAVED`` (quarter pair, gate or up, column in the quarter); the pairs are
        matched in registers (one thread holds both columns of a pair), output column ``column``, or
        ``pair * W_ROWS / 2 + column``."""
        # >>> book: bf16-gate-up-pairs
        if INTERLEAVED:
            parts = gl.permute(gl.reshape(acc, [acc.shape[0], 2, 2, W_ROWS // 2]), (0, 1, 3, 2))
            gate, up = gl.split(gl.reshape(parts, [acc.shape[0], W_ROWS, 2]))
        else:
            halves = gl.reshape(acc, [acc.shape[0], 2, W_ROWS])
            gate, up = gl.split(gl.permute(halves, (0, 2, 1)))
        return gate * (1.0 / (1.0 + gl.exp(-gate))) * up
        # <<< book: bf16-gate-up-pairs

    @gluon.jit
    def _tile(t, num_k, known, sources, off_n, ring, walk, gather, tensors, N, OUT_N, stride_om, ROWS: gl.constexpr,
              layout: gl.constexpr, BLOCK_N: gl.constexpr, W_ROWS: gl.constexpr, GROUP: gl.constexpr,
              NUM_STAGES: gl.constexpr, GATED: gl.constexpr, TMA_STORE: gl.constexpr, GATHER: gl.constexpr,
              NUM_WARPS: gl.constexpr, INTERLEAVED: gl.constexpr):
        """Tile ``t``'s product on ``ROWS`` rows, then its epilogue while the next tile's first steps land (gated:
        the activation, rounded once to bf16)."""
        out_ptr, m_indices_ptr, stash, out_desc = tensors
        acc = _tile_product(t * num_k, num_k, known, sources, ring, walk, gather, m_indices_ptr, N, ROWS, layout,
                            BLOCK_N, W_ROWS, GROUP, NUM_STAGES, GATED, GATHER, NUM_WARPS, INTERLEAVED)
        if GATED:
            acc = _activated(acc, W_ROWS, INTERLEAVED)
        off_m = known[1]
        if TMA_STORE and ROWS == BLOCK_M:   # (whole tiles; a half tile stores its rows by pointers)
            _store_whole_tile(acc, out_desc, stash, off_m, off_n)
        else:
            _store_plain(acc, out_ptr, m_indices_ptr, off_m, off_n, OUT_N, stride_om, NUM_WARPS)

    @gluon_kernel   # (gluon.jit, launched through the package's shortcut: a recorded call replays it)
    def _bf16_grouped_persistent_kernel(x_desc, w_desc, out_ptr, m_indices_ptr, rows_used_ptr, N, K, stride_om,
                                        BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP: gl.constexpr,
                                        GATED: gl.constexpr = False, HALF_TILES: gl.constexpr = False,
                                        out_desc=None, TMA_STORE: gl.constexpr = False, counter_ptr=None,
                                        COUNT_HALVES: gl.constexpr = False, x_ptr=None, row_assignments_ptr=None,
                                        num_assignments=0, top_k=1, stride_x=0, GATHER: gl.constexpr = False,
                                        INTERLEAVED: gl.constexpr = False):
        """``out[r] = x[r] @ w[m_indices[r]]^T`` (gated: ``silu`` of the gate half times the up half) over this
        program's tiles ``pid, pid + P, ...`` of the rows below ``rows_used``, in the fp8 kernel's grouped order;
        the ring is filled across tile boundaries (global step ``g``: step ``g % num_k`` of the program's tile
        ``g // num_k``, in stage ``g % NUM_STAGES``). ``COUNT_HALVES``: each half tile adds one to a test's
        counter (the fp8 kernels' ``HALF_TILE_COUNTER``), so that a test sees the path taken. ``GATHER``: row ``r``
        is ``x_ptr``'s row ``row_assignments[r] // top_k`` (``x_desc`` then only shapes the ring's A buffers); each
        tile's token rows are read a tile ahead, carried over the loop."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        W_ROWS: gl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
        whole: gl.constexpr = _bf16_layout(BLOCK_M, BLOCK_N, NUM_WARPS)
        half: gl.constexpr = _bf16_layout(HALF_M, BLOCK_N, NUM_WARPS)
        # (gated: the W tile's gate and up halves, or quarters, which half tiles need: their warpgroups split N)
        gl.static_assert(not (GATED and HALF_TILES) or INTERLEAVED)
        gl.static_assert(w_desc.block_type.shape[0] == (BLOCK_N // 4 if INTERLEAVED else
                                                        BLOCK_N // 2 if GATED else BLOCK_N))
        gl.static_assert(NUM_STAGES >= 2)
        num_pid_m = gl.load(rows_used_ptr) // BLOCK_M
        OUT_N = N // 2 if GATED else N
        num_pid_n = OUT_N // W_ROWS
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        my_tiles = gl.maximum(num_pid_m * num_pid_n - pid + nprog - 1, 0) // nprog
        num_k = K // x_desc.block_type.shape[1]

        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, x_desc.block_type.shape[1]],
                                           x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, x_desc.block_type.shape[1]],
                                           w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
        if TMA_STORE:   # the tile the TMA store copies out (the copy engine's own layout)
            stash = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, W_ROWS], out_desc.layout)
        else:
            stash = ready   # (unused)
        ring = (x_desc, w_desc, a_bufs, b_bufs, ready)
        walk = (pid, nprog, my_tiles, num_pid_m, num_pid_n)
        gather = (x_ptr, row_assignments_ptr, num_assignments, top_k, stride_x)
        if GATHER:   # (the next tile's token rows, carried over the loop: their read lands under a tile's MMAs)
            next_start = gl.zeros([BLOCK_M], gl.int64, layout=gl.SliceLayout(1, _gather_layout(NUM_WARPS)))
            next_real = next_start < 0
            if my_tiles > 0:
                first, _, _ = _known_tiles(0, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr, N, W_ROWS,
                                           GROUP, False)
                next_start, next_real = _token_rows(first[1], gather, NUM_WARPS)
                sources = (next_start, next_real) + _token_rows(first[3], gather, NUM_WARPS)
                for fill in gl.static_range(NUM_STAGES):
                    _load_gathered(ring, walk, gather, fill, num_k, first, sources, m_indices_ptr, N, W_ROWS, GROUP,
                                   NUM_STAGES, GATED, NUM_WARPS)
        else:
            _fill_ring(ring, walk, num_k, m_indices_ptr, N, W_ROWS, GROUP, False, NUM_STAGES, GATED, INTERLEAVED)
        tensors = (out_ptr, m_indices_ptr, stash, out_desc)
        for t in range(my_tiles):
            known, off_n, _ = _known_tiles(t, pid, nprog, my_tiles, num_pid_m, num_pid_n, m_indices_ptr, N, W_ROWS,
                                           GROUP, False)
            if GATHER:
                start, real = next_start, next_real
                next_start, next_real = _token_rows(known[3], gather, NUM_WARPS)
                sources = (start, real, next_start, next_real)
            else:
                sources = (0, 0, 0, 0)
            # (static, as in the fp8 kernel: Triton 3.6 fails to lower the half tiles' branch under a constant)
            if HALF_TILES:
                if gl.load(m_indices_ptr + known[1] + HALF_M) < 0:
                    if COUNT_HALVES:
                        gl.atomic_add(counter_ptr, 1)
                    _tile(t, num_k, known, sources, off_n, ring, walk, gather, tensors, N, OUT_N, stride_om, HALF_M,
                          half, BLOCK_N, W_ROWS, GROUP, NUM_STAGES, GATED, TMA_STORE, GATHER, NUM_WARPS, INTERLEAVED)
                else:
                    _tile(t, num_k, known, sources, off_n, ring, walk, gather, tensors, N, OUT_N, stride_om, BLOCK_M,
                          whole, BLOCK_N, W_ROWS, GROUP, NUM_STAGES, GATED, TMA_STORE, GATHER, NUM_WARPS, INTERLEAVED)
            else:
                _tile(t, num_k, known, sources, off_n, ring, walk, gather, tensors, N, OUT_N, stride_om, BLOCK_M, whole,
                      BLOCK_N, W_ROWS, GROUP, NUM_STAGES, GATED, TMA_STORE, GATHER, NUM_WARPS, INTERLEAVED)

        if GATHER:   # (the groups past the last tile only zero-fill; none is left in flight)
            async_copy.wait_group(0)
        for stage in gl.static_range(NUM_STAGES):   # every fill was waited for: no copy is left in flight
            mbarrier.invalidate(ready.index(stage))
        if TMA_STORE:   # the last tile's copy has left shared memory before the program ends
            tma.store_wait(0)

    def _descriptors(x, w, block_n, gated, interleaved=False):
        """TMA descriptors of ``x`` (``[M_pad, K]``, boxes of 128 rows by 64) and of ``w`` viewed as
        ``[E * N, K]`` (boxes of ``block_n`` rows; gated half as many, a gate box and an up box, or with
        ``interleaved`` a quarter as many, two of each), 128-byte swizzled; the W box's layout is the whole tile's."""
        e, n, k = w.shape
        x_layout = gl.NVMMASharedLayout.get_default_for([TILE_M, TILE_K_BF16], gl.bfloat16)
        w_layout = gl.NVMMASharedLayout.get_default_for([block_n, TILE_K_BF16], gl.bfloat16)
        return (TensorDescriptor.from_tensor(x, [TILE_M, TILE_K_BF16], x_layout),
                TensorDescriptor.from_tensor(w.view(e * n, k), [block_n // (4 if interleaved else 2 if gated else 1),
                                                                    TILE_K_BF16],
                                             w_layout))

    def compile_for_sm90(block_n, stages, num_warps=8, gated=False, half_tiles=False, tma_store=False, gather=False):
        """The kernel compiled for sm_90a (as the fp8 kernels' ``compile_for_sm90``; nothing is launched)."""
        from triton.runtime.jit import mangle_type

        # (host tensors only to spell the descriptors' types)
        x = torch.empty(TILE_M, TILE_K_BF16, dtype=torch.bfloat16)
        w = torch.empty(1, block_n, TILE_K_BF16, dtype=torch.bfloat16)
        out = torch.empty(TILE_M, block_n // 2 if gated else block_n, dtype=torch.bfloat16)
        pointers = {"rows_used_ptr": "*i32", "counter_ptr": "*i32",
                    "out_desc": mangle_type(_out_descriptor(out, out.shape[1]))}
        if gather:
            pointers.update(x_ptr="*bf16", row_assignments_ptr="*i32")
        interleaved = gated and (half_tiles or INTERLEAVE_GATED)
        return compile_kernel_for_sm90(_bf16_grouped_persistent_kernel, block_n, gated, num_warps,
                                       {"NUM_STAGES": stages, "HALF_TILES": half_tiles, "TMA_STORE": tma_store,
                                        "GATHER": gather, "INTERLEAVED": interleaved}, pointers,
                                       _descriptors(x, w, block_n, gated, interleaved))

    def launch(x, w, m_indices, rows_used, out, *, block_n, stages, num_warps=8, gated=False, half_tiles=False,
               tma_store=False, group_m=GROUP_M, row_assignments=None, top_k=1):
        """One program per SM (or per tile, where there are fewer tiles than SMs; the fp8 kernel's
        ``PROGRAMS`` where a test sets it) on checked arguments; with ``row_assignments``, ``x`` is the tokens
        ``[T, K]`` that the rows gather (its descriptor only shapes the ring)."""
        num_rows, k = m_indices.shape[0], x.shape[1]
        interleaved = gated and (half_tiles or INTERLEAVE_GATED)
        x_desc, w_desc = _descriptors(x, w, block_n, gated, interleaved)
        gather = {} if row_assignments is None else dict(
            x_ptr=x, row_assignments_ptr=row_assignments, num_assignments=x.shape[0] * top_k, top_k=top_k,
            stride_x=x.stride(0), GATHER=True)
        most_tiles = num_rows // TILE_M * (out.shape[1] // (block_n // 2 if gated else block_n))
        programs = persistent.PROGRAMS or torch.cuda.get_device_properties(x.device).multi_processor_count
        grid = (max(1, min(programs, most_tiles)), )
        _bf16_grouped_persistent_kernel[grid](
            x_desc, w_desc, out, m_indices, rows_used, w.shape[1], k, out.stride(0), BLOCK_N=block_n,
            NUM_STAGES=stages, GROUP=group_m, GATED=gated, HALF_TILES=half_tiles,
            out_desc=_out_descriptor(out, block_n // 2 if gated else block_n) if tma_store else None, TMA_STORE=tma_store,
            counter_ptr=per_tile.HALF_TILE_COUNTER, COUNT_HALVES=per_tile.HALF_TILE_COUNTER is not None and half_tiles,
            INTERLEAVED=interleaved, num_warps=num_warps, **gather)

"""The permute layout's block-fp8 grouped GEMM in Gluon (Triton 3.6's API, Hopper): each K step's
promotion overlapped with the next step's MMA. The public side, its checks and its torch reference are in
:mod:`moe_kernels.kernels.gluon_block_fp8`; this module holds the kernel, defined only where Triton 3.6's
Gluon for NVIDIA GPUs imports (:data:`GLUON_HOPPER`; later Tritons changed the API; no interpreter).

A block-fp8 K step (one float32 scale per row per 128 columns of K for the activations, one per 128 x 128
block for the weights) multiplies its 128-deep product by the row's and the block's scales before adding it
to the accumulator (the "promotion"). Triton 3.6 waits for every such product (``wgmma.wait_group 0``)
before promoting it, so the tensor cores idle while the CUDA cores promote. Here step s+1's MMA is issued
before step s is promoted and the wait leaves one MMA outstanding (``wait_group 1``), so the promotion runs
under the next MMA (what DeepGEMM does in CUDA). On the H200 (``gluon-block-fp8-ab.json``) that ran
DeepSeek-V3's GEMM 1 at 798 TFLOP/s and GEMM 2 at 794 at 16,384 tokens, against 698 and 645 for the Triton
path and 684 and 626 for this kernel promoting in order.

Over 400 lines: the K loop's pieces (TMA loads, the MMA's issue, the scales, the promotion, both step orders)
and the epilogues are shared by the persistent and transposed kernels, and read best beside the one kernel
whose docstrings explain them.
"""

from __future__ import annotations

import torch

from .._runtime import HAS_TRITON, INTERPRET, gluon_kernel

TILE_M = 128   # one expert per M tile: the permute layout's segments are aligned to 128 rows
TILE_K = 128   # one K step per scale block: one activation scale per row, one weight scale per step
GROUP_M = 8    # M tiles visited before the next N tile (the weight tile stays in L2 across them)
#: A test's int32 ``[1]`` counter (None: none): each half tile adds one (this kernel's and the persistent
#: grid's), so that a test sees the path taken.
HALF_TILE_COUNTER = None

#: Whether Triton 3.6's Gluon for NVIDIA GPUs imports here (and kernels are compiled, not interpreted).
GLUON_HOPPER = False
if HAS_TRITON and not INTERPRET:
    try:
        import triton
        if triton.__version__.startswith("3.6."):
            from triton.experimental import gluon
            from triton.experimental.gluon import language as gl
            from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                                          warpgroup_mma_wait)
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
            GLUON_HOPPER = True
    except ImportError:   # (a Triton without the NVIDIA backend or without Gluon)
        GLUON_HOPPER = False

if GLUON_HOPPER:
    BLOCK_M, BLOCK_K = gl.constexpr(TILE_M), gl.constexpr(TILE_K)   # (the kernel's view of the same)


    # ---- layouts -----------------------------------------------------------------------------------------------

    @gluon.constexpr_function
    def _mma_layout(block_n, num_warps):
        """wgmma's accumulator layout: warps stacked along M, 16 rows each (4 warps = a warpgroup = 64 rows;
        8 warps are two warpgroups of 64 rows, each issuing its own wgmmas on its half of the A tile), every
        warp spanning the whole N tile, so one wgmma instruction is m64 n``block_n`` k32 (fp8: k = 32)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 32])


    @gluon.constexpr_function
    def _half_mma_layout(block_n, num_warps):
        """A half tile's accumulator, ``[64, block_n]``: each warpgroup holds all 64 rows of its own share of
        the columns (8 warps: two of ``block_n / 2``), so each issues m64 n``block_n/2`` k32 wgmmas; together
        they make half the MMAs of a 128-row tile (the tensor cores are the SM's, shared by its warpgroups)."""
        groups = num_warps // 4
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups],
                                         instr_shape=[16, block_n // groups, 32])


    @gluon.constexpr_function
    def _store_layout(block_n, num_warps):
        """The epilogue's layout: 8 consecutive bf16 (16 bytes) per thread along N, a warp covering whole rows."""
        across = block_n // 8
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // across, across],
                                warps_per_cta=[num_warps, 1], order=[1, 0])


    # ---- the K loop's pieces -------------------------------------------------------------------------------------

    @gluon.jit
    def _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, step, num_k, NUM_STAGES: gl.constexpr,
                   w_row_up=0, GATED: gl.constexpr = False):
        """TMA loads of K step ``step`` (its A and W tiles) into stage ``step % NUM_STAGES``, signalling
        that stage's barrier; nothing past the last step (``pred``: no expect, no copy, so the barrier's
        phase does not move and is never waited for). (Triton 3.6's shared-memory barrier analysis puts a
        ``bar.sync`` between consecutive operations on one barrier array: before the copies and before each
        wait, a few per step in both orders; the copies are issued by one elected thread of warp 0.)"""
        _load_into(x_desc, w_desc, a_bufs, b_bufs, ready, step % NUM_STAGES, off_m, w_row, w_row_up, step,
                   step < num_k, GATED)


    @gluon.jit
    def _load_into(x_desc, w_desc, a_bufs, b_bufs, ready, stage, off_m, w_row, w_row_up, step, pred,
                   GATED: gl.constexpr = False, INTERLEAVED: gl.constexpr = False):
        """K step ``step``'s A tile (rows ``off_m``...) and W tile (rows ``w_row``..., gated also ``w_row_up``...)
        into stage ``stage``, where ``pred``. (A step is the boxes' K width: 128 fp8 or 64 bf16, 128 bytes.)
        ``INTERLEAVED`` (gated): the W tile in quarters, gate rows, up rows, the next gate rows, their up rows, so
        that a gate column and its up column lie a quarter of the tile (``block_n / 4`` columns) apart in one
        warpgroup's product."""
        bar = ready.index(stage)
        k = step * x_desc.block_type.shape[1]
        # arrive.expect_tx: the barrier (count 1) completes its phase once every box's bytes have landed
        # (whole boxes: the tiles never cross the tensors' edges, K and N being multiples of the tiles)
        if GATED and INTERLEAVED:
            quarter: gl.constexpr = w_desc.block_type.shape[0]
            mbarrier.expect(bar, x_desc.block_type.nbytes + 4 * w_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, a_bufs.index(stage), pred)
            for part in gl.static_range(4):   # (gate, up, gate, up)
                row = (w_row if part % 2 == 0 else w_row_up) + (part // 2) * quarter
                tma.async_copy_global_to_shared(w_desc, [row, k], bar, b_bufs.index(stage).slice(part * quarter, quarter),
                                                pred)
        elif GATED:   # the W tile's first half from the gate rows, its second from the matching up rows
            half: gl.constexpr = w_desc.block_type.shape[0]
            mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, a_bufs.index(stage), pred)
            tma.async_copy_global_to_shared(w_desc, [w_row, k], bar,
                                            b_bufs.index(stage).slice(0, half), pred)
            tma.async_copy_global_to_shared(w_desc, [w_row_up, k], bar,
                                            b_bufs.index(stage).slice(half, half), pred)
        else:
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, a_bufs.index(stage), pred)
            tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, b_bufs.index(stage), pred)


    @gluon.jit
    def _issue_mma(a_bufs, b_bufs, ready, step, dead, NUM_STAGES: gl.constexpr):
        """Wait for step ``step``'s tiles, then issue its MMA, asynchronously, into a fresh product
        (``use_acc=False``: the product is the step's alone, to be scaled before it is added). ``dead`` is a
        product already promoted: its registers become this MMA's (no copy of a zero tile into them); its
        rows are the tile's (128, or a half tile's 64)."""
        stage = step % NUM_STAGES
        # the stage's (step // NUM_STAGES)-th fill: phases alternate 0, 1, 0, ... with each fill
        mbarrier.wait(ready.index(stage), (step // NUM_STAGES) & 1)
        # A: the box's first dead.shape[0] rows (all 128; a half tile's 64, the rest being padding).
        # W's tile is [BLOCK_N, BLOCK_K], K contiguous; viewed as [K, N] it is wgmma's K-major B (the only
        # B an fp8 wgmma takes). max_num_imprecise_acc is Triton's sm_90 default (2**30): no promotion inside.
        return warpgroup_mma(a_bufs.index(stage).slice(0, dead.shape[0]), b_bufs.index(stage).permute((1, 0)), dead,
                             use_acc=False, is_async=True)


    @gluon.jit
    def _step_scale(xs_ptrs, ws_ptr, step, num_k, ws_up_ptr=0, GATED: gl.constexpr = False):
        """Step ``step``'s scale of each row of the tile, ``a_scale[row] * w_scale`` (one weight scale: the
        N tile lies in one 128-row scale block), in the accumulator's row layout. Clamped to the last step:
        the scale one past it is loaded (the loop loads a step ahead) but never used. ``GATED``: the rows'
        scales and the two weight scales, of the gate half and of the up half, kept apart."""
        s = gl.minimum(step, num_k - 1)
        if GATED:
            return gl.load(xs_ptrs + s), gl.load(ws_ptr + s), gl.load(ws_up_ptr + s)
        else:
            return gl.load(xs_ptrs + s) * gl.load(ws_ptr + s)


    @gluon.jit
    def _promote(acc, done, scale, GATED: gl.constexpr = False):
        """``acc + done * scale``: the product of one K step, scaled, into the accumulator. ``GATED``: the
        tile's first half of columns (gate) takes the gate's weight scale, the second (up) the up's."""
        if GATED:   # (each row's two scales once; the column test folds away, leaving one FMA an element)
            rows_scale, gate_scale, up_scale = scale
            cols = gl.arange(0, done.shape[1], layout=gl.SliceLayout(0, done.type.layout))
            gate_half = (cols < done.shape[1] // 2)[None, :]
            return acc + done * gl.where(gate_half, (rows_scale * gate_scale)[:, None], (rows_scale * up_scale)[:, None])
        else:
            return acc + done * scale[:, None]


    @gluon.jit
    def _overlapped_step(step, num_k, inflight, inflight_scale, dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs,
                         ready, off_m, w_row, xs_ptrs, ws_ptr, NUM_STAGES: gl.constexpr, w_row_up=0, ws_up_ptr=0,
                         GATED: gl.constexpr = False):
        """K step ``step`` with the promotion overlapped: MMA ``step`` is issued first, then MMA ``step - 1``
        (``inflight``, scales ``inflight_scale``) is waited for with one MMA left outstanding and promoted
        while MMA ``step`` runs. ``scale`` holds step ``step``'s scales (loaded a step ago). Returns the new
        in-flight product and its scales, the promoted product (now dead: its registers take the next MMA),
        the next step's scales and the accumulator."""
        # the next step's scales now, so that their loads' latency hides behind this step
        following = _step_scale(xs_ptrs, ws_ptr, step + 1, num_k, ws_up_ptr, GATED)
        issued = _issue_mma(a_bufs, b_bufs, ready, step, dead, NUM_STAGES)
        # wgmma.wait_group 1: every MMA but the one just issued is complete; the deps make the compiler
        # read ``inflight``'s registers only after the wait (``issued``'s are not read until the next step)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(inflight, ))
        # Each warpgroup waits for its own wgmmas only, and the TMA copy below is issued by one thread: both
        # warpgroups must be past MMA step-1 before its stage is refilled, or the copy overwrites tiles the
        # other warpgroup's MMA is still reading.
        gl.thread_barrier()
        _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, step - 1 + NUM_STAGES, num_k, NUM_STAGES,
                   w_row_up, GATED)
        # the promotion: on the CUDA cores, while the tensor cores run MMA ``step``
        acc = _promote(acc, done, inflight_scale, GATED)
        # A fence for the compiler (the wait is a no-op here: at most MMA ``step`` is outstanding): it takes
        # ``acc``, so the promotion is computed before it, and the next MMA (which writes ``done``'s registers)
        # is issued after it. Without it LLVM sinks the promotion past the next MMA's issue and must copy
        # ``done`` to keep it, and ptxas, seeing registers of an MMA in flight written by a copy, serialises
        # the MMAs (C7515).
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        return issued, scale, done, following, acc


    @gluon.jit
    def _in_order_step(step, num_k, dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, xs_ptrs,
                       ws_ptr, NUM_STAGES: gl.constexpr, w_row_up=0, ws_up_ptr=0, GATED: gl.constexpr = False):
        """K step ``step`` promoted in order (what Triton compiles ``tl.dot`` then the promotion to): issue the
        MMA, wait for it (``wait_group 0``), refill its stage, promote. The scales are loaded a step ahead,
        as in the overlapped order, so that the A/B differs in the overlap alone."""
        following = _step_scale(xs_ptrs, ws_ptr, step + 1, num_k, ws_up_ptr, GATED)
        issued = _issue_mma(a_bufs, b_bufs, ready, step, dead, NUM_STAGES)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(issued, ))
        gl.thread_barrier()   # (both warpgroups past MMA ``step``: see _overlapped_step)
        _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, step + NUM_STAGES, num_k, NUM_STAGES,
                   w_row_up, GATED)
        acc = _promote(acc, done, scale, GATED)
        # (the compiler fence of _overlapped_step: the promotion stays before the next MMA's issue, in order)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return done, following, acc


    # ---- the kernel ----------------------------------------------------------------------------------------------

    @gluon.jit
    def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP: gl.constexpr):
        """Tile ``tile``'s (M index, N index) in the grouped order: GROUP M tiles (mostly one expert's) share
        each N tile while it is in L2."""
        in_group = GROUP * num_pid_n
        first_m = (tile // in_group) * GROUP
        group_size = gl.minimum(num_pid_m - first_m, GROUP)
        return first_m + (tile % in_group) % group_size, (tile % in_group) // group_size


    @gluon_kernel   # (gluon.jit, launched through the package's shortcut: a recorded call replays it)
    def _block_fp8_grouped_kernel(x_desc, w_desc, out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr, num_rows, N, K,
                                  stride_om, stride_xs, stride_wse, stride_wsn, BLOCK_N: gl.constexpr,
                                  NUM_STAGES: gl.constexpr, OVERLAP: gl.constexpr, GROUP: gl.constexpr,
                                  GATED: gl.constexpr = False, HALF_TILES: gl.constexpr = False, counter_ptr=None,
                                  COUNT_HALVES: gl.constexpr = False):
        """One program per [BLOCK_M, BLOCK_N] output tile of the permute layout's grouped GEMM:
        ``out[r] = dequant(x[r]) @ dequant(w[m_indices[r]])^T`` for its rows with ``m_indices >= 0``.
        ``GATED`` (GEMM 1, ``w`` of ``N = 2F`` rows, gate then up): the MMA's N tile is BLOCK_N / 2 gate rows
        and the matching up rows, and the tile stores ``silu(gate) * up``, BLOCK_N / 2 columns of ``[M, F]``.
        ``HALF_TILES``: a tile whose row 64 is padding (a segment's last, with at most 64 real rows: no real
        row follows) multiplies its first 64 rows only, half the MMAs (``COUNT_HALVES``: a test's counter)."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        store_layout: gl.constexpr = _store_layout(BLOCK_N, NUM_WARPS)
        gl.static_assert(x_desc.block_type.shape[0] == BLOCK_M)
        gl.static_assert(x_desc.block_type.shape[1] == BLOCK_K)
        # the W box: the whole N tile, or each half of it (gated)
        W_ROWS: gl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
        gl.static_assert(w_desc.block_type.shape[0] == W_ROWS)
        gl.static_assert(128 % W_ROWS == 0)   # each W box inside one weight scale block: one scale per step
        gl.static_assert(NUM_STAGES >= 2)

        num_pid_m = num_rows // BLOCK_M
        OUT_N = N // 2 if GATED else N   # the output's columns
        num_pid_n = OUT_N // W_ROWS
        pid_m, pid_n = _grouped_tile(gl.program_id(0), num_pid_m, num_pid_n, GROUP)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * W_ROWS   # the first output column (gated: of gate row off_n and up row N/2 + off_n)

        # The tile's expert: segments are aligned to 128 rows, so the tile's real rows share one expert and
        # its padding rows hold -1; the max is that expert, or -1 for a tile of padding, which writes nothing.
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
        expert = gl.max(gl.load(m_indices_ptr + rows), axis=0)
        if expert < 0:
            return

        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
        # fill the ring: steps 0 .. NUM_STAGES - 1 (those that exist; whole 128-row boxes, half tile or not)
        num_k = K // BLOCK_K
        w_row = expert * N + off_n   # w viewed as [E * N, K]
        for i in gl.static_range(NUM_STAGES):
            _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, i, num_k, NUM_STAGES, w_row + N // 2,
                       GATED)

        ring = (x_desc, w_desc, a_bufs, b_bufs, ready)
        tensors = (out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr)
        sizes = (N, K, stride_om, stride_xs, stride_wse, stride_wsn)
        # (static: a kernel without half tiles must not hold their branch, which Triton 3.6 fails to lower
        # under a constant condition)
        if HALF_TILES:
            if gl.load(m_indices_ptr + off_m + BLOCK_M // 2) < 0:
                if COUNT_HALVES:
                    gl.atomic_add(counter_ptr, 1)
                _tile(off_m, off_n, expert, ring, tensors, sizes, BLOCK_M // 2, _half_mma_layout(BLOCK_N, NUM_WARPS),
                      BLOCK_N, W_ROWS, NUM_STAGES, OVERLAP, GATED, NUM_WARPS)
            else:
                _tile(off_m, off_n, expert, ring, tensors, sizes, BLOCK_M, _mma_layout(BLOCK_N, NUM_WARPS), BLOCK_N,
                      W_ROWS, NUM_STAGES, OVERLAP, GATED, NUM_WARPS)
        else:
            _tile(off_m, off_n, expert, ring, tensors, sizes, BLOCK_M, _mma_layout(BLOCK_N, NUM_WARPS), BLOCK_N,
                  W_ROWS, NUM_STAGES, OVERLAP, GATED, NUM_WARPS)


    @gluon.jit
    def _tile(off_m, off_n, expert, ring, tensors, sizes, ROWS: gl.constexpr, mma_layout: gl.constexpr,
              BLOCK_N: gl.constexpr, W_ROWS: gl.constexpr, NUM_STAGES: gl.constexpr, OVERLAP: gl.constexpr,
              GATED: gl.constexpr, NUM_WARPS: gl.constexpr):
        """The tile's K loop, its ring already filled, and its epilogue, on ``ROWS`` rows: 128, or a half
        tile's 64 (``mma_layout``: :func:`_mma_layout`'s or :func:`_half_mma_layout`'s). (The kernel's
        arguments come in tuples: ``ring`` the descriptors, buffers and barriers, ``tensors`` the pointers,
        ``sizes`` N, K and the strides.)"""
        x_desc, w_desc, a_bufs, b_bufs, ready = ring
        out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr = tensors
        N, K, stride_om, stride_xs, stride_wse, stride_wsn = sizes
        num_k = K // BLOCK_K
        w_row = expert * N + off_n   # w viewed as [E * N, K]
        w_row_up = w_row + N // 2    # (gated: the up rows of the same columns)
        # Scales in the accumulator's row layout (a slice of the MMA layout): each thread gets the scales of
        # exactly the rows its accumulator registers hold, so the promotion needs no layout conversion.
        scale_rows = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
        xs_ptrs = x_scale_ptr + scale_rows * stride_xs              # + step: x_scale[row, step]
        ws_ptr = w_scale_ptr + expert * stride_wse + (off_n // 128) * stride_wsn   # + step: w_scale[e, n // 128, step]
        ws_up_ptr = w_scale_ptr + expert * stride_wse + ((N // 2 + off_n) // 128) * stride_wsn   # (gated)

        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=mma_layout)
        if OVERLAP:
            # Two products in flight by turns: X (the MMA issued last step) and Y (promoted last step, its
            # registers reused by this step's MMA). The loop runs two steps per iteration so that X and Y stay
            # in their own registers: with one step per iteration the loop would have to carry "the in-flight
            # product" across the swap, copying registers an MMA is still writing (ptxas would then wait for
            # it, serialising the MMAs).
            # Y's first registers, defined before MMA 0 is issued (no MMA may be in flight while plain
            # instructions write registers a later MMA accumulates into: C7515 again); the wait makes them
            # opaque values defined here rather than constants LLVM would materialise after MMA 0's issue.
            y_dead = warpgroup_mma_wait(num_outstanding=0, deps=(gl.zeros([ROWS, BLOCK_N], gl.float32,
                                                                          layout=mma_layout), ))
            scale = _step_scale(xs_ptrs, ws_ptr, 0, num_k, ws_up_ptr, GATED)
            x_tok = _issue_mma(a_bufs, b_bufs, ready, 0, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=mma_layout),
                               NUM_STAGES)
            x_scale = scale
            scale = _step_scale(xs_ptrs, ws_ptr, 1, num_k, ws_up_ptr, GATED)
            for i in range((num_k - 1) // 2):
                step = 1 + 2 * i
                y_tok, y_scale, x_dead, scale, acc = _overlapped_step(step, num_k, x_tok, x_scale, y_dead, scale, acc,
                                                                      x_desc, w_desc, a_bufs, b_bufs, ready, off_m,
                                                                      w_row, xs_ptrs, ws_ptr, NUM_STAGES, w_row_up,
                                                                      ws_up_ptr, GATED)
                x_tok, x_scale, y_dead, scale, acc = _overlapped_step(step + 1, num_k, y_tok, y_scale, x_dead, scale, acc,
                                                                      x_desc, w_desc, a_bufs, b_bufs, ready, off_m,
                                                                      w_row, xs_ptrs, ws_ptr, NUM_STAGES, w_row_up,
                                                                      ws_up_ptr, GATED)
            if (num_k - 1) % 2 == 1:   # an odd number of steps after the first: one more, then Y is the last
                y_tok, y_scale, x_dead, scale, acc = _overlapped_step(num_k - 1, num_k, x_tok, x_scale, y_dead, scale,
                                                                      acc, x_desc, w_desc, a_bufs, b_bufs, ready, off_m,
                                                                      w_row, xs_ptrs, ws_ptr, NUM_STAGES, w_row_up,
                                                                      ws_up_ptr, GATED)
                last = warpgroup_mma_wait(num_outstanding=0, deps=(y_tok, ))
                acc = _promote(acc, last, y_scale, GATED)
            else:
                last = warpgroup_mma_wait(num_outstanding=0, deps=(x_tok, ))
                acc = _promote(acc, last, x_scale, GATED)
        else:
            scale = _step_scale(xs_ptrs, ws_ptr, 0, num_k, ws_up_ptr, GATED)
            dead = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=mma_layout)
            for step in range(num_k):
                dead, scale, acc = _in_order_step(step, num_k, dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs, ready,
                                                  off_m, w_row, xs_ptrs, ws_ptr, NUM_STAGES, w_row_up, ws_up_ptr, GATED)

        for i in gl.static_range(NUM_STAGES):   # every fill was waited for: no copy is left in flight
            mbarrier.invalidate(ready.index(i))

        # Epilogue: bf16, through shared memory into 16-byte runs along N, only the rows of the expert (a
        # segment's last tile has padding rows, whose outputs belong to no token and are left as they were).
        if GATED:
            _store_gated(acc, out_ptr, m_indices_ptr, off_m, off_n, N // 2, stride_om, W_ROWS, NUM_WARPS)
        else:
            _store_plain(acc, out_ptr, m_indices_ptr, off_m, off_n, N, stride_om, NUM_WARPS)


    @gluon.jit
    def _store_plain(acc, out_ptr, m_indices_ptr, off_m, off_n, N, stride_om, NUM_WARPS: gl.constexpr):
        """A plain tile's epilogue: bf16, in 16-byte runs along N, the rows of the expert only."""
        store_layout: gl.constexpr = _store_layout(acc.shape[1], NUM_WARPS)
        rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, store_layout))
        real = gl.load(m_indices_ptr + rows) >= 0
        out = gl.convert_layout(acc.to(gl.bfloat16), store_layout)
        cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, store_layout))
        offsets = rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(out_ptr + offsets, out, mask=real[:, None] & (cols < N)[None, :])


    @gluon.jit
    def _store_gated(acc, out_ptr, m_indices_ptr, off_m, off_n, OUT_N, stride_om, HALF: gl.constexpr,
                     NUM_WARPS: gl.constexpr):
        """GEMM 1's epilogue: ``silu(gate) * up`` (:func:`_silu_mul_tile`) rounded once to bf16 and stored."""
        y, rows, real, cols = _silu_mul_tile(acc, m_indices_ptr, off_m, off_n, HALF, NUM_WARPS)
        offsets = rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(out_ptr + offsets, y.to(gl.bfloat16), mask=real[:, None] & (cols < OUT_N)[None, :])


    @gluon.jit
    def _silu_mul_tile(acc, m_indices_ptr, off_m, off_n, HALF: gl.constexpr, NUM_WARPS: gl.constexpr):
        """``silu(gate) * up`` in fp32 from the fp32 tile (gate columns, then up columns), as the Triton kernel's
        epilogue computes it, in the store layout of a ``HALF``-column tile (the halves read back from shared
        memory); with the tile's rows, which of them are real, and its output columns."""
        half_layout: gl.constexpr = _store_layout(HALF, NUM_WARPS)
        # 8-float vectors swizzled over 8 rows: the accumulator's store meets no bank conflict (gl.bank_conflicts:
        # 0, against 3 extra accesses a wavefront unswizzled). The pattern spans 64 columns, so a 64-column half
        # starts on it; a narrower half keeps the plain layout (a slice inside the pattern is not relied on).
        tile_layout: gl.constexpr = (gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
                                     if HALF % 64 == 0 else
                                     gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        tile = gl.allocate_shared_memory(gl.float32, [acc.shape[0], 2 * HALF], tile_layout)   # (128 rows, or 64)
        # (the tile's memory may be the K loop's buffers: every warpgroup past its last MMA before any stores)
        gl.thread_barrier()
        tile.store(acc)
        gl.thread_barrier()
        gate = tile.slice(0, HALF, dim=1).load(half_layout)
        up = tile.slice(HALF, HALF, dim=1).load(half_layout)
        rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, half_layout))
        cols = off_n + gl.arange(0, HALF, layout=gl.SliceLayout(0, half_layout))
        return gate * (1.0 / (1.0 + gl.exp(-gate))) * up, rows, gl.load(m_indices_ptr + rows) >= 0, cols


    def _descriptors(x, w, block_n, gated=False):
        """TMA descriptors of ``x`` ([M_pad, K], boxes of TILE_M x TILE_K) and of ``w`` viewed as
        ``[E * N, K]`` (boxes of block_n x TILE_K, or of block_n / 2 rows gated), 128-byte swizzled (a
        128-byte fp8 row of K). The W box's layout is the whole N tile's, of which a gated box fills
        each half (the swizzle repeats every 8 rows, so a half of 32 or 64 rows starts on its pattern)."""
        e, n, k = w.shape
        x_layout = gl.NVMMASharedLayout.get_default_for([TILE_M, TILE_K], gl.float8e4nv)
        w_layout = gl.NVMMASharedLayout.get_default_for([block_n, TILE_K], gl.float8e4nv)
        box = block_n // 2 if gated else block_n
        return (TensorDescriptor.from_tensor(x, [TILE_M, TILE_K], x_layout),
                TensorDescriptor.from_tensor(w.view(e * n, k), [box, TILE_K], w_layout))


    def compile_for_sm90(block_n, stages, num_warps, overlap, gated=False, half_tiles=False, count=False):
        """The kernel compiled for sm_90a (Gluon's own AST source: its IR is already TritonGPU)."""
        return compile_kernel_for_sm90(_block_fp8_grouped_kernel, block_n, gated, num_warps,
                                       {"NUM_STAGES": stages, "OVERLAP": overlap, "HALF_TILES": half_tiles,
                                        "COUNT_HALVES": count}, {"counter_ptr": "*i32"})

    def compile_kernel_for_sm90(fn, block_n, gated, num_warps, constants, pointers=None, descriptors=None):
        """``fn`` compiled for sm_90a with ``constants`` besides BLOCK_N, GROUP and GATED, ``pointers`` (name: type)
        besides or instead of this kernel's, and ``descriptors`` (x's, w's: their types) unless this kernel's."""
        pointers = pointers or {}
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
        from triton.runtime.jit import mangle_type

        # (host tensors only to spell the descriptors' types)
        x = torch.empty(TILE_M, TILE_K, dtype=torch.float8_e4m3fn)
        w = torch.empty(1, 128, TILE_K, dtype=torch.float8_e4m3fn)
        x_desc, w_desc = descriptors or _descriptors(x, w, block_n, gated)
        constants = {"BLOCK_N": block_n, "GROUP": GROUP_M, "GATED": gated, **constants}
        types = {"x_desc": mangle_type(x_desc), "w_desc": mangle_type(w_desc), "out_ptr": "*bf16",
                 "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "m_indices_ptr": "*i32", **pointers}
        signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
        values = {(i, ): constants[name] for i, name in enumerate(fn.arg_names) if name in constants}
        # pointers 16-byte aligned, and the sizes and row strides multiples of 16, as launches specialise them
        aligned = {"out_ptr", "x_scale_ptr", "w_scale_ptr", "m_indices_ptr", "num_rows", "N", "K", "stride_om",
                   *pointers}
        attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
        return triton.compile(GluonASTSource(fn, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})

    def launch(x, x_scale, w, w_scale, m_indices, out, *, overlap, block_n, stages, num_warps, gated=False,
               half_tiles=False):
        """The kernel on arguments :func:`moe_kernels.kernels.gluon_block_fp8.block_fp8_grouped` checked."""
        num_rows, k = x.shape
        n = w.shape[1]
        x_desc, w_desc = _descriptors(x, w, block_n, gated)
        grid = (num_rows // TILE_M * (out.shape[1] // (block_n // 2 if gated else block_n)), )
        _block_fp8_grouped_kernel[grid](x_desc, w_desc, out, x_scale, w_scale, m_indices, num_rows, n, k,
                                        out.stride(0), x_scale.stride(0), w_scale.stride(0), w_scale.stride(1),
                                        BLOCK_N=block_n, NUM_STAGES=stages, OVERLAP=overlap, GROUP=GROUP_M,
                                        GATED=gated, HALF_TILES=half_tiles, counter_ptr=HALF_TILE_COUNTER,
                                        COUNT_HALVES=HALF_TILE_COUNTER is not None and half_tiles,
                                        num_warps=num_warps)

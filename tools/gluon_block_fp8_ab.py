"""Block-fp8 promotion overlap A/B (Gluon, Hopper): the permute layout's grouped GEMM with each K step's
promotion overlapped with the next step's MMA, against the same kernel promoting in order and the
package's Triton path, with the dense fp8 rate measured in the same process.

A block-fp8 K step (DeepSeek-V3's format: one float32 scale per row per 128 columns of K for the
activations, one per 128 x 128 block for the weights) multiplies its 128-deep product by the rows' and
the block's scales before adding it to the accumulator (the "promotion"). Triton 3.6 waits for every
such product (``wgmma.wait_group 0``) before promoting it, so the tensor cores idle while the CUDA cores
promote: 18-23% of the prefill GEMMs' rate on an H200. Triton's pipeliner keeps a dot asynchronous only
when its result feeds another dot's accumulator, so no reordering in Triton avoids it. Gluon
(``triton.experimental.gluon``, Triton 3.6's API) exposes the wgmma waits: here step s+1's MMA is issued
before step s is promoted and the wait leaves one MMA outstanding (``wait_group 1``), so the promotion
runs under the next MMA (what DeepGEMM does in CUDA). Candidates, on each GEMM alone:

  gluon overlap      the Gluon kernel, promotion of step s after issuing step s+1 (wait_group 1)
  gluon in order     the same kernel, wait_group 0 after each MMA, then its promotion (the A/B's control)
  triton             grouped_gemm_contiguous, n128 k128 w8 s4, TMA, persistent (the package's path)
  triton flat        the same with its tile and K loops flattened into one pipeline (persistent=2)

on DeepSeek-V3's (GEMM 1: N 4096 (gate and up, no SiLU here), K 7168; GEMM 2: N 7168, K 2048; 256 experts)
and Qwen3-30B-A3B's shapes (GEMM 1: N 1536, K 2048; GEMM 2: N 2048, K 768; 128 experts), T tokens with
top-8 routing: T * 8 rows, each given a uniformly random expert, segments rounded up to 128 rows, and one
128-row tile of padding at the end (a tile of padding writes nothing). Each output is checked against a
float32 product of the dequantised operands (relative Frobenius error <= 1e-2 over the written rows;
the rest stay zero in both), then replayed from a CUDA graph of one call, the L2 flushed before each
replay, two rounds in alternating order, the lower round median kept. TFLOP/s count the routed rows
(2 T k N K); the dense fp8 ``torch._scaled_mm`` rate is the ceiling.

    PYTHONPATH=. python tools/gluon_block_fp8_ab.py [models] [batches]
    # e.g. qwen3-30b-a3b,deepseek-v3 4096,16384   (records results/<device>/gluon-block-fp8-ab.json)
    PYTHONPATH=/tmp/t36 python tools/gluon_block_fp8_ab.py --compile-only
    # no GPU needed: both variants compiled for sm_90a (8 warps, 4 stages, BLOCK_N 128 and 64); prints the
    # wgmma count, the wait_group values in order, and ptxas's registers and spills

Needs Triton 3.6 (its Gluon API; later versions changed it).
"""
from __future__ import annotations

import dataclasses
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

TILE_M = 128   # one expert per M tile: the permute layout's segments are aligned to 128 rows
TILE_K = 128   # one K step per scale block: one activation scale per row, one weight scale per step
GROUP_M = 8    # M tiles visited before the next N tile (the weight tile stays in L2 across them)
BLOCK_M, BLOCK_K = gl.constexpr(TILE_M), gl.constexpr(TILE_K)   # (the kernel's view of the same)


# ---- layouts -----------------------------------------------------------------------------------------------

@gluon.constexpr_function
def _mma_layout(block_n, num_warps):
    """wgmma's accumulator layout: warps stacked along M, 16 rows each (4 warps = a warpgroup = 64 rows;
    8 warps are two warpgroups of 64 rows, each issuing its own wgmmas on its half of the A tile), every
    warp spanning the whole N tile, so one wgmma instruction is m64 n``block_n`` k32 (fp8: k = 32)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 32])


@gluon.constexpr_function
def _store_layout(block_n, num_warps):
    """The epilogue's layout: 8 consecutive bf16 (16 bytes) per thread along N, a warp covering whole rows."""
    across = block_n // 8
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // across, across],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


# ---- the K loop's pieces -------------------------------------------------------------------------------------

@gluon.jit
def _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, step, num_k, NUM_STAGES: gl.constexpr):
    """TMA loads of K step ``step`` (its A and W tiles) into stage ``step % NUM_STAGES``, signalling
    that stage's barrier; nothing past the last step (``pred``: no expect, no copy, so the barrier's
    phase does not move and is never waited for). (Triton 3.6's shared-memory barrier analysis puts a
    ``bar.sync`` between consecutive operations on one barrier array: before the copies and before each
    wait, a few per step in both orders; the copies are issued by one elected thread of warp 0.)"""
    stage = step % NUM_STAGES
    pred = step < num_k
    bar = ready.index(stage)
    # arrive.expect_tx: the barrier (count 1) completes its phase once both boxes' bytes have landed
    # (whole boxes: the tiles never cross the tensors' edges, K and N being multiples of the tiles)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, step * BLOCK_K], bar, a_bufs.index(stage), pred)
    tma.async_copy_global_to_shared(w_desc, [w_row, step * BLOCK_K], bar, b_bufs.index(stage), pred)


@gluon.jit
def _issue_mma(a_bufs, b_bufs, ready, step, dead, NUM_STAGES: gl.constexpr):
    """Wait for step ``step``'s tiles, then issue its MMA, asynchronously, into a fresh product
    (``use_acc=False``: the product is the step's alone, to be scaled before it is added). ``dead`` is a
    product already promoted: its registers become this MMA's (no copy of a zero tile into them)."""
    stage = step % NUM_STAGES
    # the stage's (step // NUM_STAGES)-th fill: phases alternate 0, 1, 0, ... with each fill
    mbarrier.wait(ready.index(stage), (step // NUM_STAGES) & 1)
    # W's tile is [BLOCK_N, BLOCK_K], K contiguous; viewed as [K, N] it is wgmma's K-major B (the only
    # B an fp8 wgmma takes). max_num_imprecise_acc is Triton's sm_90 default (2**30): no promotion inside.
    return warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), dead, use_acc=False,
                         is_async=True)


@gluon.jit
def _step_scale(xs_ptrs, ws_ptr, step, num_k):
    """Step ``step``'s scale of each row of the tile, ``a_scale[row] * w_scale`` (one weight scale: the
    N tile lies in one 128-row scale block), in the accumulator's row layout. Clamped to the last step:
    the scale one past it is loaded (the loop loads a step ahead) but never used."""
    s = gl.minimum(step, num_k - 1)
    return gl.load(xs_ptrs + s) * gl.load(ws_ptr + s)


@gluon.jit
def _overlapped_step(step, num_k, inflight, inflight_scale, dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs,
                     ready, off_m, w_row, xs_ptrs, ws_ptr, NUM_STAGES: gl.constexpr):
    """K step ``step`` with the promotion overlapped: MMA ``step`` is issued first, then MMA ``step - 1``
    (``inflight``, scales ``inflight_scale``) is waited for with one MMA left outstanding and promoted
    while MMA ``step`` runs. ``scale`` holds step ``step``'s scales (loaded a step ago). Returns the new
    in-flight product and its scales, the promoted product (now dead: its registers take the next MMA),
    the next step's scales and the accumulator."""
    # the next step's scales now, so that their loads' latency hides behind this step
    following = _step_scale(xs_ptrs, ws_ptr, step + 1, num_k)
    issued = _issue_mma(a_bufs, b_bufs, ready, step, dead, NUM_STAGES)
    # wgmma.wait_group 1: every MMA but the one just issued is complete; the deps make the compiler
    # read ``inflight``'s registers only after the wait (``issued``'s are not read until the next step)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(inflight, ))
    # Each warpgroup waits for its own wgmmas only, and the TMA copy below is issued by one thread: both
    # warpgroups must be past MMA step-1 before its stage is refilled, or the copy overwrites tiles the
    # other warpgroup's MMA is still reading.
    gl.thread_barrier()
    _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, step - 1 + NUM_STAGES, num_k, NUM_STAGES)
    # the promotion: on the CUDA cores, while the tensor cores run MMA ``step``
    acc = acc + done * inflight_scale[:, None]
    # A fence for the compiler (the wait is a no-op here: at most MMA ``step`` is outstanding): it takes
    # ``acc``, so the promotion is computed before it, and the next MMA (which writes ``done``'s registers)
    # is issued after it. Without it LLVM sinks the promotion past the next MMA's issue and must copy
    # ``done`` to keep it, and ptxas, seeing registers of an MMA in flight written by a copy, serialises
    # the MMAs (C7515).
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return issued, scale, done, following, acc


@gluon.jit
def _in_order_step(step, num_k, dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, xs_ptrs,
                   ws_ptr, NUM_STAGES: gl.constexpr):
    """K step ``step`` promoted in order (what Triton compiles ``tl.dot`` then the promotion to): issue the
    MMA, wait for it (``wait_group 0``), refill its stage, promote. The scales are loaded a step ahead,
    as in the overlapped order, so that the A/B differs in the overlap alone."""
    following = _step_scale(xs_ptrs, ws_ptr, step + 1, num_k)
    issued = _issue_mma(a_bufs, b_bufs, ready, step, dead, NUM_STAGES)
    done = warpgroup_mma_wait(num_outstanding=0, deps=(issued, ))
    gl.thread_barrier()   # (both warpgroups past MMA ``step``: see _overlapped_step)
    _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, step + NUM_STAGES, num_k, NUM_STAGES)
    acc = acc + done * scale[:, None]
    # (the compiler fence of _overlapped_step: the promotion stays before the next MMA's issue, in order)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return done, following, acc


# ---- the kernel ----------------------------------------------------------------------------------------------

@gluon.jit
def _block_fp8_grouped_kernel(x_desc, w_desc, out_ptr, x_scale_ptr, w_scale_ptr, m_indices_ptr, num_rows, N, K,
                              stride_om, stride_xs, stride_wse, stride_wsn, BLOCK_N: gl.constexpr,
                              NUM_STAGES: gl.constexpr, OVERLAP: gl.constexpr, GROUP: gl.constexpr):
    """One program per [BLOCK_M, BLOCK_N] output tile of the permute layout's grouped GEMM:
    ``out[r] = dequant(x[r]) @ dequant(w[m_indices[r]])^T`` for its rows with ``m_indices >= 0``."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    mma_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    store_layout: gl.constexpr = _store_layout(BLOCK_N, NUM_WARPS)
    gl.static_assert(x_desc.block_type.shape[0] == BLOCK_M)
    gl.static_assert(x_desc.block_type.shape[1] == BLOCK_K)
    gl.static_assert(w_desc.block_type.shape[0] == BLOCK_N)
    gl.static_assert(128 % BLOCK_N == 0)   # an N tile inside one weight scale block: one weight scale per step
    gl.static_assert(NUM_STAGES >= 2)

    # grouped order: GROUP M tiles (mostly one expert's) share each N tile while it is in L2
    pid = gl.program_id(0)
    num_pid_m = num_rows // BLOCK_M
    num_pid_n = N // BLOCK_N
    in_group = GROUP * num_pid_n
    first_m = (pid // in_group) * GROUP
    group_size = gl.minimum(num_pid_m - first_m, GROUP)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    # The tile's expert: segments are aligned to 128 rows, so the tile's real rows share one expert and
    # its padding rows hold -1; the max is that expert, or -1 for a tile of padding, which writes nothing.
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    row_experts = gl.load(m_indices_ptr + rows)
    expert = gl.max(row_experts, axis=0)
    if expert < 0:
        return

    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)

    num_k = K // BLOCK_K
    w_row = expert * N + off_n   # w viewed as [E * N, K]
    # Scales in the accumulator's row layout (a slice of the MMA layout): each thread gets the scales of
    # exactly the rows its accumulator registers hold, so the promotion needs no layout conversion.
    scale_rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    xs_ptrs = x_scale_ptr + scale_rows * stride_xs              # + step: x_scale[row, step]
    ws_ptr = w_scale_ptr + expert * stride_wse + (off_n // 128) * stride_wsn   # + step: w_scale[e, n // 128, step]

    # fill the ring: steps 0 .. NUM_STAGES - 1 (those that exist)
    for i in gl.static_range(NUM_STAGES):
        _load_step(x_desc, w_desc, a_bufs, b_bufs, ready, off_m, w_row, i, num_k, NUM_STAGES)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
    if OVERLAP:
        # Two products in flight by turns: X (the MMA issued last step) and Y (promoted last step, its
        # registers reused by this step's MMA). The loop runs two steps per iteration so that X and Y stay
        # in their own registers: with one step per iteration the loop would have to carry "the in-flight
        # product" across the swap, copying registers an MMA is still writing (ptxas would then wait for
        # it, serialising the MMAs).
        # Y's first registers, defined before MMA 0 is issued (no MMA may be in flight while plain
        # instructions write registers a later MMA accumulates into: C7515 again); the wait makes them
        # opaque values defined here rather than constants LLVM would materialise after MMA 0's issue.
        y_dead = warpgroup_mma_wait(num_outstanding=0, deps=(gl.zeros([BLOCK_M, BLOCK_N], gl.float32,
                                                                      layout=mma_layout), ))
        scale = _step_scale(xs_ptrs, ws_ptr, 0, num_k)
        x_tok = _issue_mma(a_bufs, b_bufs, ready, 0, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout),
                           NUM_STAGES)
        x_scale = scale
        scale = _step_scale(xs_ptrs, ws_ptr, 1, num_k)
        for i in range((num_k - 1) // 2):
            step = 1 + 2 * i
            y_tok, y_scale, x_dead, scale, acc = _overlapped_step(step, num_k, x_tok, x_scale, y_dead, scale, acc,
                                                                  x_desc, w_desc, a_bufs, b_bufs, ready, off_m,
                                                                  w_row, xs_ptrs, ws_ptr, NUM_STAGES)
            x_tok, x_scale, y_dead, scale, acc = _overlapped_step(step + 1, num_k, y_tok, y_scale, x_dead, scale, acc,
                                                                  x_desc, w_desc, a_bufs, b_bufs, ready, off_m,
                                                                  w_row, xs_ptrs, ws_ptr, NUM_STAGES)
        if (num_k - 1) % 2 == 1:   # an odd number of steps after the first: one more, then Y is the last
            y_tok, y_scale, x_dead, scale, acc = _overlapped_step(num_k - 1, num_k, x_tok, x_scale, y_dead, scale,
                                                                  acc, x_desc, w_desc, a_bufs, b_bufs, ready, off_m,
                                                                  w_row, xs_ptrs, ws_ptr, NUM_STAGES)
            last = warpgroup_mma_wait(num_outstanding=0, deps=(y_tok, ))
            acc = acc + last * y_scale[:, None]
        else:
            last = warpgroup_mma_wait(num_outstanding=0, deps=(x_tok, ))
            acc = acc + last * x_scale[:, None]
    else:
        scale = _step_scale(xs_ptrs, ws_ptr, 0, num_k)
        dead = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
        for step in range(num_k):
            dead, scale, acc = _in_order_step(step, num_k, dead, scale, acc, x_desc, w_desc, a_bufs, b_bufs, ready,
                                              off_m, w_row, xs_ptrs, ws_ptr, NUM_STAGES)

    for i in gl.static_range(NUM_STAGES):   # every fill was waited for: no copy is left in flight
        mbarrier.invalidate(ready.index(i))

    # Epilogue: bf16, through shared memory into 16-byte runs along N, only the rows of the expert (a
    # segment's last tile has padding rows, whose outputs belong to no token and are left as they were).
    out = gl.convert_layout(acc.to(gl.bfloat16), store_layout)
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    offsets = rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
    mask = (row_experts >= 0)[:, None] & (cols < N)[None, :]
    gl.store(out_ptr + offsets, out, mask=mask)


# ---- host side -----------------------------------------------------------------------------------------------

def _descriptors(x, w, block_n):
    """TMA descriptors of ``x`` ([M_pad, K], boxes of TILE_M x TILE_K) and of ``w`` viewed as
    ``[E * N, K]`` (boxes of block_n x TILE_K), 128-byte swizzled (a 128-byte fp8 row of K)."""
    e, n, k = w.shape
    x_layout = gl.NVMMASharedLayout.get_default_for([TILE_M, TILE_K], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, TILE_K], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(x, [TILE_M, TILE_K], x_layout),
            TensorDescriptor.from_tensor(w.view(e * n, k), [block_n, TILE_K], w_layout))


def gluon_block_fp8_grouped(x, x_scale, w, w_scale, m_indices, *, block_n=128, stages=4, num_warps=8, overlap=True,
                            out=None):
    """``out[r] = dequant(x[r]) @ dequant(w[m_indices[r]])^T`` (bf16) for each row with ``m_indices`` in
    ``[0, E)``; other rows are not written (``out``, if given, keeps them). ``x`` fp8 ``[M_pad, K]``,
    ``x_scale`` float32 ``[M_pad, K/128]``, ``w`` fp8 ``[E, N, K]``, ``w_scale`` float32
    ``[E, N/128, K/128]``, ``m_indices`` int32 ``[M_pad]`` in 128-row segments (-1 on padding rows).
    ``overlap``: promote each step under the next step's MMA (False: in order, the control)."""
    num_rows, k = x.shape
    e, n, _ = w.shape
    assert x.dtype == w.dtype == torch.float8_e4m3fn and w.shape[2] == k and w.is_contiguous() and x.stride(1) == 1
    assert num_rows % TILE_M == 0 and k % TILE_K == 0 and k > 0 and n % 128 == 0 and block_n in (64, 128)
    # (a tile's expert is an address: the kernel does not check it, so the caller does; not while a CUDA
    # graph captures the call, where reading the maximum back would end the capture)
    if m_indices.numel() and not torch.cuda.is_current_stream_capturing():
        assert int(m_indices.max()) < e
    assert x_scale.shape == (num_rows, k // 128) and x_scale.stride(1) == 1 and x_scale.dtype == torch.float32
    assert w_scale.shape == (e, n // 128, k // 128) and w_scale.stride(2) == 1 and w_scale.dtype == torch.float32
    assert m_indices.shape == (num_rows, ) and m_indices.dtype == torch.int32 and m_indices.is_contiguous()
    if out is None:
        out = torch.empty(num_rows, n, device=x.device, dtype=torch.bfloat16)
    assert out.shape == (num_rows, n) and out.dtype == torch.bfloat16 and out.stride(1) == 1
    x_desc, w_desc = _descriptors(x, w, block_n)
    grid = (num_rows // TILE_M * (n // block_n), )
    _block_fp8_grouped_kernel[grid](x_desc, w_desc, out, x_scale, w_scale, m_indices, num_rows, n, k, out.stride(0),
                                    x_scale.stride(0), w_scale.stride(0), w_scale.stride(1), BLOCK_N=block_n,
                                    NUM_STAGES=stages, OVERLAP=overlap, GROUP=GROUP_M, num_warps=num_warps)
    return out


# ---- --compile-only: sm_90a builds without a GPU --------------------------------------------------------------


def compile_for_sm90(block_n, stages, num_warps, overlap):
    """The kernel compiled for sm_90a (Gluon's own AST source: its IR is already TritonGPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fn = _block_fp8_grouped_kernel
    # (host tensors only to spell the descriptors' types: shapes and addresses are not part of them)
    x = torch.empty(TILE_M, TILE_K, dtype=torch.float8_e4m3fn)
    w = torch.empty(1, 128, TILE_K, dtype=torch.float8_e4m3fn)
    x_desc, w_desc = _descriptors(x, w, block_n)
    constants = {"BLOCK_N": block_n, "NUM_STAGES": stages, "OVERLAP": overlap, "GROUP": GROUP_M}
    types = {"x_desc": mangle_type(x_desc), "w_desc": mangle_type(w_desc), "out_ptr": "*bf16",
             "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "m_indices_ptr": "*i32"}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    values = {(i, ): constants[name] for i, name in enumerate(fn.arg_names) if name in constants}
    # pointers 16-byte aligned, and the sizes and row strides multiples of 16, as launches specialise them
    aligned = {"out_ptr", "x_scale_ptr", "w_scale_ptr", "m_indices_ptr", "num_rows", "N", "K", "stride_om"}
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
    return triton.compile(GluonASTSource(fn, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def ptx_report(ptx):
    """(number of wgmma.mma_async, the wait_group values in the order they appear in the PTX)."""
    return (len(re.findall(r"wgmma\.mma_async", ptx)),
            [int(v) for v in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)])


def ptxas_report(ptx):
    """ptxas -v for sm_90a: (registers, spill store bytes, spill load bytes, its warnings about wgmma)."""
    from moe_kernels.sm90_compile import assemble_for_sm90

    built = assemble_for_sm90(ptx)
    warnings = [line.strip() for line in built["log"].splitlines() if "wgmma" in line.lower()]
    return built["registers"], built["spill_stores"], built["spill_loads"], warnings


def compile_only():
    print(f"triton {triton.__version__}, sm_90a builds, {TILE_M} x block_n x {TILE_K} tiles", flush=True)
    for block_n in (128, 64):
        for overlap in (True, False):
            kernel = compile_for_sm90(block_n, 4, 8, overlap)
            ptx = kernel.asm["ptx"]
            count, waits = ptx_report(ptx)
            regs, spill_stores, spill_loads, warnings = ptxas_report(ptx)
            name = "overlap" if overlap else "in-order"
            print(f"{name} block_n={block_n} warps=8 stages=4: wgmma {count}, waits {','.join(map(str, waits))}, "
                  f"registers {regs}, spills {spill_stores}/{spill_loads} bytes (stores/loads), "
                  f"shared {kernel.metadata.shared} bytes, ptxas wgmma warnings {len(warnings)}", flush=True)
            for line in warnings:
                print("   ", line, flush=True)


# ---- the A/B on a GPU ----------------------------------------------------------------------------------------

MODEL_SHAPES = {   # (E, top-k, [(GEMM, N, K), ...])
    "deepseek-v3": (256, 8, [("gemm1", 4096, 7168), ("gemm2", 7168, 2048)]),
    "qwen3-30b-a3b": (128, 8, [("gemm1", 1536, 2048), ("gemm2", 2048, 768)]),
}


def segments(tokens, top_k, experts, seed):
    """``m_indices`` of ``tokens * top_k`` rows, each given a uniformly random expert (seeded), in segments
    rounded up to 128 rows (-1 on the padding), with one more 128-row tile of padding at the end; and the
    row where each expert's segment starts and its count of real rows."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(experts, (tokens * top_k, ), generator=g), minlength=experts)
    padded = (counts + 127) // 128 * 128
    starts = torch.cumsum(padded, 0) - padded
    m_indices = torch.full((int(padded.sum()) + 128, ), -1, dtype=torch.int32)
    for e in range(experts):
        m_indices[starts[e]:starts[e] + counts[e]] = e
    return m_indices, starts.tolist(), counts.tolist()


def weights(n, k, experts, seed):
    """Random block-fp8 weights w [E, N, K] and their scales [E, N/128, K/128], by the package's quantiser."""
    from moe_kernels.kernels.formats import FORMATS

    torch.manual_seed(seed)
    w = torch.empty(experts, n, k, device="cuda", dtype=torch.float8_e4m3fn)
    w_scale = torch.empty(experts, n // 128, k // 128, device="cuda", dtype=torch.float32)
    for e in range(0, experts, 8):   # a few experts at a time: bf16 / float32 temporaries of all would not fit
        part = torch.randn(min(8, experts - e), n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        w[e:e + 8], w_scale[e:e + 8] = FORMATS["block"].quantize_weight(part)
    return w, w_scale.contiguous()


def activations(num_rows, k, seed):
    """Random block-fp8 activations x [M_pad, K] and their row-major scales [M_pad, K/128] (padding rows
    too: the kernel computes its tiles' padding rows and must not write them)."""
    from moe_kernels.kernels.formats import FORMATS

    torch.manual_seed(seed)
    x, x_scale = FORMATS["block"].quantize_activations(torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16))
    return x, x_scale.contiguous()


def reference(x, x_scale, w, w_scale, starts, counts):
    """float32 ``dequant(x[r]) @ dequant(w[e])^T`` on each expert's real rows, zero on the others."""
    from moe_kernels.kernels.formats import FORMATS

    block = FORMATS["block"]
    ref = torch.zeros(x.shape[0], w.shape[1], device=x.device, dtype=torch.float32)
    for e, (start, count) in enumerate(zip(starts, counts)):
        if count:
            a = block.dequantize_activations(x[start:start + count], x_scale[start:start + count])
            ref[start:start + count] = a @ block.dequantize_weight(w[e:e + 1], w_scale[e:e + 1])[0].T
    return ref


def main(argv):
    from moe_kernels.bench.ceilings import measure_fp8_gemm_rate
    from moe_kernels.bench.timing import time_lowest
    from moe_kernels.kernels.config import GemmTiles, MoEConfig
    from moe_kernels.kernels.contiguous_gemm import grouped_gemm_contiguous
    from moe_kernels.results import print_timings, record_tool

    models = argv[0].split(",") if argv else ["qwen3-30b-a3b", "deepseek-v3"]
    batches = [int(b) for b in argv[1].split(",")] if len(argv) > 1 else [4096, 16384]
    tiles = GemmTiles(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=1)
    configs = {"triton": MoEConfig(128, tiles, tiles),   # and the tile and K loops flattened (persistent=2)
               "triton flat": MoEConfig(128, dataclasses.replace(tiles, persistent=2),
                                        dataclasses.replace(tiles, persistent=2))}
    fp8_rate = measure_fp8_gemm_rate()
    print(f"triton {triton.__version__}; dense fp8 _scaled_mm: {fp8_rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []

    def save():
        return record_tool("gluon-block-fp8-ab", rows, {
            "models": models, "batches": batches, "fp8_gemm_rate": fp8_rate, "triton": triton.__version__,
            "gluon": {"block_m": TILE_M, "block_n": 128, "block_k": TILE_K, "stages": 4, "num_warps": 8,
                      "group_m": GROUP_M, "grid": "one program per tile"},
            "triton_tiles": {"block_n": 128, "block_k": 128, "group_m": 8, "num_warps": 8, "num_stages": 4,
                             "tma": True, "persistent": "1 ('triton') and 2 ('triton flat')"}})

    for key in models:
        experts, top_k, gemms = MODEL_SHAPES[key]
        for gemm, n, k in gemms:
            w, w_scale = weights(n, k, experts, seed=n + k)
            for batch in batches:
                m_indices, starts, counts = segments(batch, top_k, experts, seed=batch)
                m_indices = m_indices.cuda()
                num_rows = m_indices.shape[0]
                rows_used = torch.tensor([num_rows - 128], device="cuda", dtype=torch.int32)   # (last tile: padding)
                x, x_scale = activations(num_rows, k, seed=batch + k)
                ref = reference(x, x_scale, w, w_scale, starts, counts)
                outs = {name: torch.zeros(num_rows, n, device="cuda", dtype=torch.bfloat16)
                        for name in ("gluon overlap", "gluon in order", *configs)}

                def gluon_call(name, overlap):
                    return lambda: gluon_block_fp8_grouped(x, x_scale, w, w_scale, m_indices, overlap=overlap,
                                                           out=outs[name])

                def triton_call(name):
                    return lambda: grouped_gemm_contiguous(x, w, m_indices, align=128, x_scale=x_scale, w_scale=w_scale,
                                                           config=configs[name], which="gate_up", out=outs[name],
                                                           out_dtype=torch.bfloat16, rows_used=rows_used)

                candidates = {"gluon overlap": gluon_call("gluon overlap", True),
                              "gluon in order": gluon_call("gluon in order", False),
                              **{name: triton_call(name) for name in configs}}
                us, rounds, errors, rel = time_lowest(candidates, ref, tolerance=1e-2, warmup_ms=2, rep_ms=10,
                                                      rounds=2, alternate=True)
                flops = 2 * batch * top_k * n * k
                tflops = {name: flops / t / 1e6 for name, t in us.items()}
                rows.append({"model": key, "gemm": gemm, "batch": batch, "n": n, "k": k, "experts": experts,
                             "rows": num_rows, "routed_rows": batch * top_k, "us": us, "tflops": tflops,
                             "of_fp8_rate": {name: f * 1e12 / fp8_rate for name, f in tflops.items()},
                             "rounds_us": rounds, "rel_err": rel, "errors": errors})
                save()
                print_timings(f"{key} {gemm} {batch} tokens (N {n}, K {k}; dense fp8 {fp8_rate / 1e12:.0f} TFLOP/s):",
                              us, tflops, errors)
                x = x_scale = ref = outs = candidates = None   # (this batch's buffers freed before the next's)
                torch.cuda.empty_cache()
            w = w_scale = None
    print(f"recorded {save()}")


if __name__ == "__main__":
    if "--compile-only" in sys.argv[1:]:
        compile_only()
    else:
        main(sys.argv[1:])

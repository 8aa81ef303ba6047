"""Both expert GEMMs of a tiny batch in one launch, in two phases that each keep every SM streaming.

At one decode token the experts are matrix-vector products: Qwen3-30B-A3B's eight experts read
37.7 MB of fp8 weights (75.5 MB in bf16) for 0.08 GFLOP, so the time is the read. Two grouped GEMMs
read it in two launches, each with a start and a tail, and each in tiles too large to spread evenly
over the SMs (a GEMM 1 tile of 128 columns is 48 programs for 132 SMs at one Qwen3 token); the
top-k sum and, in fp8, one or two activation quantisers are more launches. :mod:`moe_kernels.kernels.one_launch`
runs both products in one launch, but its GEMM 2 reads each weight row in slices of 16-64 bytes and
adds every partial sum into the output with atomics.

Here a persistent grid (``programs_per_sm`` programs per SM) takes small work units by ticket, one
atomic add each:

1. **GEMM 1 units** (tickets ``0 .. n1-1``): one assignment (token, expert) and ``block_f`` rows
   of the expert's gate and up halves, over all of ``d``. The unit writes its ``block_f`` values
   of ``h = silu(gate) * up`` to a row of ``h`` in the activations' dtype, then adds one arrival
   (a release).
2. **GEMM 2 units** (the next ``n2`` tickets): one assignment and ``block_d`` rows of the output.
   The unit waits until its assignment's GEMM 1 units have all arrived (an acquire, after which its
   loads see the ``h`` the other SMs wrote), then reads the assignment's ``h`` row and its expert's
   ``block_d`` rows, and stores its routing weight times their product, in fp32, to a row of parts.
   Then it adds one arrival to its (token, row block); the last of the token's ``k`` units to
   arrive adds the ``k`` parts in slot order and rounds the sum once into the output. So the top-k
   sum costs no launch and no atomic add of values, and gives the same bits whichever unit arrives
   last.

Every weight row is read whole, once per assignment (two tokens on one expert read it twice); the
units are small (a Qwen3 GEMM 1 unit of 32 + 32 rows: 128 KB of fp8), so the tickets spread them
evenly. A program waits only for units held by running programs (every GEMM 1 ticket is handed out
before the first GEMM 2 ticket), so the wait ends however the GPU schedules programs. Waiting for the
unit's own assignment, not all of GEMM 1, was up to 9% faster at 2-8 tokens on an H100; an L2
prefetch of a GEMM 2 unit's weights before its wait, up to 12% slower; counters reset by the last
program (no zero fill), within 2% (``two-phase-variants-s38.json``; Chapter 10's Table 10.5).

Both units run one K loop (:func:`_rows_times_token`): a tile of weight rows (a GEMM 1 unit's gate
rows and as many up rows, or a GEMM 2 unit's output rows) times the token's row. A tensor-core
product needs 16 rows on its M side, so the token is row 0 of a 16-row tile (rows 1-15 loaded as
zeros). Without ``swap_ab`` the token is the MMA's A operand and the weights are B: 16-row M tiles,
which Triton 3.6 runs on ``mma.sync``, and which on Hopper take fp8 only after converting each pair
of values to fp16 (``cvt.rn.f16x2.e4m3x2``: a conversion per weight element, on the CUDA cores).
With ``swap_ab`` the weights are A (``2 * block_f`` or ``block_d`` rows on M) and the token is
column 0 of B: 64-row tiles make Hopper's ``wgmma``, which reads both operands from shared memory as
they are, fp8 included. With ``k_chunks`` > 1 a step reads that many chunks of ``block_k`` values of
each weight row, stacked as rows of the tile, and the token's chunks fill rows 0, 1, .. of its tile:
an fp8 step then reads 256 or 512 bytes of a row, each chunk with its own 128-value scale group.

fp8 block weights run W8A8 with the two-GEMM path's quantisation: each unit first quantises its
token's row (``x`` or ``h``) in 1 x 128 groups (:mod:`moe_kernels.kernels.quant`'s scale, ``amax /
448``) into its program's scratch row, so no quantiser launch precedes the kernel, and the K loop
only copies (all in the software pipeline) and multiplies, promoting each 128-K group by its scales.
Quantising each step's 128 values in the loop instead stalled on barriers: 0.85-0.92 times the two
GEMMs' speed at 1-4 tokens (``two-phase-ab-parts-s37.json``).

    >>> import torch
    >>> from moe_kernels.reference import moe_reference
    >>> from moe_kernels.kernels.config import OneLaunchTiles
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(1, 64, generator=g)                  # one token, d = 64
    >>> w1 = torch.randn(4, 2 * 32, 64, generator=g) / 8     # E = 4, F = 32
    >>> w2 = torch.randn(4, 64, 32, generator=g) / 4
    >>> ids, weights = torch.tensor([[3, 1]]), torch.tensor([[0.75, 0.25]])
    >>> tiles = OneLaunchTiles(block_f=16, block_d=32, phases=2, block_k=32)
    >>> units(1, 2, 64, 32, tiles)   # GEMM 1: 2 assignments x 2 row blocks of F; GEMM 2: x 2 of d
    (4, 4)
    >>> out = run_two_phase(x, w1, w2, weights, ids, fmt=UNQUANTIZED, tiles=tiles)
    >>> bool(torch.linalg.norm(out.double() - moe_reference(x, w1, w2, weights, ids)) < 1e-5)
    True
"""

from __future__ import annotations

import torch

from .._checks import device_id_check, fail
from .._runtime import INTERPRET, HAS_TRITON, cdiv, device_assert_options, kernel, note_launch, tl, use_triton
from . import quant
from ._one_launch_parts import ROUND, one_launch_reference, scale_strides, settled_without_launch
from ._tile_gemm import dot_precision, programs_per_device
from .config import OneLaunchTiles
from .formats import UNQUANTIZED

__all__ = ["run_two_phase", "two_phase_reference", "units"]


def units(num_tokens: int, top_k: int, d: int, f: int, tiles: OneLaunchTiles) -> tuple[int, int]:
    """Work units of each phase: (GEMM 1's, GEMM 2's)."""
    return num_tokens * top_k * cdiv(f, tiles.block_f), num_tokens * top_k * cdiv(d, tiles.block_d)


if HAS_TRITON:
    from ._one_launch_parts import _now, _rounded, _sm

    @kernel
    def _quantize_row(src_ptr, n, q_ptr, s_ptr):
        """``n`` values at ``src_ptr`` (a multiple of 128) to fp8 at ``q_ptr``, one scale (amax / 448)
        per 128 at ``s_ptr``, as :func:`~moe_kernels.kernels.quant.per_token_group_quant_fp8` does."""
        for g0 in range(0, n, 1024):   # eight groups a pass
            group = g0 // 128 + tl.arange(0, 8)
            offs = group[:, None] * 128 + tl.arange(0, 128)[None, :]
            ok = offs < n
            v = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-10) / 448.0
            q = tl.clamp(v / scale[:, None], -448.0, 448.0)
            tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(s_ptr + group, scale, mask=group * 128 < n)

    @kernel
    def _rows_times_token(w_rows, rows_ok, a_row, K, s_rows, stride_sk, qs_ptr, BLOCK_R: tl.constexpr,
                          BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, QUANT: tl.constexpr, STAGES: tl.constexpr,
                          PRECISION: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr):
        """``[BLOCK_R]`` fp32: each weight row dotted with the token's row ``a_row`` over ``K``, read as
        ``BLOCK_R * CHUNKS`` stacked rows ``(r, c)`` (``w_rows``: pointers to row r's chunk c; ``rows_ok``);
        fp8 promotes each 128-K group by its scales (``s_rows``: each stacked row's at the first K group;
        ``qs_ptr``: the token's)."""
        # >>> book: two-phase-k-loop
        # A step reads CHUNKS chunks of BLOCK_K values of every weight row as rows of
        # one tile (row (r, c): row r's chunk c); row c of the token tile is its chunk
        # c. Entry ((r, c), c) of their product is row r's partial sum over chunk c,
        # and each chunk keeps its own fp8 scales (no tile is split).
        RC: tl.constexpr = BLOCK_R * CHUNKS
        chunk = tl.arange(0, RC) % CHUNKS   # each stacked row's chunk
        # SWAP: the weights as the MMA's A operand ([RC, 16] = W . a^T), so that 64
        # rows make Hopper's wgmma, which reads fp8 from shared memory as it is; else
        # the token is A ([16, RC] = a . W^T) on mma.sync.
        if SWAP:
            acc = tl.zeros([RC, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([16, RC], dtype=tl.float32)
        t = tl.arange(0, 16)[:, None]   # the token tile's rows (past CHUNKS: loaded zeros)
        for k0 in tl.range(0, K, BLOCK_K * CHUNKS, num_stages=STAGES):
            kt = k0 + (t % CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            a_ok = t < CHUNKS
            k = k0 + tl.arange(0, BLOCK_K)
            # (no K mask where K divides: it cuts loads to one element, out of the pipeline)
            if SWAP:
                w_ok = rows_ok[:, None]
                if not EVEN_K:   # (chunk c's values start at k0 + c * BLOCK_K)
                    w_ok = w_ok & (chunk[:, None] * BLOCK_K + k[None, :] < K)
                w_ptrs = w_rows[:, None] + k[None, :]
            else:
                w_ok = rows_ok[None, :]
                if not EVEN_K:
                    w_ok = w_ok & (chunk[None, :] * BLOCK_K + k[:, None] < K)
                w_ptrs = w_rows[None, :] + k[:, None]
            if not EVEN_K:
                a_ok = a_ok & (kt < K)
            a = tl.load(a_row + kt, mask=a_ok, other=0.0)
            w = tl.load(w_ptrs, mask=w_ok, other=0.0)
            if QUANT:   # each chunk's scales (its 128-K group), promoted into fp32 sums
                group = (k0 + chunk * BLOCK_K) // 128   # (past K: no scale, and 0 not NaN)
                g_ok = rows_ok if EVEN_K else rows_ok & (k0 + chunk * BLOCK_K < K)
                scale = tl.load(s_rows + group * stride_sk, mask=g_ok, other=0.0)
                scale *= tl.load(qs_ptr + group, mask=g_ok | EVEN_K, other=0.0)
                if SWAP:
                    acc += tl.dot(w, tl.trans(a)) * scale[:, None]
                else:
                    acc += tl.dot(a, w) * scale[None, :]
            elif SWAP:
                acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
        # Row (r, c)'s sum is in the token tile's column (SWAP) or row c.
        if SWAP:
            v = tl.sum(tl.where(t.T == chunk[:, None], acc, 0.0), axis=1)
        else:
            v = tl.sum(tl.where(t == chunk[None, :], acc, 0.0), axis=0)
        if CHUNKS > 1:   # (row r's chunks, one after another)
            v = tl.sum(tl.reshape(v, [BLOCK_R, CHUNKS]), axis=1)
        return v
        # <<< book: two-phase-k-loop

    @kernel
    def _gate_up_unit(unit, x_ptr, w1_ptr, h_ptr, q_ptr, qs_ptr, topk_ids_ptr, w1_scale_ptr, num_experts, D, F,
                      stride_x, stride_w1e, stride_w1n, stride_s1e, stride_s1n, stride_s1k,
                      TOP_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
                      QUANT: tl.constexpr,
                      ID_CHECK: tl.constexpr, STAGES: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr,
                      EVEN_K: tl.constexpr, SWAP: tl.constexpr):
        # >>> book: two-phase-gate-up
        slices = tl.cdiv(F, BLOCK_F)
        assignment = unit // slices   # (neighbouring units: one expert's neighbouring rows)
        token = (assignment // TOP_K).to(tl.int64)
        expert = tl.load(topk_ids_ptr + assignment).to(tl.int64)
        known = (expert >= 0) & (expert < num_experts)
        if ID_CHECK != "":
            tl.device_assert(known, ID_CHECK)
        # (an unchecked bad id reads expert 0's rows and writes h = 0)
        expert = tl.where(known, expert, 0)
        rows = (unit % slices) * BLOCK_F + tl.arange(0, BLOCK_F)
        rows_ok = rows < F
        if QUANT:   # the token's row in fp8, 1 x 128 groups, into this program's scratch
            _quantize_row(x_ptr + token * stride_x, D, q_ptr, qs_ptr)
            tl.debug_barrier()
            a_row = q_ptr
        else:
            a_row = x_ptr + token * stride_x
        # One tile of the slice's gate rows, then as many up rows (F further on),
        # each row's CHUNKS chunks a stacked row (r, c): r = i // CHUNKS, c = i % CHUNKS
        i = tl.arange(0, 2 * BLOCK_F * CHUNKS)
        r, chunk_start = i // CHUNKS, (i % CHUNKS) * BLOCK_K
        f_row = (unit % slices) * BLOCK_F + r % BLOCK_F
        tile_rows = (f_row + tl.where(r < BLOCK_F, 0, F)).to(tl.int64)
        tile_ok = (f_row < F) & (chunk_start < D)
        w_rows = w1_ptr + expert * stride_w1e + tile_rows * stride_w1n + chunk_start
        s_rows = w1_scale_ptr + expert * stride_s1e + (tile_rows // 128) * stride_s1n
        v = _rows_times_token(w_rows, tile_ok, a_row, D, s_rows, stride_s1k, qs_ptr,
                              2 * BLOCK_F, BLOCK_K, CHUNKS, QUANT, STAGES, PRECISION,
                              EVEN_K, SWAP)
        g, u = tl.split(tl.permute(tl.reshape(v, [2, BLOCK_F]), [1, 0]))
        h = _rounded(g / (1.0 + tl.exp(-g)) * u, ROUND)   # as the two-GEMM path stores h
        h = tl.where(known, h, 0.0)
        h_row = h_ptr + assignment.to(tl.int64) * F   # (past 2**31 at ~131k DeepSeek-V3 tokens)
        tl.store(h_row + rows, h.to(h_ptr.dtype.element_ty), mask=rows_ok)
        # <<< book: two-phase-gate-up

    @kernel
    def _down_unit(unit, h_ptr, w2_ptr, q_ptr, qs_ptr, part_ptr, arrivals_ptr, ready_ptr, out_ptr, add_ptr,
                   topk_weights_ptr, topk_ids_ptr, w2_scale_ptr, num_experts, D, F, stride_w2e, stride_w2n,
                   stride_out, stride_add, stride_s2e, stride_s2n, stride_s2k,
                   TOP_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                   CHUNKS: tl.constexpr,
                   QUANT: tl.constexpr, STAGES: tl.constexpr, HAS_ADD: tl.constexpr, PRECISION: tl.constexpr,
                   EVEN_K: tl.constexpr, SWAP: tl.constexpr):
        # >>> book: two-phase-down
        row_blocks = tl.cdiv(D, BLOCK_D)
        assignment = unit // row_blocks   # (neighbouring units: one expert's rows)
        token = (assignment // TOP_K).to(tl.int64)
        block = token * row_blocks + unit % row_blocks   # (token, row block)
        cols = (unit % row_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        cols_ok = cols < D
        expert = tl.load(topk_ids_ptr + assignment).to(tl.int64)
        known = (expert >= 0) & (expert < num_experts)
        expert = tl.where(known, expert, 0)   # (a bad id: expert 0, weight 0)
        weight = tl.load(topk_weights_ptr + assignment).to(tl.float32)
        weight = tl.where(known, weight, 0.0)
        # Wait until the assignment's GEMM 1 units have all written their h (an
        # acquire at GPU scope: their stores are then visible to this unit's loads).
        ready = tl.atomic_add(ready_ptr + assignment, 0, sem="acquire")
        while ready < tl.cdiv(F, BLOCK_F):
            ready = tl.atomic_add(ready_ptr + assignment, 0, sem="acquire")
        tl.debug_barrier()
        h_row = h_ptr + assignment.to(tl.int64) * F
        if QUANT:   # the assignment's h in fp8, 1 x 128 groups, into this program's scratch
            _quantize_row(h_row, F, q_ptr, qs_ptr)
            tl.debug_barrier()
            a_row = q_ptr
        else:
            a_row = h_row
        i = tl.arange(0, BLOCK_D * CHUNKS)   # stacked rows (r, c), as in GEMM 1's units
        rows = ((unit % row_blocks) * BLOCK_D + i // CHUNKS).to(tl.int64)
        chunk_start = (i % CHUNKS) * BLOCK_K
        w_rows = w2_ptr + expert * stride_w2e + rows * stride_w2n + chunk_start
        s_rows = w2_scale_ptr + expert * stride_s2e + (rows // 128) * stride_s2n
        rows_ok = (rows < D) & (chunk_start < F)
        part = _rows_times_token(w_rows, rows_ok, a_row, F, s_rows, stride_s2k, qs_ptr, BLOCK_D,
                                 BLOCK_K, CHUNKS, QUANT, STAGES, PRECISION, EVEN_K, SWAP)
        part *= weight
        # The top-k sum: each unit stores its expert's part of the rows; the
        # last of the token's TOP_K units to arrive adds them, in slot order
        # (the same sum whichever unit arrives last).
        tl.store(part_ptr + assignment.to(tl.int64) * D + cols, part, mask=cols_ok)
        tl.debug_barrier()   # every thread's stores, then one release
        arrived = tl.atomic_add(arrivals_ptr + block, 1, sem="acq_rel")
        if arrived == TOP_K - 1:
            tl.debug_barrier()   # (thread 0's acquire, for all threads)
            row = tl.zeros([BLOCK_D], dtype=tl.float32)
            for j in range(TOP_K):
                row += tl.load(part_ptr + (token * TOP_K + j) * D + cols,
                               mask=cols_ok, other=0.0, cache_modifier=".cg")
            if HAS_ADD:   # a shared expert's output joins the fp32 sum
                extra = tl.load(add_ptr + token * stride_add + cols, mask=cols_ok,
                                other=0.0)
                row += extra.to(tl.float32)
            row = row.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + token * stride_out + cols, row, mask=cols_ok)
        # <<< book: two-phase-down

    @kernel(do_not_specialize=["num_tokens"])
    def _two_phase_kernel(
        x_ptr, w1_ptr, w2_ptr, h_ptr, part_ptr, q_ptr, qs_ptr, out_ptr, add_ptr, topk_weights_ptr, topk_ids_ptr,
        counters_ptr, w1_scale_ptr, w2_scale_ptr, timeline_ptr, num_tokens, num_experts, D, F,
        stride_x, stride_w1e, stride_w1n, stride_w2e, stride_w2n, stride_out, stride_add,
        stride_s1e, stride_s1n, stride_s1k, stride_s2e, stride_s2n, stride_s2k,
        TOP_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, QUANT: tl.constexpr, ID_CHECK: tl.constexpr,
        STAGES: tl.constexpr,
        HAS_ADD: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
        EVEN_F: tl.constexpr, SWAP: tl.constexpr, TIMELINE: tl.constexpr,
    ):
        # >>> book: two-phase
        # counters: [0] the next ticket; [1, 1 + A) GEMM 1 units done per
        # assignment; then GEMM 2 units arrived per (token, row block).
        assignments = num_tokens * TOP_K
        slices = tl.cdiv(F, BLOCK_F)
        n1 = assignments * slices
        n2 = assignments * tl.cdiv(D, BLOCK_D)
        ready_ptr = counters_ptr + 1
        arrivals_ptr = ready_ptr + assignments
        # this program's fp8 scratch row and its scales (fp8 weights only)
        q_row = q_ptr + tl.program_id(0).to(tl.int64) * tl.maximum(D, F)
        qs_row = qs_ptr + tl.program_id(0).to(tl.int64) * tl.cdiv(tl.maximum(D, F), 128)
        ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed")
        while ticket < n1 + n2:
            if TIMELINE:
                started = _now()
            if ticket < n1:
                _gate_up_unit(
                    ticket, x_ptr, w1_ptr, h_ptr, q_row, qs_row, topk_ids_ptr,
                    w1_scale_ptr, num_experts, D, F, stride_x, stride_w1e,
                    stride_w1n, stride_s1e, stride_s1n, stride_s1k, TOP_K, BLOCK_F,
                    BLOCK_K, CHUNKS, QUANT, ID_CHECK, STAGES, ROUND, PRECISION, EVEN_D, SWAP)
                # Every thread's stores of h, then one release: a unit that
                # sees the count sees h.
                tl.debug_barrier()
                tl.atomic_add(ready_ptr + ticket // slices, 1, sem="release")
            else:
                _down_unit(
                    ticket - n1, h_ptr, w2_ptr, q_row, qs_row, part_ptr, arrivals_ptr,
                    ready_ptr, out_ptr, add_ptr, topk_weights_ptr, topk_ids_ptr,
                    w2_scale_ptr, num_experts, D, F, stride_w2e, stride_w2n, stride_out,
                    stride_add, stride_s2e, stride_s2n, stride_s2k, TOP_K, BLOCK_F,
                    BLOCK_D, BLOCK_K, CHUNKS, QUANT, STAGES, HAS_ADD, PRECISION, EVEN_F, SWAP)
            if TIMELINE:   # (start, end, SM) of each unit, in ns of the global clock
                tl.store(timeline_ptr + ticket * 3, started)
                tl.store(timeline_ptr + ticket * 3 + 1, _now())
                tl.store(timeline_ptr + ticket * 3 + 2, _sm().to(tl.int64))
            tl.debug_barrier()   # (the next unit rewrites the scratch row)
            ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed")
        # <<< book: two-phase


#: A tensor of ``[n1 + n2, 3]`` int64 that the next launches fill with each unit's start and end on the
#: GPU's global clock (ns) and its SM (tools/two_phase_variants.py's timelines); None: no timeline.
timeline: torch.Tensor | None = None


def run_two_phase(hidden_states, w1, w2, topk_weights, topk_ids, *, fmt=UNQUANTIZED, tiles: OneLaunchTiles,
                  w1_scale=None, w2_scale=None, ids: str = "validate", func: str = "one_launch_experts", add=None,
                  _round_to=None) -> torch.Tensor:
    """``fused_experts``' result (``[T, d]``) from :func:`_two_phase_kernel`, after the caller's
    checks (:func:`~moe_kernels.kernels.one_launch.run_one_launch` hands ``tiles.phases == 2``
    here). ``ids`` and ``add`` as there; fp8 only in the block format (W8A8, 1 x 128 groups)."""
    if fmt.quantized and fmt.activations != "group":
        fail(func, "w1_scale", "must be block scales (fp8-block) for a two-phase launch: it quantises the "
             "activations in 1 x 128 groups, as the block format's GEMMs do", fmt.name)
    if fmt.quantized and tiles.block_k != fmt.block[1]:
        fail(func, "tiles.block_k", f"must be {fmt.block[1]} for {fmt.name} weights (one activation group a step)",
             tiles.block_k)
    num_tokens, top_k = topk_ids.shape
    num_experts, d, f = w2.shape
    # (the interpreter's float32 -> fp8 cast is wrong: fp8 there is the torch reference)
    reference = not use_triton(hidden_states, w1, w2) or (INTERPRET and fmt.quantized and
                                                           quant.INTERPRETER_ROUNDS_FP8_WRONGLY)
    out, done = settled_without_launch(run_two_phase, hidden_states, w1, w2, topk_weights, topk_ids,
                                       reference=reference, fmt=fmt, w1_scale=w1_scale, w2_scale=w2_scale, ids=ids,
                                       func=func, add=add, tiles=tiles)
    if done:
        return out
    id_check = device_id_check(func, "topk_ids", topk_ids, num_experts) if ids == "validate" else ""
    n1, n2 = units(num_tokens, top_k, d, f, tiles)
    grid = (min(n1 + n2, tiles.programs_per_sm * programs_per_device(out.device)),)
    counters = torch.zeros(1 + num_tokens * top_k + num_tokens * cdiv(d, tiles.block_d), device=out.device,
                           dtype=torch.int32)
    marks = timeline
    if marks is not None and (marks.shape != (n1 + n2, 3) or marks.dtype != torch.int64 or marks.device != out.device):
        fail(func, "two_phase.timeline", f"must be None or an int64 tensor of shape ({n1 + n2}, 3) on {out.device} "
             "(one row per unit of this call)", f"{marks.dtype} {tuple(marks.shape)} on {marks.device}")
    h = torch.empty((num_tokens * top_k, f), device=out.device, dtype=hidden_states.dtype)
    parts = torch.empty((num_tokens * top_k, d), device=out.device, dtype=torch.float32)
    # fp8: each program's scratch row (x's or h's groups in fp8) and its scales. 16-bit weights read neither: h and
    # parts stand in, since an empty tensor (address 0) would keep a recorded call from replaying (_replay)
    q, q_scales = (torch.empty((grid[0], max(d, f)), device=out.device, dtype=w1.dtype), torch.empty(
        (grid[0], cdiv(max(d, f), 128)), device=out.device, dtype=torch.float32)) if fmt.quantized else (h, parts)
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    ids_flat = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    note_launch("two_phase.experts", format=fmt.name, **tiles.as_dict(), add=add is not None)
    step = tiles.block_k * tiles.k_chunks   # (K values of a weight row a step)
    _two_phase_kernel[grid](
        hidden_states, w1, w2, h, parts, q, q_scales, out, out if add is None else add, weights, ids_flat, counters,
        w1 if w1_scale is None else w1_scale, w2 if w2_scale is None else w2_scale,
        counters if marks is None else marks, num_tokens, num_experts, d, f,
        hidden_states.stride(0), w1.stride(0), w1.stride(1), w2.stride(0), w2.stride(1), out.stride(0),
        0 if add is None else add.stride(0), *scale_strides(w1_scale), *scale_strides(w2_scale),
        TOP_K=top_k, BLOCK_F=tiles.block_f, BLOCK_D=tiles.block_d,
        BLOCK_K=tiles.block_k, CHUNKS=tiles.k_chunks, QUANT=fmt.quantized, ID_CHECK=id_check, STAGES=tiles.num_stages,
        HAS_ADD=add is not None, ROUND=ROUND[_round_to or hidden_states.dtype],
        PRECISION=dot_precision(hidden_states.dtype), EVEN_D=d % step == 0, EVEN_F=f % step == 0,
        SWAP=tiles.swap_ab, TIMELINE=marks is not None and not INTERPRET,
        num_warps=tiles.num_warps, **device_assert_options(id_check))
    return out


def two_phase_reference(hidden_states, w1, w2, topk_weights, topk_ids, *, fmt=UNQUANTIZED, w1_scale=None,
                        w2_scale=None, add=None) -> torch.Tensor:
    """Torch reference of the kernel: :func:`~moe_kernels.kernels._one_launch_parts.one_launch_reference`'s
    float32 products and rounding of ``h``, with fp8's activations (``x`` and ``h``) quantised in
    1 x 128 groups first (W8A8, the block format's GEMMs)."""
    return one_launch_reference(hidden_states, w1, w2, topk_weights, topk_ids, fmt=fmt, w1_scale=w1_scale,
                                w2_scale=w2_scale, add=add, quantize_activations=fmt.quantized)

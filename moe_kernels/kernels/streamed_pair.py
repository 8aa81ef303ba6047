"""Both expert GEMMs as one stream of tiles: GEMM 2 starts on a block as soon as GEMM 1 is done with it.

Two grouped GEMMs launched one after the other each pay a start and a tail: the second kernel's
programs begin only when the first kernel's last program has finished, and while the first kernel
drains, fewer and fewer SMs are streaming weights. Measured on the H200 (the notes' session 19), a
read of Qwen3-30B-A3B's GEMM 2 weights (403 MB) in one kernel costs a fixed 13-14 us over its floor
however it is read, and so does GEMM 1's. But GEMM 2 does not need *all* of GEMM 1: the tile of
M-block ``m`` needs only block ``m``'s rows of the intermediate ``h`` (its padding rows read row 0
of ``h``, whatever it holds: they are never stored).

So here one launch runs the tiles of both GEMMs. Programs take a ticket, one atomic add each, and
the ticket names the work. With ``n1`` GEMM 1 N-tiles and ``n2`` GEMM 2 N-tiles per M-block and a
``lag`` of ``L`` blocks, the tickets are, in order:

* GEMM 1's tiles of blocks ``0 .. L-1``;
* for each block ``b`` from 0: GEMM 1's tiles of block ``b + L``, then GEMM 2's tiles of block ``b``;
* GEMM 2's tiles of the last ``L`` blocks.

A GEMM 1 tile writes its rows of ``h = silu(x W1g^T) * (x W1u^T)``, then adds one arrival to its
block's count (a release: the tile's stores are visible before the count). A GEMM 2 tile waits
until its block's count reaches ``n1`` (an acquire), then reads that block's ``h`` rows and writes
``topk_weight * (h W2^T)`` like the two-launch GEMM 2.

A ticket is taken only by a running program, and GEMM 1's tickets of block ``b`` all come before
GEMM 2's of block ``b``: whoever waits, waits for programs that already hold their SMs, so the
wait always ends (no order of dispatch is assumed). The lag keeps the waits short: a GEMM 1 tile
streams far more weights than a GEMM 2 tile (Qwen3-30B-A3B in bf16, 128 columns: 1 MB against
0.2 MB), so GEMM 2 catches up with GEMM 1 unless it starts well behind. A lag of every block runs
all of GEMM 1 first, like two launches but with no boundary between them. The weights are read exactly as
often as by the two launches; ``h`` goes through L2 as before. With ``PREFETCH`` a GEMM 2 program
asks L2 for its weight tile before it waits. On a naive map every block is one assignment, as in
vLLM's map (``BlockAssignment.naive_group`` is not taken here): GEMM 2's block ``m`` waits only for
GEMM 1's block ``m``, and a grouped block ``m`` would read rows that other blocks' GEMM 1 tiles write.

Measured on the H200 (section 12, Table 12.3; ``tools/streamed_pair_ab.py``): in bf16 within
0.99-1.02x of the two launches at 8-512 Qwen3-30B-A3B tokens (the boundary between two launches in a
CUDA graph costs little; the tickets and GEMM 2 running with GEMM 1's warps and stages cost about as
much); in fp8 0.92-0.93x at 256-512 tokens with 4 warps, where the H200 table takes it. The prefetch
was slower everywhere (``PREFETCH = 0``); lags of 2-8 blocks lost up to 1.7x (a waiting program
holds its SM).

    >>> import torch
    >>> from moe_kernels.kernels.blocks import assign_blocks
    >>> from moe_kernels.kernels.config import GemmTiles
    >>> from moe_kernels.reference import moe_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(3, 32, generator=g)                    # 3 tokens, d = 32
    >>> w1 = torch.randn(4, 2 * 32, 32, generator=g) / 6       # E = 4, F = 32
    >>> w2 = torch.randn(4, 32, 32, generator=g) / 6
    >>> ids = torch.tensor([[0, 2], [2, 3], [2, 1]])
    >>> weights = torch.full((3, 2), 0.5)
    >>> blocks = assign_blocks(ids, 16, 4, naive=False)
    >>> tiles = GemmTiles(block_n=16, block_k=16)
    >>> per_slot = streamed_pair(x, w1, w2, weights, blocks, 2, gate_up=tiles, down=tiles, lag=1)
    >>> blocks.num_m_blocks, tickets(blocks.num_m_blocks, 32, 32, tiles, tiles)   # 5 x (2 + 2)
    (5, 20)
    >>> ref = moe_reference(x, w1, w2, weights, ids)
    >>> bool(torch.allclose(per_slot.sum(1).double(), ref, atol=1e-4))
    True
"""

from __future__ import annotations

import torch

from .._checks import fail
from .._runtime import (HAS_TRITON, INTERPRET, cdiv, device_assert_options, interpreted_bf16, kernel, note_launch,
                        recording, tl, use_triton)
from ._gemm_operands import dequantized
from ._tile_gemm import dot_precision, weight_descriptor
from .blocks import BlockAssignment
from .config import GemmTiles, check_stream
from .gather_tile import rows_reference

if HAS_TRITON:
    from .gather_tile import _index_gather_tile, _prefetch_tile_weights

#: GEMM 2's programs ask L2 for their weight tile before they wait (1) or not (0); compiled kernels only.
PREFETCH = 0
#: Programs take their work by ticket, an atomic add (1); or, to measure what the tickets cost, by
#: program id (0), which is safe only on a GPU that starts programs in order (not promised by CUDA).
TICKETS = 1
#: Bytes per L2 line: one prefetch instruction each.
_LINE_BYTES = 128


def tickets(num_m_blocks: int, f: int, d: int, gate_up: GemmTiles, down: GemmTiles) -> int:
    """Programs of one launch: every block's GEMM 1 and GEMM 2 N-tiles, one program each."""
    return num_m_blocks * (cdiv(f, gate_up.block_n) + cdiv(d, down.block_n))


if HAS_TRITON:

    @kernel(do_not_specialize=["num_m_blocks", "num_valid_rows", "num_experts", "lag"])
    def _streamed_pair_kernel(
        x_ptr, w1_ptr, h_ptr, w2_ptr, out_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
        num_tokens_post_padded_ptr, counters_ptr,
        num_m_blocks, num_valid_rows, num_experts, D, F,
        stride_xm, stride_w1e, stride_w1n, stride_hm, stride_w2e, stride_w2n, stride_om,
        x_scale_ptr, stride_xs, w1_scale_ptr, stride_w1se, stride_w1sn, stride_w1sk,
        h_scale_ptr, stride_hs, w2_scale_ptr, stride_w2se, stride_w2sn, stride_w2sk,
        w1_desc, w2_desc, lag,
        BLOCK_M: tl.constexpr, TOP_K: tl.constexpr, NAIVE_BLOCKS: tl.constexpr, SCALES: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, INPUT_PRECISION: tl.constexpr, ID_CHECK_1: tl.constexpr,
        ID_CHECK_2: tl.constexpr,
        BN1: tl.constexpr, BK1: tl.constexpr, SWAP1: tl.constexpr, TMA1: tl.constexpr, EVEN_K1: tl.constexpr,
        BN2: tl.constexpr, BK2: tl.constexpr, SWAP2: tl.constexpr, TMA2: tl.constexpr, EVEN_K2: tl.constexpr,
        QUANT_GROUP: tl.constexpr, ROUND_TO: tl.constexpr, PREFETCH_W2: tl.constexpr, TICKETS: tl.constexpr,
        PREFETCH_LINE: tl.constexpr,
    ):
        # counters: [0] the next ticket, [1:] arrivals of GEMM 1's tiles per block; zeros at launch.
        if TICKETS:
            ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed")
        else:   # (measurement only: relies on the GPU dispatching programs in order to make progress)
            ticket = tl.program_id(0)
        n1 = tl.cdiv(F, BN1)
        n2 = tl.cdiv(D, BN2)
        # Tickets: the first `lag` blocks' GEMM 1 tiles; then slots of block b + lag's GEMM 1 tiles
        # followed by block b's GEMM 2 tiles; then the last `lag` blocks' GEMM 2 tiles.
        lead = lag * n1
        middle = (num_m_blocks - lag) * (n1 + n2)
        in_lead = ticket < lead
        in_middle = (ticket >= lead) & (ticket < lead + middle)
        slot = (ticket - lead) // (n1 + n2)
        r = (ticket - lead) % (n1 + n2)
        past = ticket - lead - middle
        gemm1_block = tl.where(in_lead, ticket // n1, tl.where(in_middle & (r < n1), slot + lag, -1))
        gemm1_tile = tl.where(in_lead, ticket, (slot + lag) * n1 + r)
        gemm2_block = tl.where(in_middle, slot, num_m_blocks - lag + past // n2)
        gemm2_tile = tl.where(in_middle, slot * n2 + r - n1, (num_m_blocks - lag) * n2 + past)
        arrivals = counters_ptr + 1
        if gemm1_block >= 0:   # GEMM 1: one N-tile of a block, into h
            _index_gather_tile(
                gemm1_tile, x_ptr, w1_ptr, h_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                num_tokens_post_padded_ptr, num_m_blocks, num_valid_rows, num_experts, F, D,
                stride_xm, stride_w1e, stride_w1n, stride_hm,
                x_scale_ptr, stride_xs, w1_scale_ptr, stride_w1se, stride_w1sn, stride_w1sk,
                BLOCK_M, BN1, BK1, 1, TOP_K, NAIVE_BLOCKS, False, True, False, EVEN_K1,
                INPUT_PRECISION, SCALES, 0, 1, w1_desc, TMA1, SCALE_BN, SCALE_BK, ID_CHECK_1, SWAP1,
                h_scale_ptr, stride_hs, QUANT_GROUP, ROUND_TO)
            # >>> book: stream-arrival
            # Every thread's stores of the tile, then one release: a reader
            # that sees the count sees the rows.
            tl.debug_barrier()
            tl.atomic_add(arrivals + gemm1_block, 1, sem="release")
            # <<< book: stream-arrival
        else:   # GEMM 2: one N-tile of a block, from h, once GEMM 1 is done with that block
            if PREFETCH_W2:
                _prefetch_tile_weights(gemm2_tile, w2_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, num_m_blocks,
                                       num_experts, D, F, stride_w2e, stride_w2n, BLOCK_M, BN2, 1, 1,
                                       NAIVE_BLOCKS, False, PREFETCH_LINE)
            # >>> book: stream-wait
            # Wait until all n1 GEMM 1 tiles of this block have arrived (an
            # acquire: their rows of h are then visible), then read them.
            seen = tl.atomic_add(arrivals + gemm2_block, 0, sem="acquire")
            while seen < n1:
                seen = tl.atomic_add(arrivals + gemm2_block, 0, sem="acquire")
            tl.debug_barrier()
            # <<< book: stream-wait
            _index_gather_tile(
                gemm2_tile, h_ptr, w2_ptr, out_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                num_tokens_post_padded_ptr, num_m_blocks, num_valid_rows, num_experts, D, F,
                stride_hm, stride_w2e, stride_w2n, stride_om,
                h_scale_ptr, stride_hs, w2_scale_ptr, stride_w2se, stride_w2sn, stride_w2sk,
                BLOCK_M, BN2, BK2, 1, 1, NAIVE_BLOCKS, False, False, True, EVEN_K2,
                INPUT_PRECISION, SCALES, 0, 1, w2_desc, TMA2, SCALE_BN, SCALE_BK, ID_CHECK_2, SWAP2,
                h_scale_ptr, stride_hs, 0, "")


def streamed_pair_reference(x, w1, w2, topk_weights, blocks: BlockAssignment, top_k: int, *, h, x_scale=None,
                            w1_scale=None, w2_scale=None, fmt=None, quant=None) -> torch.Tensor:
    """Torch reference of :func:`streamed_pair`: float32 ``[T, k, d]`` rows, the two GEMMs as the
    block map assigns them (:func:`~moe_kernels.kernels.gather_tile.rows_reference`), with ``h``
    rounded between them as the kernel stores it: to ``h``'s dtype, or in fp8 to ``quant[2]`` and
    then quantised per group (``h`` and ``quant[0]`` are written too). Rows no block holds are zero."""
    quantized = fmt is not None and fmt.quantized
    xf, w1f = dequantized(x, w1, x_scale, w1_scale, fmt) if quantized else (x, w1)
    numel = x.shape[0] * top_k
    h32 = rows_reference(xf.float(), w1f.float(), blocks, numel, top_k)
    if quantized:
        rounded = h32.to(_ROUNDED[quant[2]])
        hq, h_scale = fmt.quantize_activations(rounded, reference=True)
        h.copy_(hq)
        quant[0].copy_(h_scale)
        hf, w2f = dequantized(hq, w2, h_scale, w2_scale, fmt)
    else:
        hf, w2f = h.copy_(h32), w2
    weights = topk_weights.reshape(-1).float()
    per_slot = rows_reference(hf.float(), w2f.float(), blocks, numel, 1, weights)
    return per_slot.view(x.shape[0], top_k, w2.shape[1])


#: What GEMM 1's quantising epilogue rounds ``h`` to first (``quant[2]``).
_ROUNDED = {"bf16": torch.bfloat16, "fp16": torch.float16, "": torch.float32}


def streamed_pair(x, w1, w2, topk_weights, blocks: BlockAssignment, top_k: int, *, gate_up: GemmTiles,
                  down: GemmTiles, lag: int, out=None, h=None, x_scale=None, w1_scale=None, w2_scale=None,
                  fmt=None, quant=None, id_check: tuple = ("", ""), num_warps: int | None = None):
    """Both GEMMs of the index-gather layer in one launch: returns ``out`` ``[T, k, d]``, row
    ``(t, j)`` = ``topk_weights[t, j] * (W2[e] @ silu·mul(W1[e] @ x[t]))``, as
    :func:`~moe_kernels.kernels.index_gather.expert_gate_up` followed by
    :func:`~moe_kernels.kernels.index_gather.expert_down` would write it.

    Unchecked beyond the tiles (the layer's :func:`~moe_kernels.kernels.index_gather.run_experts`
    calls it after its checks). ``h`` is GEMM 1's output buffer ``[T*k, F]`` (made when None);
    fp8 block weights need ``quant = (h_scale, group, round_to)``: GEMM 1's epilogue quantises
    ``h`` for GEMM 2, as ``MoEConfig.quant_in_gemm`` does. ``id_check``: the device-assert
    message of GEMM 1 and of GEMM 2 (a naive map's ids, checked by one of them).
    """
    check_stream("streamed_pair", gate_up, down, lag)
    if fmt is not None and fmt.quantized:
        if fmt.activations != "group":
            fail("streamed_pair", "fmt", "must be unquantised or fp8 with 1 x G activation groups (the block format: "
                 "GEMM 1's epilogue quantises GEMM 2's input per group)", fmt.name)
        if quant is None:
            fail("streamed_pair", "quant", "must be (h_scale, group, round_to) for fp8 weights (GEMM 1's epilogue "
                 "quantises h)", None)
        fmt.check_gated("streamed_pair", "w1", w1)
    num_tokens = x.shape[0]
    numel = num_tokens * top_k
    e, two_f, d_in = w1.shape
    f, d = two_f // 2, w2.shape[1]
    if out is None:
        out = torch.empty((num_tokens, top_k, d), device=x.device, dtype=x.dtype if quant is None else torch.bfloat16)
    if h is None:
        h = torch.empty((numel, f), device=x.device, dtype=x.dtype)
    if not use_triton(x, w1, out) or interpreted_bf16(x, w1, w2):
        # No compiled kernel, or the interpreter's wrong bf16 dot: the torch reference, in float32.
        return out.copy_(streamed_pair_reference(x, w1, w2, topk_weights, blocks, top_k, h=h, x_scale=x_scale,
                                                 w1_scale=w1_scale, w2_scale=w2_scale, fmt=fmt, quant=quant))
    if fmt is not None and fmt.quantized:
        gate_up, down = fmt.gemm_tiles(gate_up), fmt.gemm_tiles(down)
        scales1 = fmt.scale_arguments(x, w1, x_scale, w1_scale)
        scales2 = fmt.scale_arguments(h, w2, quant[0], w2_scale)
    else:
        scales1 = (x, 0, w1, 0, 0, 0, 0, 128, 128)
        scales2 = (h, 0, w2, 0, 0, 0, 0, 128, 128)
    if numel == 0 or blocks.num_m_blocks == 0:
        return out
    grid = (tickets(blocks.num_m_blocks, f, d, gate_up, down),)
    counters = torch.zeros(1 + blocks.num_m_blocks, device=x.device, dtype=torch.int32)
    w1_desc, w2_desc = weight_descriptor(w1, gate_up), weight_descriptor(w2, down)
    sorted_ids = blocks.expert_ids if blocks.sorted_token_ids is None else blocks.sorted_token_ids
    num_post_padded = blocks.expert_ids if blocks.sorted_token_ids is None else blocks.num_tokens_post_padded
    if recording():
        note_launch("streamed_pair", block_m=blocks.block_m, gate_up=gate_up, down=down, lag=lag, grid=grid,
                    naive=blocks.naive, quant=quant is not None, prefetch=PREFETCH, tma=(w1_desc is not None,
                                                                                          w2_desc is not None))
    quant_args = (quant[0], quant[0].stride(0), quant[1], quant[2]) if quant is not None else (h, 0, 0, "")
    _streamed_pair_kernel[grid](
        x, w1, h, w2, out.view(-1, d), topk_weights, sorted_ids, blocks.expert_ids, num_post_padded, counters,
        blocks.num_m_blocks, numel, e, d_in, f,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0), w2.stride(0), w2.stride(1), d,
        *scales1[:6], quant_args[0], quant_args[1], *scales2[2:6],
        w1_desc if w1_desc is not None else w1, w2_desc if w2_desc is not None else w2, min(lag, blocks.num_m_blocks),
        BLOCK_M=blocks.block_m, TOP_K=top_k, NAIVE_BLOCKS=blocks.naive, SCALES=scales1[6],
        SCALE_BN=scales1[7], SCALE_BK=scales1[8], INPUT_PRECISION=dot_precision(x.dtype),
        ID_CHECK_1=id_check[0], ID_CHECK_2=id_check[1],
        BN1=gate_up.block_n, BK1=gate_up.block_k, SWAP1=gate_up.swap_ab, TMA1=w1_desc is not None,
        EVEN_K1=d_in % gate_up.block_k == 0,
        BN2=down.block_n, BK2=down.block_k, SWAP2=down.swap_ab, TMA2=w2_desc is not None, EVEN_K2=f % down.block_k == 0,
        QUANT_GROUP=quant_args[2], ROUND_TO=quant_args[3],
        PREFETCH_W2=bool(PREFETCH) and not INTERPRET,   # (the interpreter runs no inline asm)
        TICKETS=bool(TICKETS),
        PREFETCH_LINE=_LINE_BYTES // w2.element_size(),
        num_warps=num_warps or gate_up.num_warps, num_stages=gate_up.num_stages,
        **device_assert_options(id_check[0] or id_check[1]),
    )
    return out

"""The one tile-GEMM that every grouped-GEMM layout is built on.

The three layouts of the chapter (index-gather, permute, masked) differ only in how a program
finds *its rows* and *its expert*; what it then computes is the same: one ``[BLOCK_M, BLOCK_N]``
tile of ``A[rows] @ W[e]^T`` with an fp32 accumulator, optionally the matching up-projection
tile, and an epilogue. That part lives here, once:

* :func:`expert_tile_product` - the K loop, for 16/32-bit inputs or for fp8 inputs with their
  scales (:mod:`moe_kernels.kernels.quant`). ``a_rows`` are element offsets of the tile's rows,
  one per row, each naming a row that is safe to read (a layout points its padding rows at a
  real row, so the loads need no row mask and stay unpredicated; through the copy engine,
  ``TMA_A``, a tile's rows are read as they are, padding included, which is harmless because a
  product row depends on its own row only and padding rows are never stored); weight columns past ``N`` wrap
  around for the same reason (with TMA they read the next rows of the matrix instead, or zeros;
  either way those output columns are never stored). With ``GATED`` it also multiplies by the up
  half of a ``[2N, K]`` ``w1`` (rows ``N..2N``) and returns ``silu(gate) * up``, computed in fp32: this is the fused
  SiLU·mul of GEMM 1, so the ``[rows, 2N]`` pre-activation never reaches memory.
* :func:`scale_rows` - the routed-weight epilogue of GEMM 2: each row times its routing weight,
  in fp32, before the single rounding to the output dtype.
* :func:`store_tile` - the masked store: only real rows and columns ``< N`` are written.
* :func:`tile_position` - which (M-block, N-tile, K slice) a tile index names, in the L2-friendly
  order a persistent program walks (:func:`programs_per_device` programs, one per SM).
* :func:`add_tile` - the same tile added into an fp32 output with atomics, for a GEMM 2 that sums
  the top-k slots in its epilogue and may split its K loop (``SPLIT_K`` programs per tile, each
  over a slice of K): the sum is linear, so partial products can land in any order.

Host side: :func:`dot_precision` (fp32 inputs would silently run as TF32) and the tensor
descriptors of TMA loads. The operands' checks and the torch references the layouts share are in
:mod:`moe_kernels.kernels._gemm_operands`.
"""

from __future__ import annotations

import functools

import torch

from .._runtime import HAS_TRITON, kernel, tl


@functools.lru_cache(maxsize=None)
def programs_per_device(device: torch.device) -> int:
    """A persistent grid: one program per SM (the interpreter has no SMs; a few programs will do)."""
    if device.type != "cuda":
        return 4
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    """The SM count of GPU ``index``, asked once (torch's query costs microseconds per launch)."""
    return torch.cuda.get_device_properties(index).multi_processor_count



if HAS_TRITON:

    @kernel
    def expert_tile_product(
        a_ptr, a_rows, w_ptr, stride_wn, pid_n, N, K,
        a_scale_ptr, a_scale_rows, w_scale_ptr, stride_wsn, stride_wsk,
        GATED: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCALES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        split=0, SPLIT_K: tl.constexpr = 1, w_desc=None, w_desc_row=0, TMA_W: tl.constexpr = False,
        SCALE_BN: tl.constexpr = 128, SCALE_BK: tl.constexpr = 128, SWAP_AB: tl.constexpr = False,
        a_desc=None, a_desc_row=0, TMA_A: tl.constexpr = False, K_CHUNKS: tl.constexpr = 1,
    ):
        """fp32 ``[BLOCK_M, BLOCK_N]``: ``A[a_rows, :K] @ W[cols, :K]^T`` (``silu(gate) * up`` when
        ``GATED``) for output columns ``cols = pid_n * BLOCK_N + [0, BLOCK_N)``.

        ``a_ptr``/``w_ptr`` point at ``A`` and at this expert's ``W``, both contiguous along K;
        ``a_rows`` (int64) are the element offsets of the tile's rows in ``A``. fp8 inputs carry
        scales (``SCALES``; 0 for 16/32-bit inputs, whose scale arguments are unused):

        * 1, blocks: ``A`` scaled per row per ``SCALE_BK`` columns (``a_scale_ptr + a_scale_rows +
          k // SCALE_BK``), ``W`` per ``SCALE_BN x SCALE_BK`` block (``w_scale_ptr + (n // SCALE_BN) *
          stride_wsn + (k // SCALE_BK) * stride_wsk``), applied to every K step's product inside
          the loop (``BLOCK_K`` divides ``SCALE_BK``); DeepSeek-V3's blocks are 128 x 128. A
          tile whose columns lie in one scale block (``BLOCK_N`` divides ``SCALE_BN``) loads one
          weight scale per step and folds it into the rows' scales; ``SCALES`` = 4 keeps one
          scale per column there too, the general path, to measure the difference;
        * 2, channels: one scale per row of ``A`` and per row ``n`` of ``W``, after the loop;
        * 3, tensor: one scale per row of ``A`` and one for this expert's ``W``, after the loop.

        With ``SPLIT_K > 1`` the product covers only slice ``split`` of the K steps (not with
        ``GATED``: SiLU needs the whole sum). With ``TMA_W`` the weight tiles come through the
        Hopper tensor-memory accelerator: ``w_desc`` describes all experts' weights as one
        ``[E * N', K]`` matrix and ``w_desc_row`` is this tile's first row in it (the copy engine
        zero-fills past K and past the last row, so no mask is computed). With ``SWAP_AB`` each K
        step computes the transposed product, ``W_tile @ A_tile^T`` (``[BLOCK_N, BLOCK_M]``), and
        the accumulator is transposed back once after the loop: the same sums, with the weight
        rows on the MMA's M side (Hopper's wgmma needs 64 there; a decode tile has 16 token rows).
        With ``TMA_A`` (rows that lie one after another, the permute layout's segments) the
        activation tiles come through the copy engine too: ``a_desc`` describes ``A`` and
        ``a_desc_row`` is the tile's first row (``a_rows`` still places the scales).

        ``K_CHUNKS`` > 1: each K step is ``K_CHUNKS`` K-adjacent ``BLOCK_K`` chunks, loaded one after
        another and multiplied one by one, each with its own scales. A block-fp8 step cannot be wider
        than its 128-value scale block, and 128 one-byte values of a row a step read slower from DRAM than
        256 (``tools/tile_read_ab.py``): two chunks a step ask for 256 bytes of every row together.
        """
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = (cols % N).to(tl.int64)
        k_steps = tl.cdiv(K, BLOCK_K * K_CHUNKS)
        if SPLIT_K == 1:
            k_first = 0
            k_last = k_steps
        else:
            tl.static_assert(not GATED, "split-K needs a linear epilogue")
            per_split = tl.cdiv(k_steps, SPLIT_K)
            k_first = split * per_split
            k_last = tl.minimum(k_first + per_split, k_steps)
        ks = tl.arange(0, BLOCK_K)
        STEP: tl.constexpr = BLOCK_K * K_CHUNKS
        a_ptrs = a_ptr + a_rows[:, None] + ks[None, :] + k_first * STEP
        w_ptrs = w_ptr + w_rows[None, :] * stride_wn + ks[:, None] + k_first * STEP
        acc = empty_accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
        if GATED:
            up_ptrs = w_ptrs + N * stride_wn
            acc_up = empty_accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
        # >>> book: block-scale-columns
        blocked: tl.constexpr = (SCALES == 1) or (SCALES == 4)
        one_block: tl.constexpr = (SCALES == 1) and (SCALE_BN % BLOCK_N == 0)
        if one_block:
            # The tile's columns lie in one scale block: one weight scale per K step
            # (gate and up halves), not a register per column.
            w_scale_cols = w_scale_ptr + ((pid_n * BLOCK_N) // SCALE_BN) * stride_wsn
            if GATED:
                up_scale_cols = w_scale_ptr + ((pid_n * BLOCK_N + N) // SCALE_BN) * stride_wsn
        elif blocked:
            # The scale row of each output column (gate and up halves), fixed for the loop.
            w_scale_cols = w_scale_ptr + (w_rows // SCALE_BN) * stride_wsn
            if GATED:
                up_scale_cols = w_scale_ptr + ((w_rows + N) // SCALE_BN) * stride_wsn
        # <<< book: block-scale-columns
        # >>> book: k-loop
        for k in range(k_first, k_last):
            for c in tl.static_range(K_CHUNKS):   # (one chunk: the plain K step)
                chunk = k * K_CHUNKS + c   # this chunk's K offset, in BLOCK_K units
                k_left = K - chunk * BLOCK_K
                if TMA_A:
                    a = a_desc.load([a_desc_row, chunk * BLOCK_K])
                elif EVEN_K:
                    a = tl.load(a_ptrs + c * BLOCK_K)
                else:
                    a = tl.load(a_ptrs + c * BLOCK_K, mask=ks[None, :] < k_left, other=0.0)
                if TMA_W:
                    w = w_desc.load([w_desc_row, chunk * BLOCK_K]).T
                elif EVEN_K:
                    w = tl.load(w_ptrs + c * BLOCK_K)
                else:
                    w = tl.load(w_ptrs + c * BLOCK_K, mask=ks[:, None] < k_left, other=0.0)
                if blocked:
                    if EVEN_K or K_CHUNKS == 1:
                        group = (chunk * BLOCK_K) // SCALE_BK
                    else:
                        # A chunk past K (its values masked to 0) has no scale group:
                        # it takes the last one, a finite scale that exists.
                        group = tl.minimum(chunk * BLOCK_K, K - 1) // SCALE_BK
                    a_scale = tl.load(a_scale_ptr + a_scale_rows + group)
                    w_scale = tl.load(w_scale_cols + group * stride_wsk)
                    product = tile_dot(a, w, None, SWAP_AB, INPUT_PRECISION)
                    acc += product * scale_outer(a_scale, w_scale, SWAP_AB)
                else:
                    acc = tile_dot(a, w, acc, SWAP_AB, INPUT_PRECISION)
                if GATED:
                    if TMA_W:
                        up = w_desc.load([w_desc_row + N, chunk * BLOCK_K]).T
                    elif EVEN_K:
                        up = tl.load(up_ptrs + c * BLOCK_K)
                    else:
                        up = tl.load(up_ptrs + c * BLOCK_K, mask=ks[:, None] < k_left,
                                     other=0.0)
                    if blocked:
                        up_scale = tl.load(up_scale_cols + group * stride_wsk)
                        product = tile_dot(a, up, None, SWAP_AB, INPUT_PRECISION)
                        acc_up += product * scale_outer(a_scale, up_scale, SWAP_AB)
                    else:
                        acc_up = tile_dot(a, up, acc_up, SWAP_AB, INPUT_PRECISION)
            if GATED:
                up_ptrs += STEP
            a_ptrs += STEP
            w_ptrs += STEP
        # <<< book: k-loop
        if SWAP_AB:   # back to [BLOCK_M, BLOCK_N]: one register shuffle per tile, not per K step
            acc = tl.trans(acc)
            if GATED:
                acc_up = tl.trans(acc_up)
        # >>> book: epilogue
        if SCALES == 2:
            a_scale = tl.load(a_scale_ptr + a_scale_rows)[:, None]
            acc = acc * a_scale * tl.load(w_scale_ptr + w_rows)[None, :]
            if GATED:
                acc_up = acc_up * a_scale * tl.load(w_scale_ptr + w_rows + N)[None, :]
        if SCALES == 3:
            scale = tl.load(a_scale_ptr + a_scale_rows)[:, None] * tl.load(w_scale_ptr)
            acc = acc * scale
            if GATED:
                acc_up = acc_up * scale
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        # <<< book: epilogue
        return acc

    @kernel
    def tile_position(tile, num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
        """(M-block, N-tile, K slice) of ``tile``. GROUP_M M-blocks are walked down one N-tile before
        moving right, so that consecutive tiles of one expert reuse the same weight tile from L2."""
        pid = tile // SPLIT_K
        num_n_tiles = tl.cdiv(N, BLOCK_N)
        programs_per_group = GROUP_M * num_n_tiles
        first_m = (pid // programs_per_group) * GROUP_M
        group_rows = min(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % programs_per_group) % group_rows
        pid_n = (pid % programs_per_group) // group_rows
        return pid_m, pid_n, tile % SPLIT_K

    @kernel
    def empty_accumulator(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
        """The fp32 zeros a tile product accumulates into, ``[BLOCK_N, BLOCK_M]`` with ``SWAP_AB``."""
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        return acc

    @kernel
    def tile_dot(a, w, acc, SWAP_AB: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """One K step of the tile product, added to ``acc`` (None: the product alone):
        ``a [BLOCK_M, BLOCK_K] @ w [BLOCK_K, BLOCK_N]``, or its transpose ``w^T @ a^T``
        (``[BLOCK_N, BLOCK_M]``, the weights on the MMA's M side) with ``SWAP_AB``, in fp32."""
        if SWAP_AB:
            out = tl.dot(tl.trans(w), tl.trans(a), acc, input_precision=INPUT_PRECISION)
        else:
            out = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        return out

    @kernel
    def scale_outer(a_scale, w_scale, SWAP_AB: tl.constexpr):
        """The block-scale product of one K step, laid out like :func:`tile_dot`'s result:
        rows' scales times columns' scales, or times the one scale of all columns (a scalar
        ``w_scale``: the rows' scales are multiplied by it first, one multiply per row)."""
        if len(w_scale.shape) == 0:
            scaled = a_scale * w_scale
            if SWAP_AB:
                out = scaled[None, :]
            else:
                out = scaled[:, None]
        elif SWAP_AB:
            out = w_scale[:, None] * a_scale[None, :]
        else:
            out = a_scale[:, None] * w_scale[None, :]
        return out

    # >>> book: routed-weight
    @kernel
    def scale_rows(acc, weights_ptr, assignments, row_real):
        """GEMM 2's epilogue: row ``i`` of ``acc`` times ``weights[assignments[i]]``, in
        fp32."""
        weight = tl.load(weights_ptr + assignments, mask=row_real, other=0.0).to(tl.float32)
        return acc * weight[:, None]
    # <<< book: routed-weight

    @kernel
    def store_tile(out_ptr, out_rows, row_real, acc, pid_n, N, BLOCK_N: tl.constexpr):
        """Write the real rows (``row_real``) and the columns ``< N`` of a tile, cast once."""
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + out_rows[:, None] + cols[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_real[:, None] & (cols[None, :] < N))

    # >>> book: add-tile
    @kernel
    def add_tile(out_ptr, out_rows, row_real, acc, pid_n, N, BLOCK_N: tl.constexpr):
        """``out[out_rows, cols] += acc`` in fp32 for the real rows and the columns ``< N``:
        rows of one token (its k slots, in different blocks) and K slices of one tile meet
        here in any order."""
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + out_rows[:, None] + cols[None, :]
        mask = row_real[:, None] & (cols[None, :] < N)
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    # <<< book: add-tile


def weight_descriptor(w: torch.Tensor, tiles):
    """The tensor descriptor of ``w [E, N', K]`` as one ``[E * N', K]`` matrix in
    ``[block_n, block_k]`` boxes, for ``tiles.tma``; None for pointer loads. ``tma`` is a speed
    setting, so weights the copy engine cannot describe (not contiguous, rows or the base address not
    a multiple of 16 bytes, a box taller than 256 rows) take pointer loads instead: same numbers,
    no error."""
    row_bytes = w.shape[2] * w.element_size()
    if (not tiles.tma or not w.is_contiguous() or row_bytes % 16 or w.data_ptr() % 16 or tiles.block_n > 256
            or w.numel() == 0):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [tiles.block_n, tiles.block_k])


def rows_descriptor(x: torch.Tensor, block_m: int, tiles):
    """The tensor descriptor of activation rows ``x [M, K]`` in ``[block_m, block_k]`` boxes, for
    ``tiles.tma`` where a tile's rows lie one after another (the permute layout's segments); None
    for pointer loads, on the same rule as :func:`weight_descriptor`."""
    row_bytes = x.shape[1] * x.element_size()
    if (not tiles.tma or x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or row_bytes % 16
            or x.data_ptr() % 16 or block_m > 256 or x.numel() == 0):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, tiles.block_k])


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: true fp32 for fp32 inputs (the default would be TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"

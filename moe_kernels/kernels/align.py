"""Alignment: turn ragged per-expert rows into whole tiles (``moe_align_block_size``).

(Over 400 lines, and kept whole: the reference, the kernel body that the routers and the permutation run
too, and its launch are one mechanism.)

After routing, expert ``e`` serves ``c_e`` *assignments* (positions in ``topk_ids.flatten()``;
assignment ``a`` belongs to token ``a // top_k``). A grouped GEMM wants every M-block of
``block_size`` rows to belong to one expert, so the alignment lists the assignments expert by
expert and rounds each expert's list up to a whole number of blocks:

1. count: ``c_e`` for every expert (a histogram of the ids);
2. round: ``p_e = ceil(c_e / block_size) * block_size``;
3. scan: expert ``e``'s segment starts at ``p_0 + ... + p_{e-1}`` (always a block boundary);
4. scatter: write each assignment index into the next free row of its expert's segment; the
   rows left over (fewer than ``block_size`` per expert) hold the sentinel ``numel``, which the
   GEMM masks out, and so does the unused tail of the buffer.

The buffer has ``numel + E*(block_size-1)`` rows, enough for the worst case (every expert
wastes ``block_size - 1`` rows), so its size depends only on the input's shape and nothing has
to be read back to the host. The used length is returned on the device as
``num_tokens_post_padded``; ``expert_ids`` labels each block, ``-1`` past the used region.

The vLLM docstring's example with 0-based ids: four tokens, top-3 of four experts, blocks of 4.
Every expert serves three assignments and gets one padding row (the sentinel 12)::

    >>> import torch
    >>> ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]])
    >>> sorted_ids, expert_ids, used = moe_align_block_size(ids, 4, 4)
    >>> int(used), len(sorted_ids), len(expert_ids)  # 12 + 4*(4-1) rows = 6 blocks
    (16, 24, 6)
    >>> for block, expert in zip(sorted_ids.view(-1, 4).tolist(), expert_ids.tolist()):
    ...     print(expert, block)
    0 [3, 6, 9, 12]
    1 [0, 4, 10, 12]
    2 [1, 7, 11, 12]
    3 [2, 5, 8, 12]
    -1 [12, 12, 12, 12]
    -1 [12, 12, 12, 12]

Inside a segment the assignments come in increasing index order, so the kernel's output equals
:func:`moe_align_block_size_reference` exactly. (vLLM's CUDA op,
``csrc/moe/moe_align_sum_kernels.cu`` in vllm-project/vllm, claims rows with atomics, so its order
inside a segment varies from run to run and its tests compare per expert as sets.)

For tiny batches vLLM skips all this: :mod:`moe_kernels.kernels.blocks` builds the block map either
way and checks its invariants.
"""

from __future__ import annotations

import torch

from .._runtime import HAS_TRITON, cdiv, device_assert_options, kernel, next_power_of_2, note_launch, tl, use_triton
from .._checks import check_ids_in_range, check_int, check_tensor, device_id_check, fail

__all__ = [
    "moe_align_block_size",
    "moe_align_block_size_reference",
]

_ID_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1
_MAX_ASSIGNMENTS = 2**30

# Launch settings. Up to SINGLE_LAUNCH_MAX_NUMEL assignments the whole alignment is one launch:
# every program counts *all* ids itself, so no program waits for another (at these sizes
# re-counting costs less than a second launch, a few microseconds).
# Beyond it the counting is split off into a first launch of per-chunk histograms, and the
# later launches work from that table instead of re-reading every id (CHUNK_OFFSETS below says how).
SINGLE_LAUNCH_MAX_NUMEL = 8192
# At most this many chunks (programs) on the summed path: each scatter program sums the
# [chunks, E] count table, so more chunks means more re-reading of that table.
MAX_CHUNKS = 128
# Assignments ranked together: a program compares every pair in a tile ([TILE, TILE] in registers),
# and the warps per program, for each path. Measured on an H200 (tools/tune_align.py, CUDA-graph
# time, E=256, k=8): one launch with 64-assignment tiles and 8 warps took 6.4/7.5/9.3/13.6 us at
# T = 64/256/512/1024 (128-assignment tiles: 11/15/17/22 us); the two-launch path was fastest with
# 128-assignment tiles and 4 warps (17.6 us at T = 2048).
_SINGLE_TILE, _SINGLE_WARPS = 64, 8
_MULTI_TILE, _MULTI_WARPS = 128, 4
# Beyond LARGE_FROM_NUMEL assignments the summed (two-launch) path ranks 64 assignments at a time on 8 warps: at 131,072
# (16,384 tokens of top-8) that took 76.9 us over 128 experts and 73.6 over 256, against 86.0 and 89.3 with the
# tiles above, which stayed the fastest at 32,768 (an H100, tools/tune_align.py large, align-ab-s35.json).
LARGE_FROM_NUMEL = 65536
_LARGE_TILE, _LARGE_WARPS = 64, 8
# How a program of the multi-launch path learns how many of each expert's assignments come before its chunk.
# "summed": it sums the count table's earlier rows itself (two launches; every program re-reads up to the whole
# table, so the work grows with the square of the chunks, and MAX_CHUNKS stays small: 128 programs for 131,072
# assignments, each placing 1,024 of them one tile after another). "scanned": a launch between the two scans the
# table down each expert's column (an exclusive prefix, in place, plus a totals row), so a program reads one row
# and the chunks can be many and short (up to SCAN_MAX_CHUNKS; three launches). Index order inside a segment is the
# same either way. Measured on an H100 (tools/tune_align.py large, align-ab-s41.json, CUDA-graph time, L2 warm,
# top-8, 128-row blocks), summed -> scanned at 2,048 / 4,096 / 16,384 tokens: 20.4 / 30.0 / 77.2 -> 13.4 / 15.2 /
# 26.7 us over 128 experts, 20.2 / 29.8 / 73.3 -> 14.3 / 16.5 / 30.2 over 256, on up to 512 chunks of
# 32-assignment tiles, 4 warps, padding 8 rows a step (the best of ten scanned settings at 4,096 and 16,384 tokens,
# within 1.7 us of the best at 2,048).
CHUNK_OFFSETS, CHUNK_OFFSET_RULES = "scanned", ("summed", "scanned")
SCAN_MAX_CHUNKS = 512
_SCANNED_TILE, _SCANNED_WARPS = 32, 4
# The padding's rows a step on the scanned path: its [tile, rows] store held most of the registers in the sm_90
# build (a 64-assignment tile on 8 warps: 196 a thread at 64 rows, 80 at 8; a 32-assignment one: 106 and 32).
_SCANNED_MAX_PAD_TILE = 8
# The scan: expert columns per program and table rows per step.
_SCAN_BINS, _SCAN_ROWS = 16, 64
# Ids histogrammed per step while counting.
_COUNT_TILE = 1024
# Sentinel / -1 slots of the tail written per step, and one program's share of it: tiny batches with
# big blocks have a long tail (E*(block_size-1) rows), spread over a few programs.
_FILL_TILE = 1024
_FILL_ROWS_PER_PROGRAM = 8192
# Padding rows written per step by the last assignment of each expert.
_MAX_PAD_TILE = 64
# Rows of the per-chunk count table summed per step.
_ROW_TILE = 16


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------


def moe_align_block_size_reference(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """Torch reference for :func:`moe_align_block_size`.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``:

    * ``sorted_token_ids`` int32 ``[numel + E*(block_size-1)]``: assignment indices (positions in
      ``topk_ids.flatten()``) grouped by expert, each expert's segment padded up to a multiple of
      ``block_size`` with the sentinel ``numel``; trailing unused slots also hold ``numel``.
      Inside a segment, assignments are in increasing index order.
    * ``expert_ids`` int32 ``[ceil(len(sorted_token_ids)/block_size)]``: the expert of each block,
      ``-1`` for blocks past the end of the used region.
    * ``num_tokens_post_padded`` int32 ``[1]``: the used length (sum of padded counts).

    Example (the vLLM docstring's example with 0-based ids)::

        >>> ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]])
        >>> s, e, n = moe_align_block_size_reference(ids, 4, 4)
        >>> s[: int(n)].view(-1, 4)[:, :3].tolist()   # each block's real rows; row 4 is padding (12)
        [[3, 6, 9], [0, 4, 10], [1, 7, 11], [2, 5, 8]]
        >>> e[: int(n) // 4].tolist()
        [0, 1, 2, 3]
    """
    func = "moe_align_block_size"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES)
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "block_size", block_size, lo=1)
    check_ids_in_range(func, "topk_ids", topk_ids, num_experts, on_device=False)
    flat = topk_ids.flatten().to(torch.int64)
    numel = flat.numel()
    device = flat.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    capacity = numel + num_experts * (block_size - 1)
    sorted_ids = torch.full((capacity,), numel, dtype=torch.int32, device=device)
    order = torch.sort(flat, stable=True).indices  # grouped by expert, index order inside
    rank = torch.arange(numel, device=device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    num_blocks = (capacity + block_size - 1) // block_size
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=device),
                                           padded // block_size)
    expert_ids[: block_expert.numel()] = block_expert.to(torch.int32)
    total = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, total


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @kernel
    def _load_experts(topk_ids_ptr, offsets, end, num_experts, CACHE: tl.constexpr):
        """Expert ids at ``offsets`` as int32, and which of them count.

        Ids outside ``[0, num_experts)`` (and offsets past ``end``) are reported invalid and
        replaced by 0, so that no later histogram, gather or store can leave its bounds.
        ``CACHE=".cg"`` reads from L2, past this SM's L1: for ids other SMs have just written (the
        acquire and the CTA barrier before the read already make them visible; ``.cg`` keeps
        the read off L1 as well).
        """
        in_bounds = offsets < end
        raw = tl.load(topk_ids_ptr + offsets, mask=in_bounds, other=-1, cache_modifier=CACHE)
        valid = in_bounds & (raw >= 0) & (raw < num_experts)
        return tl.where(valid, raw, 0).to(tl.int32), valid

    # >>> book: align-count
    @kernel
    def _count_experts(topk_ids_ptr, begin, end, num_experts, NUM_BINS: tl.constexpr,
                       COUNT_TILE: tl.constexpr, CACHE: tl.constexpr):
        """How many of the assignments ``[begin, end)`` each expert serves."""
        counts = tl.zeros([NUM_BINS], dtype=tl.int32)
        for tile_start in range(begin, end, COUNT_TILE):
            offsets = tile_start + tl.arange(0, COUNT_TILE)
            experts, valid = _load_experts(topk_ids_ptr, offsets, end, num_experts, CACHE)
            counts += tl.histogram(experts, NUM_BINS, mask=valid)
        return counts
    # <<< book: align-count

    @kernel(do_not_specialize=["numel", "chunk_size"])
    def _chunk_count_kernel(topk_ids_ptr, chunk_counts_ptr, numel, num_experts, chunk_size,
                            NUM_BINS: tl.constexpr, COUNT_TILE: tl.constexpr):
        """First launch of the multi-launch paths: row ``c`` of the table counts chunk ``c``."""
        chunk = tl.program_id(0)
        begin = chunk * chunk_size
        counts = _count_experts(topk_ids_ptr, begin, tl.minimum(begin + chunk_size, numel),
                                num_experts, NUM_BINS, COUNT_TILE, "")
        tl.store(chunk_counts_ptr + chunk * NUM_BINS + tl.arange(0, NUM_BINS), counts)

    @kernel(do_not_specialize=["num_chunks"])
    def _scan_chunk_counts_kernel(chunk_counts_ptr, num_chunks, NUM_BINS: tl.constexpr, SCAN_BINS: tl.constexpr,
                                  SCAN_ROWS: tl.constexpr):
        """The middle launch of the scanned path: down ``SCAN_BINS`` expert columns of the ``[num_chunks + 1,
        NUM_BINS]`` count table, each chunk's count becomes the count of the chunks before it (an exclusive
        prefix sum, in place), and row ``num_chunks`` gets the totals."""
        bins = tl.program_id(0) * SCAN_BINS + tl.arange(0, SCAN_BINS)
        carry = tl.zeros([SCAN_BINS], dtype=tl.int32)
        for row_start in range(0, num_chunks, SCAN_ROWS):
            rows = row_start + tl.arange(0, SCAN_ROWS)
            cells = chunk_counts_ptr + rows[:, None] * NUM_BINS + bins[None, :]
            inside = rows[:, None] < num_chunks
            counts = tl.load(cells, mask=inside, other=0)
            tl.store(cells, tl.cumsum(counts, axis=0) - counts + carry[None, :], mask=inside)
            carry += tl.sum(counts, axis=0)
        tl.store(chunk_counts_ptr + num_chunks * NUM_BINS + bins, carry)

    @kernel(do_not_specialize=["numel", "chunk_size", "num_rows"])
    def _align_kernel(
        topk_ids_ptr, chunk_counts_ptr, sorted_ids_ptr, expert_ids_ptr, used_ptr,
        numel, num_experts, block_size, chunk_size, m_indices_ptr, src2dst_ptr, num_rows,
        COUNTS_FROM_TABLE: tl.constexpr, NUM_BINS: tl.constexpr, TILE: tl.constexpr,
        COUNT_TILE: tl.constexpr, ROW_TILE: tl.constexpr, PAD_TILE: tl.constexpr,
        FILL_TILE: tl.constexpr, ID_CHECK: tl.constexpr = "", PERMUTE: tl.constexpr = False,
        SCANNED: tl.constexpr = False,
    ):
        """Program ``c`` places the assignments of chunk ``c``, then writes a share of the tail
        (:func:`_align_program`); with ``PERMUTE`` also the permute layout's indices."""
        _align_program(
            tl.program_id(0), tl.num_programs(0), topk_ids_ptr, chunk_counts_ptr, sorted_ids_ptr,
            expert_ids_ptr, used_ptr, numel, num_experts, block_size, chunk_size, COUNTS_FROM_TABLE,
            NUM_BINS, TILE, COUNT_TILE, ROW_TILE, PAD_TILE, FILL_TILE, ID_CHECK, "", True,
            m_indices_ptr, src2dst_ptr, num_rows, PERMUTE, SCANNED)

    @kernel
    def _align_program(
        program, num_programs, topk_ids_ptr, chunk_counts_ptr, sorted_ids_ptr, expert_ids_ptr,
        used_ptr, numel, num_experts, block_size, chunk_size,
        COUNTS_FROM_TABLE: tl.constexpr, NUM_BINS: tl.constexpr, TILE: tl.constexpr,
        COUNT_TILE: tl.constexpr, ROW_TILE: tl.constexpr, PAD_TILE: tl.constexpr,
        FILL_TILE: tl.constexpr, ID_CHECK: tl.constexpr, CACHE: tl.constexpr, FILL_TAIL: tl.constexpr = True,
        m_indices_ptr=None, src2dst_ptr=None, num_rows=0, PERMUTE: tl.constexpr = False,
        SCANNED: tl.constexpr = False,
    ):
        """Program ``program`` of ``num_programs``: place the assignments of chunk ``program``,
        then write a share of the tail (``FILL_TAIL``; off only to time the rest). One program with
        ``chunk_size >= numel`` aligns everything: how another kernel runs the alignment in its last program
        (:mod:`moe_kernels.kernels.gate_routing`, which reads the ids it has just written with
        ``CACHE=".cg"``).

        Each program needs two histograms: ``total`` (all assignments) and ``before`` (the
        assignments of earlier chunks). Then expert ``e``'s next free row for this chunk is
        ``segment_start[e] + before[e]``, and no two programs ever write the same row. It counts them
        itself from the ids, or sums the earlier rows of the count table (``COUNTS_FROM_TABLE``), or reads
        them from the scanned table (``SCANNED`` too: row ``program`` and the totals row).

        ``ID_CHECK`` (a message; compiled in only when the launch asks for device asserts): every
        id is read here once, so this is where an id outside ``[0, E)`` stops the kernel, with no
        extra launch and no host synchronisation.

        ``PERMUTE``: also the permute layout's indices (:func:`~moe_kernels.kernels.permute.permute`), from
        the rows placed here, with no second launch: ``m_indices`` (each of the first ``num_rows`` rows'
        expert, -1 on padding) and ``src2dst`` (each assignment's row, -1 for an id out of range).
        """
        capacity = numel + num_experts * (block_size - 1)
        num_blocks = tl.cdiv(capacity, block_size)
        num_chunks = tl.cdiv(numel, chunk_size)
        bins = tl.arange(0, NUM_BINS)
        # A program past the last chunk (the tail's share) places nothing: its range starts at the end, and its
        # start is never program * chunk_size, which could pass int32 on a large grid.
        chunk_start = tl.minimum(program, num_chunks) * chunk_size
        chunk_end = tl.minimum(chunk_start + chunk_size, numel)

        if COUNTS_FROM_TABLE and SCANNED:
            # (a program past the last chunk places nothing: it reads the totals row twice)
            before = tl.load(chunk_counts_ptr + tl.minimum(program, num_chunks) * NUM_BINS + bins)
            total = tl.load(chunk_counts_ptr + num_chunks * NUM_BINS + bins)
        elif COUNTS_FROM_TABLE:
            before = tl.zeros([NUM_BINS], dtype=tl.int32)
            total = tl.zeros([NUM_BINS], dtype=tl.int32)
            for row_start in range(0, num_chunks, ROW_TILE):
                rows = row_start + tl.arange(0, ROW_TILE)
                table = tl.load(chunk_counts_ptr + rows[:, None] * NUM_BINS + bins[None, :],
                                mask=rows[:, None] < num_chunks, other=0)
                total += tl.sum(table, axis=0)
                before += tl.sum(tl.where(rows[:, None] < program, table, 0), axis=0)
        else:
            split = tl.minimum(chunk_start, numel)
            before = _count_experts(topk_ids_ptr, 0, split, num_experts, NUM_BINS, COUNT_TILE,
                                    CACHE)
            total = before + _count_experts(topk_ids_ptr, split, numel, num_experts,
                                            NUM_BINS, COUNT_TILE, CACHE)

        # >>> book: align-round-scan-scatter
        padded = (total + block_size - 1) // block_size * block_size
        segment_start = tl.cumsum(padded, axis=0) - padded
        real_end = segment_start + total  # first padding row of each segment
        used = tl.sum(padded, axis=0)
        if program == 0:
            tl.store(used_ptr, used)

        next_free = segment_start + before
        lanes = tl.arange(0, TILE)
        for tile_start in range(chunk_start, chunk_end, TILE):
            offsets = tile_start + lanes
            experts, valid = _load_experts(topk_ids_ptr, offsets, chunk_end, num_experts, CACHE)
            if ID_CHECK != "":
                tl.device_assert(valid | (offsets >= chunk_end), ID_CHECK)
            # Rank inside the tile = earlier lanes with the same expert: keeps index order.
            same_earlier = ((experts[:, None] == experts[None, :]) & valid[None, :]
                            & (lanes[None, :] < lanes[:, None]))
            rank = tl.sum(same_earlier.to(tl.int32), axis=1)
            row = tl.gather(next_free, experts, 0) + rank
            tl.store(sorted_ids_ptr + row, offsets.to(tl.int32), mask=valid)
            # A segment's first row is always real, so whoever lands on a block's first row
            # labels the block.
            tl.store(expert_ids_ptr + row // block_size, experts,
                     mask=valid & (row % block_size == 0))
            # <<< book: align-round-scan-scatter
            if PERMUTE:
                tl.store(m_indices_ptr + row, experts, mask=valid)
                tl.store(src2dst_ptr + offsets, tl.where(valid, row, -1), mask=offsets < chunk_end)
            pad_segment_ends(sorted_ids_ptr, experts, valid, row, real_end, numel, block_size, PAD_TILE,
                             m_indices_ptr, PERMUTE)
            next_free += tl.histogram(experts, NUM_BINS, mask=valid)
        if FILL_TAIL:
            fill_tail(sorted_ids_ptr, expert_ids_ptr, used, capacity, num_blocks, numel, block_size, program,
                      num_programs, FILL_TILE, m_indices_ptr, num_rows, PERMUTE)

    @kernel
    def pad_segment_ends(sorted_ids_ptr, experts, valid, row, real_end, numel, block_size, PAD_TILE: tl.constexpr,
                         m_indices_ptr=None, PERMUTE: tl.constexpr = False):
        """Each expert's last real row (``row + 1 == real_end``) pads its segment to the block with ``numel``
        (and, with ``PERMUTE``, marks the padding rows -1 in ``m_indices``)."""
        end = tl.gather(real_end, experts, 0)
        pad_rows = end[:, None] + tl.arange(0, PAD_TILE)[None, :]
        for pad_start in range(0, block_size - 1, PAD_TILE):
            pad = (valid & (row + 1 == end))[:, None] & (
                pad_rows + pad_start < ((end + block_size - 1) // block_size * block_size)[:, None])
            tl.store(sorted_ids_ptr + pad_rows + pad_start, numel, mask=pad)
            if PERMUTE:
                tl.store(m_indices_ptr + pad_rows + pad_start, -1, mask=pad)

    @kernel
    def fill_tail(sorted_ids_ptr, expert_ids_ptr, used, capacity, num_blocks, numel, block_size, program,
                  num_programs, FILL_TILE: tl.constexpr, m_indices_ptr=None, num_rows=0,
                  PERMUTE: tl.constexpr = False):
        """The rows past ``used`` (``numel``) and their blocks (-1), round-robin over ``num_programs`` (with
        ``PERMUTE``, also ``m_indices`` -1 from ``used`` to its ``num_rows``)."""
        lanes, stride = tl.arange(0, FILL_TILE), num_programs * FILL_TILE
        for start in range(used + program * FILL_TILE, capacity, stride):
            tl.store(sorted_ids_ptr + start + lanes, numel, mask=start + lanes < capacity)
            if PERMUTE:
                tl.store(m_indices_ptr + start + lanes, -1, mask=start + lanes < num_rows)
        for start in range(used // block_size + program * FILL_TILE, num_blocks, stride):
            tl.store(expert_ids_ptr + start + lanes, -1, mask=start + lanes < num_blocks)


def align_bins_and_pad_tile(num_experts: int, block_size: int) -> tuple[int, int]:
    """The alignment's histogram bins (a power of two >= 32) and its padding store's width, for any
    kernel that runs the alignment's body (this module's, or the router's last program)."""
    return max(32, next_power_of_2(num_experts)), min(next_power_of_2(max(block_size - 1, 1)), _MAX_PAD_TILE)


def empty_alignment(numel: int, block_size: int, num_experts: int, device: torch.device):
    """The alignment's three int32 output buffers, unfilled: ``numel + E*(block_size-1)`` rows,
    a label per block of them, and the used length."""
    capacity = numel + num_experts * (block_size - 1)
    return (torch.empty(capacity, dtype=torch.int32, device=device),
            torch.empty(-(-capacity // block_size), dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def _launch_alignment(topk_ids, block_size, num_experts, sorted_ids, expert_ids, used, id_check: str = "",
                      permute_indices=None):
    """Run the Triton alignment of contiguous ``topk_ids`` into preallocated int32 buffers
    (``id_check``: the message of the device-side id assert, or "" for none; ``permute_indices``: the
    permute layout's ``(m_indices, src2dst)`` buffers, filled by the same launch)."""
    numel = topk_ids.numel()
    if permute_indices is not None and numel > SINGLE_LAUNCH_MAX_NUMEL and CHUNK_OFFSETS != "scanned":
        # (the summed path's build spills: permute's docstring)
        fail("_launch_alignment", "permute_indices", f"is for at most {SINGLE_LAUNCH_MAX_NUMEL} assignments "
             "unless CHUNK_OFFSETS is 'scanned'", f"{numel} assignments")
    num_bins, pad_tile = align_bins_and_pad_tile(num_experts, block_size)
    fill_programs = cdiv(sorted_ids.numel(), _FILL_ROWS_PER_PROGRAM)
    offsets_rule = None   # (one launch: every program counts the ids itself)
    if numel <= SINGLE_LAUNCH_MAX_NUMEL:
        tile, warps = _SINGLE_TILE, _SINGLE_WARPS
        chunk_size = tile
        num_chunks = cdiv(numel, chunk_size)
        chunk_counts = topk_ids  # never read: every program counts the ids itself
    else:
        if CHUNK_OFFSETS not in CHUNK_OFFSET_RULES:
            fail("moe_kernels.kernels.align", "CHUNK_OFFSETS", f"must be one of {CHUNK_OFFSET_RULES}",
                 repr(CHUNK_OFFSETS))
        offsets_rule = CHUNK_OFFSETS
        scanned = offsets_rule == "scanned"
        if scanned:
            tile, warps, pad_tile = _SCANNED_TILE, _SCANNED_WARPS, min(pad_tile, _SCANNED_MAX_PAD_TILE)
        else:
            tile, warps = (_LARGE_TILE, _LARGE_WARPS) if numel > LARGE_FROM_NUMEL else (_MULTI_TILE, _MULTI_WARPS)
        chunk_size = tile * cdiv(numel, tile * (SCAN_MAX_CHUNKS if scanned else MAX_CHUNKS))
        num_chunks = cdiv(numel, chunk_size)
        # (the scanned table has one more row: the totals)
        chunk_counts = torch.empty((num_chunks + scanned) * num_bins, dtype=torch.int32, device=topk_ids.device)
        _chunk_count_kernel[(num_chunks,)](
            topk_ids, chunk_counts, numel, num_experts, chunk_size,
            NUM_BINS=num_bins, COUNT_TILE=min(_COUNT_TILE, next_power_of_2(chunk_size)) if scanned else _COUNT_TILE,
            num_warps=warps)
        if scanned:
            scan_bins = min(_SCAN_BINS, num_bins)
            _scan_chunk_counts_kernel[(num_bins // scan_bins,)](
                chunk_counts, num_chunks, NUM_BINS=num_bins, SCAN_BINS=scan_bins, SCAN_ROWS=_SCAN_ROWS, num_warps=4)
    launches = {None: 1, "summed": 2, "scanned": 3}[offsets_rule]
    note_launch("align.moe_align_block_size", block_size=block_size, launches=launches, chunk_offsets=offsets_rule,
                chunks=num_chunks, id_check=bool(id_check), permute_indices=permute_indices is not None, tile=tile,
                warps=warps)
    m_indices, src2dst = permute_indices if permute_indices is not None else (sorted_ids, sorted_ids)
    _align_kernel[(max(num_chunks, fill_programs, 1),)](
        topk_ids, chunk_counts, sorted_ids, expert_ids, used,
        numel, num_experts, block_size, chunk_size, m_indices, src2dst, m_indices.numel(),
        COUNTS_FROM_TABLE=numel > SINGLE_LAUNCH_MAX_NUMEL, NUM_BINS=num_bins, TILE=tile,
        COUNT_TILE=_COUNT_TILE, ROW_TILE=_ROW_TILE, PAD_TILE=pad_tile, FILL_TILE=_FILL_TILE,
        ID_CHECK=id_check, PERMUTE=permute_indices is not None, SCANNED=offsets_rule == "scanned", num_warps=warps,
        **device_assert_options(id_check))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def alignment_buffer_sizes(func: str, topk_ids, block_size, num_experts) -> tuple[int, int]:
    """Check the arguments; return (rows, blocks) of the output buffers."""
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES)
    check_int(func, "block_size", block_size, lo=1)
    check_int(func, "num_experts", num_experts, lo=1)
    if topk_ids.numel() > _MAX_ASSIGNMENTS:   # (a chunk's end, numel + a chunk, stays an int32 in the kernel)
        fail(func, "topk_ids", "must hold at most 2**30 assignments (int32 chunk arithmetic)",
             f"{topk_ids.numel()} assignments")
    capacity = topk_ids.numel() + num_experts * (block_size - 1)
    # Rows are int32 in the kernel and the tail is written FILL_TILE rows at a time.
    max_rows = _INT32_MAX - _FILL_TILE
    if capacity > max_rows:
        fail(func, "topk_ids", f"must give numel + num_experts*(block_size-1) <= {max_rows} "
             "(int32 row indices)", f"{capacity} rows")
    return capacity, -(-capacity // block_size)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int, *,
                         validate_ids: bool = True):
    """Group the assignments of ``topk_ids`` by expert, each expert padded to whole blocks.

    Arguments as in vLLM: ``topk_ids`` int32 or int64 ``[T, k]`` (0-based expert ids; a
    non-contiguous tensor is copied), ``block_size`` any integer >= 1 (the GEMM's M tile; no
    power of two needed), ``num_experts`` >= 1. Returns ``(sorted_token_ids, expert_ids,
    num_tokens_post_padded)`` exactly as :func:`moe_align_block_size_reference` does, element
    for element (assignments in increasing index order inside a segment).

    The Triton path is one launch up to ``SINGLE_LAUNCH_MAX_NUMEL`` assignments and three beyond (count per
    chunk, scan, place; two on the summed rule, ``CHUNK_OFFSETS``), for at most 2**30 assignments. It never
    synchronises with the host (all sizes follow from the shapes), so on the GPU the call can be captured in a
    CUDA graph.

    ``validate_ids``: check that every id lies in ``[0, num_experts)`` (the default: a bad id
    must never silently drop a token): a ValueError on the CPU; on a GPU a device-side assert in
    the alignment kernel itself, which reads every id anyway, so the check costs no launch and no
    host sync and can be captured. Unchecked ids outside the range are skipped by the kernel
    (never written out of bounds), so their assignments would appear in no segment.
    """
    func = "moe_align_block_size"
    alignment_buffer_sizes(func, topk_ids, block_size, num_experts)
    return align_checked(func, topk_ids, block_size, num_experts, validate_ids)


def align_checked(func: str, topk_ids: torch.Tensor, block_size: int, num_experts: int, validate_ids: bool,
                  permute_indices=None):
    """:func:`moe_align_block_size` after its argument checks, the id check done where it is
    cheapest: on the host on the CPU, inside the kernel on a GPU (blaming ``func``). ``permute_indices``
    (Triton path, at most ``SINGLE_LAUNCH_MAX_NUMEL`` assignments, or any number on the scanned path):
    ``(m_indices, src2dst)`` int32 buffers that the same launch fills (``_align_program``)."""
    id_check = ""
    if validate_ids:
        id_check = device_id_check(func, "topk_ids", topk_ids, num_experts)
    if not use_triton(topk_ids):
        if permute_indices is not None:   # (the reference writes no such buffers: permute fills its own)
            fail(func, "permute_indices", "is for the Triton alignment only", "a torch reference call")
        return moe_align_block_size_reference(topk_ids, block_size, num_experts)
    sorted_ids, expert_ids, used = empty_alignment(topk_ids.numel(), block_size, num_experts, topk_ids.device)
    _launch_alignment(topk_ids.contiguous(), block_size, num_experts, sorted_ids, expert_ids, used, id_check,
                      permute_indices)
    return sorted_ids, expert_ids, used

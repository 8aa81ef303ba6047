"""What the tuner tries: M tiles, N/K tiles, warps, stages and the optional machinery, per
batch; and how it picks among them (a variant with more machinery must win by a margin).

Plain Python, no GPU: :mod:`moe_kernels.bench.tune` times these candidates.

    >>> block_m_candidates(0.06), block_m_candidates(32)
    ([16], [16, 32, 64])
    >>> fits(16, 128, 128, 4, True, None), fits(16, 128, 128, 3, True, None)   # GEMM 1, bf16: 2 weight tiles
    (False, True)
"""

from __future__ import annotations

import dataclasses

from ..kernels.config import GemmTiles
from ..kernels.formats import UNQUANTIZED

_SHARED_MEMORY_BYTES = 220 * 1024  # an H100/H200 SM offers 227 KiB to one block; keep a margin


def block_m_candidates(rows_per_expert: float) -> list[int]:
    """M tiles worth trying when each expert gets ``rows_per_expert`` rows on average (where the
    GEMM computes, a smaller tile than the rows also pays: it wastes less on the partial block)."""
    low = rows_per_expert / (4 if rows_per_expert >= 128 else 2)
    picks = [b for b in (16, 32, 64, 128) if low <= b <= 2 * rows_per_expert]
    return picks or [16 if rows_per_expert < 16 else 128]


def tile_candidates(rows_per_expert: float, block_m: int, gated: bool, fmt=None) -> list:
    """N/K tiles, warps and stages to try (for weights of format ``fmt``, default 16-bit).

    Where the GEMM streams weights (few rows per expert) a program's speed is bounded by what one
    SM can pull (~30 GB/s measured), so the candidates spread the weights over many programs
    (narrow N tiles) with long K tiles and deep pipelines; where it computes, wide tiles and
    more warps."""
    streaming = [(n, k, 1, 4, s) for n in (16, 32, 64, 128, 256) for k in (128, 256) for s in (3, 4, 5)]
    # Wide tiles on two stages: fewer stages, more programs per SM, whose streams can cover each
    # other's start and end. A GEMM 2 has short K loops (Qwen3-30B-A3B's: 6 steps of 128), so each
    # program's start and end are a large share of its time. In bf16 (Triton 3.6, sm_90, 16-row M
    # tile): transposed 128 x 128 tiles take 108 KiB on three stages (two programs per SM), 72 KiB on
    # two (three); untransposed 256 x 128 ones (mma.sync, one buffer fewer) 136 and 68 KiB (one and
    # three). Transposed 256 x 128 tiles stay at one program either way (204, 136 KiB).
    streaming += [(n, 128, 1, 4, 2) for n in (128, 256)]
    balanced = [(n, k, 8, w, s) for n in (64, 128) for k in (64, 128) for w in (4, 8) for s in (3, 4)]
    computing = [(n, 64, 8, w, s) for n in (64, 128, 256) for w in (4, 8) for s in (3, 4)]
    if rows_per_expert < 16:
        grid = streaming
    elif rows_per_expert < 128:
        grid = [(n, k, 8, w, s) for n, k, _, w, s in streaming if n >= 32 and s <= 4] + balanced
    else:
        grid = balanced + computing
    fmt = fmt or UNQUANTIZED
    if fmt.quantized:   # fp8: 8 warps too (4-warp block-fp8 tiles were seen to lose 2x), K steps <= 128
        grid = grid + [(n, k, g, 8, s) for n, k, g, w, s in grid if w == 4]
    out = []
    for n, k, group, warps, stages in dict.fromkeys(grid):
        k = fmt.gemm_tiles(GemmTiles(n, k)).block_k   # the K step the kernel will run
        if gated and n > 128:
            continue  # two accumulators of BLOCK_M x 256 do not fit in registers
        if not fits(block_m, n, k, stages, gated, fmt):
            continue
        # A 16- or 32-row M tile compiles to mma.sync; with 64+ weight rows per tile the transposed
        # product (swap_ab) puts them on the MMA's M side, where Hopper's wgmma can take them.
        swaps = (False, True) if block_m <= 32 and n >= 64 else (False,)
        for tma in (False, True):   # weight tiles by pointer loads or by the copy engine (TMA)
            # Where the GEMM computes, also a persistent grid (1) and its flattened pipeline (2).
            for persistent in (0, 1, 2) if rows_per_expert >= 128 else (0,):
                for swap_ab in swaps:
                    out.append(GemmTiles(n, k, group, warps, stages, tma=tma, persistent=persistent, swap_ab=swap_ab))
    return list(dict.fromkeys(out))   # fp8's K clamp makes some candidates equal


def down_variants(rows_per_expert: float) -> list[tuple[bool, int]]:
    """GEMM 2 finishes in one of two ways: ``(False, 1)`` writes ``[T, k, d]`` for the top-k sum
    kernel; ``(True, s)`` adds into ``[T, d]`` fp32 in its epilogue, over ``s`` K slices. Split-K
    only pays where the programs are too few to keep every SM streaming (few rows per expert)."""
    splits = (1, 2, 4) if rows_per_expert < 16 else (1, 2) if rows_per_expert < 64 else (1,)
    return [(False, 1)] + [(True, s) for s in splits]


def gate_up_splits(rows_per_expert: float) -> tuple[int, ...]:
    """K splits ``--refine`` tries on GEMM 1 (besides 1): at decode a GEMM 1 of few rows has too
    few tiles to keep every SM streaming (Qwen3-30B-A3B at batch 1: 96 programs for 132 SMs), and
    a split adds programs without re-reading weights; the price is an fp32 buffer, its zeroing and
    a SiLU·mul launch (moe_kernels.kernels.activation)."""
    return (2, 4) if rows_per_expert < 16 else (2,) if rows_per_expert < 64 else ()


#: A candidate that adds machinery (the top-k sum by atomics, split-K, TMA, a persistent grid, the
#: transposed product) must beat the best plain one by more than this fraction, about the run-to-run
#: spread of one timing, to be chosen: otherwise the deterministic pointer-load kernel wins.
MACHINERY_MARGIN = 0.03


def plain_tiles(tiles) -> bool:
    """No split-K, no TMA, one program per tile, not transposed: the kernel without any of the
    optional machinery."""
    return tiles.split_k == 1 and not tiles.tma and not tiles.persistent and not tiles.swap_ab


def plainest_best(times: dict, is_plain) -> object:
    """The fastest key of ``times`` (key -> ms), unless a key for which ``is_plain(key)`` holds is
    within :data:`MACHINERY_MARGIN` of it; then the fastest such key.

        >>> from moe_kernels.kernels.config import GemmTiles
        >>> plain, tma = GemmTiles(64, 128), GemmTiles(64, 128, tma=True)
        >>> plainest_best({plain: 1.00, tma: 0.99}, plain_tiles) is plain
        True
        >>> plainest_best({plain: 1.00, tma: 0.90}, plain_tiles) is tma
        True
    """
    best = min(times, key=times.get)
    plain_keys = [k for k in times if is_plain(k)]
    if plain_keys:
        best_plain = min(plain_keys, key=times.get)
        if times[best_plain] <= times[best] * (1 + MACHINERY_MARGIN):
            return best_plain
    return best


def candidates(rho: float, block_m: int, gemm: str | None = None, base=None, fmt=None, dense: bool = False):
    """``(gated, sum_in_gemm, tiles)`` to try for GEMM 1 (``gemm="gate_up"``), GEMM 2 (``"down"``)
    or both (None) at ``rho`` rows per expert and M tile ``block_m``, for weights of format
    ``fmt``. With ``base`` (a :class:`~moe_kernels.kernels.config.MoEConfig`, ``--refine``): its
    own tiles, each with and without TMA and in the three grids, and for a 16- or 32-row M tile
    the same tiles transposed (``swap_ab``) onto 64- and 128-row weight tiles, and nothing else.

    ``dense``: one expert that every token uses (a shared expert, ``bench tune --shared``). Its
    GEMM 2 writes each row once, with no top-k sum, so it is tried unsplit and without the sum in
    its epilogue (as the layer runs it); its GEMM 1 has one M block at decode, so few programs, and
    the plain tiles are tried split over K too.

        >>> gate_up = list(candidates(1, 16, "gate_up", dense=True))
        >>> sorted({t.split_k for _, _, t in gate_up}), {(s, t.split_k) for _, s, t in candidates(1, 16, "down", dense=True)}
        ([1, 2, 4], {(False, 1)})
    """
    if dense and base is None:
        if gemm in (None, "gate_up"):
            tiles = tile_candidates(rho, block_m, True, fmt)
            yield from ((True, False, t) for t in tiles)
            for split in gate_up_splits(rho):
                yield from ((True, False, dataclasses.replace(t, split_k=split)) for t in tiles if plain_tiles(t))
        if gemm in (None, "down"):
            yield from ((False, False, t) for t in tile_candidates(rho, block_m, False, fmt))
        return
    if base is not None:
        for tiles, gated in ((base.gate_up, True), (base.down, False)):
            if gemm not in (None, "gate_up" if gated else "down"):
                continue
            if gated:   # (unsplit first: a split the tables hold must still beat the plain kernel)
                tiles = dataclasses.replace(tiles, split_k=1)
            for variant in dict.fromkeys(_refinements(tiles, block_m, gated, fmt)):
                yield gated, False if gated else base.sum_in_gemm, variant
            if gated:   # GEMM 1 split over K (its SiLU·mul then a launch of its own)
                for split in gate_up_splits(rho):
                    yield True, False, dataclasses.replace(tiles, split_k=split)
        return
    if gemm in (None, "gate_up"):
        yield from ((True, False, t) for t in tile_candidates(rho, block_m, True, fmt))
    if gemm in (None, "down"):
        for t in tile_candidates(rho, block_m, False, fmt):
            for sum_in_gemm, split in down_variants(rho):
                yield False, sum_in_gemm, dataclasses.replace(t, split_k=split)


def _refinements(tiles, block_m: int, gated: bool, fmt=None):
    """``--refine``'s variants of one GEMM's tiles: TMA on and off on each grid; for a 16- or
    32-row M tile also transposed (A/B of the transposed product: its N tile becomes the MMA's M,
    so it needs 64 or more rows to reach wgmma), on 64- and 128-row weight tiles (or the tiles'
    own, if wider), with as many pipeline stages as still fit in shared memory, on each grid too
    (a persistent program's next tile starts loading under this one's epilogue, where a decode
    tile's K loop is short: DeepSeek-V3's fp8 GEMM 2 at 512 tokens runs 16 steps a tile); for fp8 weights,
    the tiles with two chunks a K step too."""
    # (split-K keeps the two loops of a persistent program nested: its 2 would time 1's code again)
    grids = (0, 1, 2) if tiles.split_k == 1 else (0, 1)
    for persistent in grids:
        for tma in (False, True):
            yield dataclasses.replace(tiles, tma=tma, persistent=persistent, swap_ab=False)
    if block_m <= 32:
        for block_n in sorted({max(64, tiles.block_n), 128}):
            stages = tiles.num_stages
            while stages > 2 and not fits(block_m, block_n, tiles.block_k, stages, gated, fmt, tiles.k_chunks):
                stages -= 1
            if not fits(block_m, block_n, tiles.block_k, stages, gated, fmt, tiles.k_chunks):
                continue
            for persistent in grids:
                for tma in (False, True):
                    yield dataclasses.replace(tiles, block_n=block_n, num_stages=stages, tma=tma,
                                              persistent=persistent, swap_ab=True)
    if fmt is not None and fmt.quantized and tiles.k_chunks == 1 and tiles.block_k >= 128:
        # Two scale blocks a K step (256 bytes of each row requested together: GemmTiles.k_chunks), on the tiles
        # as they are and transposed, one program a tile, as many stages as fit.
        shapes = [(tiles.block_n, tiles.swap_ab)]
        if block_m <= 32 and not tiles.swap_ab:
            shapes.append((max(64, tiles.block_n), True))
        for block_n, swap_ab in shapes:
            stages = tiles.num_stages
            while stages > 2 and not fits(block_m, block_n, tiles.block_k, stages, gated, fmt, 2):
                stages -= 1
            if fits(block_m, block_n, tiles.block_k, stages, gated, fmt, 2):
                for tma in (False, True):
                    yield dataclasses.replace(tiles, block_n=block_n, num_stages=stages, tma=tma, persistent=0,
                                              swap_ab=swap_ab, k_chunks=2)


def fits(block_m: int, block_n: int, block_k: int, stages: int, gated: bool, fmt, k_chunks: int = 1) -> bool:
    """Whether the pipeline's tiles fit in an SM's shared memory (GEMM 1 loads two weight tiles
    per K step; fp8 elements are one byte, with the K step the kernel runs, ``k_chunks`` chunks of it)."""
    quantized = fmt is not None and fmt.quantized
    if quantized:
        block_k = min(block_k, fmt.block[1] if fmt.block else 128)
    element_bytes = 1 if quantized else 2
    weight_rows = (2 if gated else 1) * block_n
    return stages * (block_m + weight_rows) * block_k * k_chunks * element_bytes <= _SHARED_MEMORY_BYTES


def short(t) -> str:
    return (f"n{t.block_n} k{t.block_k}{'x%d' % t.k_chunks if t.k_chunks > 1 else ''} g{t.group_m} "
            f"w{t.num_warps} s{t.num_stages}"
            + (f" split{t.split_k}" if t.split_k > 1 else "") + (" tma" if t.tma else "")
            + (f" persistent{t.persistent}" if t.persistent else "") + (" swap" if t.swap_ab else ""))

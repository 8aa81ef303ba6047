"""The contiguous (permute) layout against the float64 direct reference, plus its pieces.

Runs on ``default_device()``: the Triton interpreter on a CPU machine, the compiled kernels on a
GPU (where the bf16 cases also run). Shapes are small because the interpreter is slow.
"""

import dataclasses
import itertools
import re

import pytest
import torch

from moe_kernels.bench.baselines import torch_grouped_mm_experts
from moe_kernels.kernels import permute as permute_module
from moe_kernels.kernels.combine import unpermute, unpermute_reference
from moe_kernels.kernels.config import GemmTiles, MoEConfig, default_config
from moe_kernels.model.buffers import max_padded_rows, permute_copy_bytes
from moe_kernels._runtime import HAS_TRITON
from moe_kernels.kernels._tile_gemm import programs_per_device
from moe_kernels.kernels.permute import (
    grouped_gemm_contiguous,
    permute,
    permute_experts,
    permute_reference,
)
from moe_kernels.reference import moe_reference, silu_and_mul_reference
from moe_testing import (
    DEVICE,
    EDGE_SHAPES,
    ON_GPU,
    SMALL_TILES,
    TOLERANCE,
    assert_device_assert,
    assert_each_raises,
    gpu_sized_bf16_problem,
    make_problem,
    needs_gpu,
    random_shape,
    rel_err,
    skewed_problems,
)


# ------------------------------------------------------------------------------------------
# end to end against the float64 reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_permute_experts_random(seed):
    shape, rng = random_shape(seed, [torch.float32, torch.float16])
    align = rng.choice([16, 32, 128])
    config = rng.choice([None, SMALL_TILES])
    x, w1, w2, weights, ids = make_problem(**shape, seed=seed)
    out = permute_experts(x, w1, w2, weights, ids, align=align, config=config)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[x.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(EDGE_SHAPES))
def test_permute_experts_edge_cases(case, dtype):
    x, w1, w2, weights, ids = make_problem(**EDGE_SHAPES[case], hidden=24, inter=16, dtype=dtype,
                                           seed=7)
    out = permute_experts(x, w1, w2, weights, ids, align=16, config=SMALL_TILES)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[dtype]


def test_expert_with_no_tokens_and_all_tokens_on_one_expert():
    for x, w1, w2, weights, ids in skewed_problems():
        out = permute_experts(x, w1, w2, weights, ids, align=16)
        assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-5
    assert permute(x, ids, 4, align=16).segment_counts.tolist() == [0, 0, 7, 0]


def test_permute_experts_bf16_on_this_machine():
    """bf16 on the interpreter takes the documented float32 detour around tl.dot."""
    x, w1, w2, weights, ids = make_problem(6, 4, 2, 24, 16, torch.bfloat16, seed=11)
    out = permute_experts(x, w1, w2, weights, ids, align=16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-2


PERMUTE_VARIANTS = [(True, False), (False, True), (True, True)]   # (tma, swap_ab)
PERSISTENT_VARIANTS = [(True, False, 1), (True, True, 2), (False, False, 1)]   # (tma, swap_ab, persistent)
SUMMED_VARIANTS = [(True, False, 0, 1, True), (True, True, 1, 2, True)]   # (..., split_k, sum_in_gemm)


def permute_variant(tma: bool, swap_ab: bool, persistent: int = 0, split_k: int = 1, sum_in_gemm: bool = False,
                    block_m: int = 16, block_n: int = 64, block_k: int = 32) -> MoEConfig:
    tiles = GemmTiles(block_n, block_k, tma=tma, swap_ab=swap_ab, persistent=persistent)
    return MoEConfig(block_m, tiles, dataclasses.replace(tiles, split_k=split_k), sum_in_gemm=sum_in_gemm)


def edge_problems(case: str, inter: int) -> list:
    """The problems of one edge case: EDGE_SHAPES, no tokens, or the skewed routings."""
    if case == "no tokens":
        return [make_problem(0, 4, 2, 24, 16, seed=3)]
    if case == "skewed":
        return list(skewed_problems())
    return [make_problem(**EDGE_SHAPES[case], hidden=24, inter=inter, seed=7)]


@pytest.mark.parametrize("persistent", [1, 2])
@pytest.mark.parametrize("case", sorted(EDGE_SHAPES) + ["no tokens", "skewed"])
def test_persistent_permute_walks_only_the_used_tiles(case, persistent):
    """One program per SM (four under the interpreter) walking the tiles of the rows the segments
    use, read from the device (PermutedRows.rows_used): same result as the reference on every edge
    case, segments of several 16-row tiles included (align 32), and the launch says so."""
    from moe_kernels._runtime import record_launches

    problems = edge_problems(case, inter=16)
    tiles = GemmTiles(16, 16, group_m=2, persistent=persistent)
    for x, w1, w2, weights, ids in problems:
        with record_launches() as launches:
            out = permute_experts(x, w1, w2, weights, ids, align=32, config=MoEConfig(16, tiles, tiles))
        assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-5
        gemms = [settings for name, settings in launches if name == "permute.gemm"]
        programs = programs_per_device(x.device)   # (one per SM; four under the interpreter)
        assert all(len(g["grid"]) == 1 and g["grid"][0] <= programs and g["tiles"].persistent == persistent
                   for g in gemms), gemms


def test_persistent_permute_without_rows_used_visits_every_tile():
    """grouped_gemm_contiguous called alone, without rows_used, still computes every segment; a
    rows_used of the wrong shape is refused by name."""
    x, w1, _, _, ids = make_problem(11, 3, 2, 24, 16, seed=5)
    p = permute(x, ids, 3, align=16)
    config = MoEConfig(16, GemmTiles(16, 16, persistent=1), GemmTiles(16, 16, persistent=1))
    alone = grouped_gemm_contiguous(p.rows, w1, p.m_indices, align=16, silu_mul=True, config=config)
    used = grouped_gemm_contiguous(p.rows, w1, p.m_indices, align=16, silu_mul=True, config=config,
                                   rows_used=p.rows_used)
    real = p.m_indices >= 0
    assert torch.equal(alone[real], used[real])
    with pytest.raises(ValueError, match="rows_used"):
        grouped_gemm_contiguous(p.rows, w1, p.m_indices, align=16, silu_mul=True, config=config,
                                rows_used=p.rows_used.repeat(2))


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("persistent", [0, 1])
@pytest.mark.parametrize("case", sorted(EDGE_SHAPES) + ["no tokens", "skewed"])
def test_permute_sums_the_slots_in_gemm_2(case, persistent, split_k):
    """config.sum_in_gemm on the permute layout: GEMM 2 adds each row, times its routing weight,
    into its token (K split in two too); no unpermute pass is launched."""
    from moe_kernels._runtime import record_launches

    problems = edge_problems(case, inter=32)
    tiles = GemmTiles(16, 16, group_m=4, persistent=persistent)   # (partial groups of M-blocks too)
    config = MoEConfig(16, tiles, dataclasses.replace(tiles, split_k=split_k), sum_in_gemm=True)
    for x, w1, w2, weights, ids in problems:
        with record_launches() as launches:
            out = permute_experts(x, w1, w2, weights, ids, align=16, config=config)
        assert out.dtype == x.dtype and rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-5
        assert not any(name.startswith("combine.") for name, _ in launches), launches
        gemms = {g["gemm"]: g for name, g in launches if name == "permute.gemm"}
        if gemms:   # (no tokens: nothing launched) GEMM 2 takes the summing variant, K split as asked
            assert gemms["down"]["sum_top_k"] == ids.shape[1] and gemms["down"]["tiles"].split_k == split_k
            assert gemms["gate_up"]["sum_top_k"] == 0 and gemms["gate_up"]["tiles"].split_k == 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_permute_sums_the_slots_in_16_bits_and_fp8(dtype):
    from moe_kernels.kernels.quant import quantize_weight
    from moe_kernels.reference import moe_reference_fp8

    x, w1, w2, weights, ids = make_problem(9, 6, 2, 256, 256, dtype, seed=19)   # K = 256: two slices of 128
    config = permute_variant(True, False, 1, 2, True, block_k=128)
    assert rel_err(permute_experts(x, w1, w2, weights, ids, align=16, config=config),
                   moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[dtype]
    if dtype == torch.float16:
        w1q, w1s = quantize_weight(w1.float(), "block")
        w2q, w2s = quantize_weight(w2.float(), "block")
        out = permute_experts(x, w1q, w2q, weights, ids, align=16, config=config, w1_scale=w1s, w2_scale=w2s)
        want = moe_reference_fp8(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity="block",
                                 intermediate_dtype=x.dtype)
        assert rel_err(out, want) < 1e-3


def test_summed_gemm_2_arguments_are_checked():
    x, w1, w2, weights, ids = make_problem(5, 3, 2, 24, 16, seed=2)
    p = permute(x, ids, 3, align=16)
    config = permute_variant(False, False, sum_in_gemm=True)
    y = p.rows[:, :16].contiguous()
    summed = torch.zeros(5, 24)
    with pytest.raises(ValueError, match="out"):
        grouped_gemm_contiguous(y, w2, p.m_indices, align=16, config=config, which="down",
                                sum_slots=(p, weights))
    with pytest.raises(ValueError, match="sum_slots"):
        grouped_gemm_contiguous(p.rows, w1, p.m_indices, align=16, silu_mul=True, config=config,
                                out=summed, sum_slots=(p, weights))
    with pytest.raises(ValueError, match=r"sum_slots\[0\]"):
        grouped_gemm_contiguous(y, w2, p.m_indices, align=16, config=config, which="down", out=summed,
                                sum_slots=(p._replace(row_assignments=p.row_assignments[:-16]), weights))
    with pytest.raises(TypeError, match="sum_slots"):
        grouped_gemm_contiguous(y, w2, p.m_indices, align=16, config=config, which="down", out=summed,
                                sum_slots=(p.row_assignments, weights))
    # weights of another routing (fewer tokens, another k) or of an integer dtype are refused, never
    # used as addresses or silently mis-scaled
    for bad, error in ((weights[:2], ValueError), (weights[:, :1].contiguous(), ValueError),
                       (weights.to(torch.int32), TypeError)):
        with pytest.raises(error, match=r"sum_slots\[1\]"):
            grouped_gemm_contiguous(y, w2, p.m_indices, align=16, config=config, which="down", out=summed,
                                    sum_slots=(p, bad))
    # a config made for the summed GEMM 2 (split K) runs whole when GEMM 2 stores its rows
    split = permute_variant(False, False, split_k=2, sum_in_gemm=True)
    plain = permute_variant(False, False)
    real = p.m_indices >= 0
    assert torch.allclose(grouped_gemm_contiguous(y, w2, p.m_indices, align=16, which="down", config=split)[real],
                          grouped_gemm_contiguous(y, w2, p.m_indices, align=16, which="down", config=plain)[real])


def test_persistent_grid_stops_at_rows_used():
    """The persistent grid reads its row count on the device: rows past ``rows_used`` are not
    visited even when they name a real expert (here the whole buffer does), and a count that is
    not a whole number of tiles still covers its last partial tile. Five 16-row blocks with
    GROUP_M 4 leave a partial group of M-blocks. (A split-K config runs whole when GEMM 2 stores
    its rows: split K needs the summed output.)"""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(80, 32, generator=g).to(DEVICE), (torch.randn(3, 24, 32, generator=g) / 6).to(DEVICE)
    m_indices = (torch.arange(80, dtype=torch.int32) // 16 % 3).to(DEVICE)
    for persistent, split_k in ((1, 1), (2, 1), (1, 2)):
        tiles = GemmTiles(16, 16, group_m=4, persistent=persistent)
        config = MoEConfig(16, tiles, dataclasses.replace(tiles, split_k=split_k), sum_in_gemm=split_k > 1)
        for used in (80, 40):
            out = torch.full((80, 24), -7.0, device=DEVICE)
            grouped_gemm_contiguous(x, w, m_indices, align=16, which="down", config=config, out=out,
                                    rows_used=torch.tensor([used], dtype=torch.int32, device=DEVICE))
            want = torch.stack([w[e] @ x[r] for r, e in enumerate(m_indices.tolist())])
            visited = -(-used // 16) * 16   # (a partial last tile is walked whole)
            assert torch.allclose(out[:visited], want[:visited], atol=1e-5)
            assert bool((out[visited:] == -7.0).all()), (persistent, split_k, used)


# Through the copy engine a tile reads its padding rows as they are (never-written memory, which
# numpy may find overflowing); they are never stored, and no other row reads them.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("variant", PERMUTE_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 72])   # 72: K is not a multiple of the K step (the copy engine zero-fills)
def test_permute_tma_and_transposed_tiles(variant, dtype, hidden):
    """Contiguous segments through the copy engine (both operands) and the transposed tile, alone
    and together, on the permute layout; the launch says which loads it took."""
    from moe_kernels._runtime import record_launches

    x, w1, w2, weights, ids = make_problem(13, 6, 2, hidden, 48, dtype, seed=hidden)
    with record_launches() as launches:
        out = permute_experts(x, w1, w2, weights, ids, align=16, config=permute_variant(*variant))
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[dtype]
    gemms = [settings for name, settings in launches if name == "permute.gemm"]
    row_bytes = {"gate_up": hidden * x.element_size(), "down": 48 * x.element_size()}
    assert [(g["tma_w"], g["tma_a"]) for g in gemms] == [(variant[0], variant[0] and row_bytes[g["gemm"]] % 16 == 0)
                                                         for g in gemms]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_permute_tma_fp8(granularity):
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels.quant import quantize_weight
    from moe_kernels.reference import moe_reference_fp8

    x, w1, w2, weights, ids = make_problem(9, 6, 2, 256, 128, seed=17)
    w1q, w1s = quantize_weight(w1, granularity)
    w2q, w2s = quantize_weight(w2, granularity)
    with record_launches() as launches:
        out = permute_experts(x, w1q, w2q, weights, ids, align=16, config=permute_variant(True, True, block_k=128),
                              w1_scale=w1s, w2_scale=w2s)
    gemms = [settings for name, settings in launches if name == "permute.gemm"]
    assert len(gemms) == 2 and all(g["tma_w"] and g["tma_a"] for g in gemms)
    want = moe_reference_fp8(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity=granularity,
                             intermediate_dtype=x.dtype)
    # (compiled, the quantiser of GEMM 2's input divides with div.full.f32, within 2 ulp of the reference's
    # division, so a few intermediate values land on the neighbouring fp8 step: 4.7e-3 and 5.8e-3 on an H200)
    assert rel_err(out, want) < (1e-2 if ON_GPU else 1e-3)


# ------------------------------------------------------------------------------------------
# GEMM 1 reading its rows through the permutation (MoEConfig.gather_rows): no copy in
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_gathered_rows_random(seed):
    """Random shapes, segment alignments and tiles (persistent grid, TMA weights, transposed tile,
    the top-k sum in GEMM 2), against the float64 reference: the permute kernel copies nothing
    and GEMM 1 reads every row from its token (gather_top_k = k, no activation TMA)."""
    from moe_kernels._runtime import record_launches

    shape, rng = random_shape(1000 + seed, [torch.float32, torch.float16])
    align = rng.choice([16, 32])
    tma, swap_ab, persistent = rng.choice([(False, False, 0), (True, False, 1), (True, True, 0), (False, False, 2)])
    summed = rng.choice([False, True])
    config = dataclasses.replace(permute_variant(tma, swap_ab, persistent, sum_in_gemm=summed), gather_rows=True)
    x, w1, w2, weights, ids = make_problem(**shape, seed=seed)
    with record_launches() as launches:
        out = permute_experts(x, w1, w2, weights, ids, align=align, config=config)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[x.dtype]
    gemms = {g["gemm"]: g for name, g in launches if name == "permute.gemm"}
    assert gemms or not HAS_TRITON   # (without Triton the torch reference runs: no launches)
    if gemms:
        assert gemms["gate_up"]["gather_top_k"] == ids.shape[1] and not gemms["gate_up"]["tma_a"]
        assert gemms["down"]["gather_top_k"] == 0


@pytest.mark.parametrize("case", sorted(EDGE_SHAPES) + ["no tokens", "skewed"])
def test_gathered_rows_edge_cases(case):
    """One token, one expert, k = 1, k = E, several tiles per expert, no tokens, an empty expert and
    every token on one expert, with GEMM 1 reading through the permutation."""
    from moe_kernels._runtime import record_launches

    config = dataclasses.replace(SMALL_TILES, gather_rows=True)
    for x, w1, w2, weights, ids in edge_problems(case, inter=16):
        with record_launches() as launches:
            out = permute_experts(x, w1, w2, weights, ids, align=16, config=config)
        assert out.shape == x.shape
        assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[torch.float32]
        gate_up = [g for name, g in launches if name == "permute.gemm" and g["gemm"] == "gate_up"]
        assert all(g["gather_top_k"] == ids.shape[1] for g in gate_up)
        assert gate_up or x.shape[0] == 0 or not HAS_TRITON


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_gathered_rows_fp8(granularity):
    """fp8: GEMM 1 reads each token's fp8 row and its scales where they are (no permuted copy of
    either); the same numbers as the copied rows."""
    from moe_kernels.kernels.quant import quantize_weight
    from moe_kernels.reference import moe_reference_fp8

    x, w1, w2, weights, ids = make_problem(9, 6, 2, 256, 128, seed=19)
    w1q, w1s = quantize_weight(w1, granularity)
    w2q, w2s = quantize_weight(w2, granularity)
    from moe_kernels._runtime import record_launches

    copied = permute_variant(True, False, 1, block_k=128)
    with record_launches() as launches:
        outs = [permute_experts(x, w1q, w2q, weights, ids, align=16, config=dataclasses.replace(copied, gather_rows=g),
                                w1_scale=w1s, w2_scale=w2s) for g in (False, True)]
    gate_up = [g["gather_top_k"] for name, g in launches if name == "permute.gemm" and g["gemm"] == "gate_up"]
    assert gate_up == [0, 2] or not HAS_TRITON
    want = moe_reference_fp8(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity=granularity,
                             intermediate_dtype=x.dtype)
    assert rel_err(outs[1], want) < 1e-3 and torch.equal(outs[0], outs[1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # (TMA tiles read the padding rows' garbage)
@pytest.mark.parametrize("seed", range(10))
def test_short_last_tile_random(seed):
    """A segment's last tile with at most half its rows real on half-height tiles (a second launch of
    each GEMM), on random shapes, alignments and grids, against the float64 reference; each GEMM
    launches twice, the second on half the M tile."""
    from moe_kernels._runtime import record_launches

    shape, rng = random_shape(2000 + seed, [torch.float32, torch.float16])
    align = rng.choice([32, 64])
    tma, swap_ab, persistent = rng.choice([(False, False, 0), (True, False, 1), (False, False, 2), (True, True, 0)])
    summed = rng.choice([False, True])
    config = dataclasses.replace(permute_variant(tma, swap_ab, persistent, sum_in_gemm=summed, block_m=32),
                                 short_last_tile=True, gather_rows=rng.choice([False, True]))
    x, w1, w2, weights, ids = make_problem(**shape, seed=seed)
    with record_launches() as launches:
        out = permute_experts(x, w1, w2, weights, ids, align=align, config=config)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[x.dtype]
    gemms = [(g["gemm"], g["block_m"], g["short_last"]) for name, g in launches if name == "permute.gemm"]
    assert gemms == [("gate_up", 32, 1), ("gate_up", 16, 2), ("down", 32, 1), ("down", 16, 2)] or not HAS_TRITON


#: Real rows per expert for the short last tiles on 32-row tiles: none, a few, exactly half a tile, just
#: over it, whole tiles, and several tiles with a short or a long last one.
SHORT_TILE_COUNTS = [0, 1, 16, 17, 31, 32, 33, 48, 49, 64, 65]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # (TMA tiles read the padding rows' garbage)
@pytest.mark.parametrize("align", [32, 64, 128])
@pytest.mark.parametrize("tma, swap_ab, persistent, summed, split_k, gathered", [
    (False, False, 0, False, 1, False), (True, False, 1, True, 2, False), (True, True, 0, False, 1, False),
    (False, False, 2, True, 1, True), (True, False, 1, False, 1, True)])
def test_short_last_tile_fixed_counts(align, tma, swap_ab, persistent, summed, split_k, gathered):
    """Segments of every kind (SHORT_TILE_COUNTS, top-1) in 32-row tiles, segments aligned to one to
    four tiles, with TMA, the transposed tile, each grid, the summed GEMM 2 split over K and gathered
    rows: both launches have tiles to run (a long segment's full tiles and its last one, short or
    not), and the result is the float64 reference's."""
    ids = torch.repeat_interleave(torch.arange(len(SHORT_TILE_COUNTS)), torch.tensor(SHORT_TILE_COUNTS))
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(align))][:, None].to(DEVICE)
    x, w1, w2, weights, ids = make_problem(ids.shape[0], len(SHORT_TILE_COUNTS), 1, 24, 16, seed=align,
                                           topk_ids=ids.to(torch.int32))
    config = dataclasses.replace(permute_variant(tma, swap_ab, persistent, split_k, summed, block_m=32),
                                 short_last_tile=True, gather_rows=gathered)
    out = permute_experts(x, w1, w2, weights, ids, align=align, config=config)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[torch.float32]


@pytest.mark.skipif(not HAS_TRITON, reason="the kernels' tile split; the torch reference has no tiles")
@pytest.mark.parametrize("layout", ["second half only", "middle of the first half", "both halves"])
def test_short_last_tile_needs_no_real_rows_first(layout):
    """The public GEMM promises every row whose id is an expert's, wherever a tile's real rows sit
    (permute puts them first; a caller's m_indices need not): each launch looks at a whole half, not
    one row."""
    pattern = {"second half only": [-1] * 20 + [0] * 12, "middle of the first half": [-1] * 4 + [0] * 8 + [-1] * 20,
               "both halves": [-1] * 10 + [0] * 12 + [-1] * 10}[layout]
    m_indices = torch.tensor(pattern, dtype=torch.int32)
    x, w, tiles = torch.randn(32, 16), torch.randn(1, 16, 16), GemmTiles(16, 16)
    outs = [grouped_gemm_contiguous(x, w, m_indices, align=32, config=MoEConfig(32, tiles, tiles, short_last_tile=s),
                                    out=torch.full((32, 16), float("nan"))) for s in (False, True)]
    real = m_indices >= 0
    assert not torch.isnan(outs[1][real]).any() and torch.isnan(outs[1][~real]).all()
    assert torch.allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6, equal_nan=True)


def test_short_last_tile_is_dropped_where_a_borrowed_tile_shrinks_below_32_rows():
    """A borrowed config whose M tile is halved to fit the segments keeps the short tiles only while
    their half is a tl.dot tile (16 rows or more)."""
    from moe_kernels.kernels.config import _adapted

    tiles = GemmTiles(16, 16)
    assert _adapted(MoEConfig(64, tiles, tiles, short_last_tile=True), "permute", 32).short_last_tile
    assert not _adapted(MoEConfig(32, tiles, tiles, short_last_tile=True), "permute", 16).short_last_tile


@pytest.mark.parametrize("case", sorted(EDGE_SHAPES) + ["no tokens", "skewed"])
def test_short_last_tile_edge_cases(case):
    """One token, one expert, k = 1, k = E, several tiles per expert, no tokens, an empty expert and
    every token on one expert, with the short last tiles."""
    config = dataclasses.replace(SMALL_TILES, block_m=32, short_last_tile=True)
    for x, w1, w2, weights, ids in edge_problems(case, inter=16):
        out = permute_experts(x, w1, w2, weights, ids, align=32, config=config)
        assert out.shape == x.shape
        assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[torch.float32]


@pytest.mark.skipif(not HAS_TRITON, reason="the kernels' tile split; the torch reference has no tiles")
def test_short_last_tile_splits_the_tiles_between_the_launches(monkeypatch):
    """Segments of 9, 16, 17 and 32 real rows in 32-row tiles: the full launch alone stores the 17-
    and 32-row segments, the half launch alone the 9- and 16-row ones (a tile exactly half full runs
    short), and never a padding row; both together store every real row, as the plain launch does."""
    from moe_kernels.kernels import contiguous_gemm

    counts = [9, 16, 17, 32]
    m_indices = torch.cat([torch.cat([torch.full((c,), e, dtype=torch.int32),
                                      torch.full((32 - c,), -1, dtype=torch.int32)]) for e, c in enumerate(counts)])
    m_indices = m_indices.to(DEVICE)
    x, w, tiles = torch.randn(m_indices.numel(), 16).to(DEVICE), torch.randn(len(counts), 16, 16).to(DEVICE), GemmTiles(16, 16)

    def stored(launches, short):
        if launches is not None:
            monkeypatch.setattr(contiguous_gemm, "_launches", lambda config: launches)
        config = MoEConfig(32, tiles, tiles, short_last_tile=short)
        out = grouped_gemm_contiguous(x, w, m_indices, align=32, config=config,
                                      out=torch.full((m_indices.numel(), 16), float("nan"), device=DEVICE))
        monkeypatch.undo()
        return out

    rows_of = {e: m_indices == e for e in range(len(counts))}
    full, half = stored(((32, 1),), True), stored(((16, 2),), True)
    assert [not torch.isnan(full[rows_of[e]]).any() for e in range(4)] == [False, False, True, True]
    assert [not torch.isnan(half[rows_of[e]]).any() for e in range(4)] == [True, True, False, False]
    assert [torch.isnan(half[rows_of[e]]).all() for e in (2, 3)] == [True, True]
    assert [torch.isnan(full[rows_of[e]]).all() for e in (0, 1)] == [True, True]
    both, plain = stored(None, True), stored(None, False)
    assert torch.isnan(both[m_indices < 0]).all() and not torch.isnan(both[m_indices >= 0]).any()
    assert torch.allclose(both, plain, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("block_n, swap_ab, per_column", [(64, False, False), (128, False, False), (128, True, False),
                                                          (128, False, True), (256, False, False)])
def test_block_scales_one_per_tile_and_per_column(block_n, swap_ab, per_column, silu_mul, monkeypatch):
    """fp8 block weights whose 128 x 128 blocks are scaled by different powers of ten, so that a
    tile applying another block's scale is off by 10x or more: a tile within one scale block
    (BLOCK_N <= 128) applies one weight scale per K step, the per-column path (SCALES = 4, and a
    256-column tile, which spans two blocks) one per column; both agree with the dequantised
    reference, transposed or not, gated or not."""
    from moe_kernels.kernels._gemm_operands import expert_rows_product
    from moe_kernels.kernels.formats import FP8_BLOCK, WeightFormat
    from moe_kernels.kernels.quant import quantize_activations, quantize_weight

    if per_column:   # the scale code the launcher passes: 1 (blocks) -> 4 (blocks, a scale per column)
        scale_arguments = WeightFormat.scale_arguments
        monkeypatch.setattr(WeightFormat, "scale_arguments", lambda self, *a: (
            lambda out: out[:6] + ((4 if out[6] == 1 else out[6]),) + out[7:])(scale_arguments(self, *a)))
    gen = torch.Generator().manual_seed(block_n)
    experts, rows, k = 2, 512, 256
    w = torch.randn(experts, rows, k, generator=gen)
    for n_block in range(rows // 128):
        for k_block in range(k // 128):
            w[:, n_block * 128:(n_block + 1) * 128, k_block * 128:(k_block + 1) * 128] *= 10.0 ** (n_block - k_block)
    wq, ws = quantize_weight(w.to(DEVICE), "block")
    m_indices = torch.tensor([0] * 10 + [-1] * 6 + [1] * 16, dtype=torch.int32, device=DEVICE)
    x = torch.randn(32, k, generator=gen).to(DEVICE)
    xq, xs = quantize_activations(x, "group")
    tiles = GemmTiles(block_n, 128, swap_ab=swap_ab)
    out = grouped_gemm_contiguous(xq, wq, m_indices, align=16, silu_mul=silu_mul, config=MoEConfig(16, tiles, tiles),
                                  which="gate_up" if silu_mul else "down", x_scale=xs, w_scale=ws,
                                  out_dtype=torch.float32)
    xf, wf = xq.float() * xs.repeat_interleave(128, dim=1), FP8_BLOCK.dequantize_weight(wq, ws)
    # (compiled, the transposed tile's fp8 wgmma adds its products with fewer mantissa bits than float32: 1.4e-4
    # and 1.9e-4 on an H200; a tile applying another block's scale would be off by 10x or more)
    for e in range(experts):
        real = m_indices == e
        assert rel_err(out[real], expert_rows_product(xf[real], wf[e], silu_mul)) < (1e-3 if ON_GPU else 1e-5)


INDEX_CASES = {name: (shape["num_tokens"], shape["num_experts"], shape["topk"]) for name, shape in EDGE_SHAPES.items()}
INDEX_CASES.update({"random": (11, 5, 2), "no tokens": (0, 4, 2), "all on one expert": (7, 3, 1),
                    "an empty expert": (6, 5, 1), "past the one-launch reach": (20, 16, 8)})


@pytest.mark.parametrize("align", [16, 128])
@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_permute_without_copy_writes_the_same_indices(case, align, monkeypatch):
    """copy=False: the alignment's own launch writes m_indices and src2dst up to its one-launch reach (no fill,
    no row kernel), the row kernel past it; they are the copying call's, every row and every assignment written.
    (The reach is lowered to 64 assignments for the last case: 8,192 took half a minute under the interpreter.)"""
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels import align as align_module

    if case == "past the one-launch reach":
        monkeypatch.setattr(permute_module, "SINGLE_LAUNCH_MAX_NUMEL", 64)
        monkeypatch.setattr(align_module, "SINGLE_LAUNCH_MAX_NUMEL", 64)
    num_tokens, experts, topk = INDEX_CASES[case]
    x, _, _, _, ids = make_problem(num_tokens, experts, topk, 32, 16, seed=3)
    if case == "all on one expert":
        ids = torch.full_like(ids, 1)
    if case == "an empty expert":
        ids = ids % 4   # (expert 4 gets nothing)
    copied = permute(x, ids, experts, align=align)
    with record_launches() as launches:
        indices_only = permute(x, ids, experts, align=align, copy=False)
    assert indices_only.rows is None
    for field in ("m_indices", "src2dst", "segment_starts", "segment_counts", "rows_used", "row_assignments"):
        assert torch.equal(getattr(copied, field), getattr(indices_only, field)), field
    want = permute_reference(x, ids, experts, align=align)
    assert torch.equal(indices_only.m_indices, want.m_indices) and torch.equal(indices_only.src2dst, want.src2dst)
    if HAS_TRITON:   # the path: one alignment launch that writes the indices too (its one-launch reach only)
        fused = ids.numel() <= align_module.SINGLE_LAUNCH_MAX_NUMEL
        assert [r["permute_indices"] for name, r in launches if name == "align.moe_align_block_size"] == [fused]


@pytest.mark.parametrize("case", ["random", "all on one expert", "an empty expert", "no tokens", "out of range"])
def test_the_scanned_alignment_writes_the_indices_past_one_launch(monkeypatch, case):
    """``INDICES_IN_SCANNED_ALIGNMENT``: past the one-launch reach (lowered here to none) the scanned alignment's
    placing launch writes ``m_indices`` and ``src2dst`` (no row kernel, no fill): the copying call's and the
    reference's, every row and every assignment written, ids out of range in no row; the launch record names the
    path. With the summed rule the row kernel writes them, as before."""
    from moe_kernels._runtime import record_launches, use_triton
    from moe_kernels.kernels import align as align_module

    x, _, _, _, ids = make_problem(40 if case != "no tokens" else 0, 6, 3, 32, 16, seed=5)
    if case == "all on one expert":
        ids = torch.full_like(ids, 2)
    if case == "an empty expert":
        ids = ids % 5   # (expert 5 gets nothing)
    if case == "out of range":
        ids[3, 1], ids[17, 0] = 6, -2
    checked = case != "out of range"
    copied = permute(x, ids, 6, align=16, validate_ids=checked)
    for rule, fused in (("scanned", True), ("summed", False)):
        monkeypatch.setattr(permute_module, "INDICES_IN_SCANNED_ALIGNMENT", True)
        monkeypatch.setattr(permute_module, "SINGLE_LAUNCH_MAX_NUMEL", 0)
        monkeypatch.setattr(align_module, "SINGLE_LAUNCH_MAX_NUMEL", 0)
        monkeypatch.setattr(align_module, "CHUNK_OFFSETS", rule)
        with record_launches() as launches:
            indices_only = permute(x, ids, 6, align=16, validate_ids=checked, copy=False)
        monkeypatch.undo()
        for field in ("m_indices", "src2dst", "rows_used", "row_assignments"):
            assert torch.equal(getattr(copied, field), getattr(indices_only, field)), (rule, field)
        if checked:
            want = permute_reference(x, ids, 6, align=16)
            assert torch.equal(indices_only.m_indices, want.m_indices) and torch.equal(indices_only.src2dst,
                                                                                       want.src2dst)
        if use_triton(x, ids) and ids.numel():
            assert [(r["permute_indices"], r["chunk_offsets"]) for name, r in launches
                    if name == "align.moe_align_block_size"] == [(fused, rule)]


def test_permute_without_copy_leaves_out_of_range_ids_in_no_row():
    """Unchecked ids outside [0, E) land in no segment: src2dst -1 there, as with the copy."""
    x, _, _, _, ids = make_problem(9, 5, 2, 32, 16, seed=8)
    ids[2, 1], ids[7, 0] = 5, -3
    copied = permute(x, ids, 5, align=16, validate_ids=False)
    indices_only = permute(x, ids, 5, align=16, validate_ids=False, copy=False)
    assert int(indices_only.src2dst[2, 1]) == -1 and int(indices_only.src2dst[7, 0]) == -1
    for field in ("m_indices", "src2dst", "rows_used", "row_assignments"):
        assert torch.equal(getattr(copied, field), getattr(indices_only, field)), field


def test_gathered_rows_arguments_are_checked():
    x, w1, w2, weights, ids = make_problem(6, 4, 2, 32, 16, seed=4)
    p = permute(x, ids, 4, align=16, copy=False)
    other = permute(x, ids, 4, align=32, copy=False)   # (more padding rows)
    gemm = dict(align=16, silu_mul=True, config=SMALL_TILES)
    cases = [
        (lambda: grouped_gemm_contiguous(x, w1, p.m_indices, gather_from=(p,), **gemm), TypeError, "gather_from"),
        (lambda: grouped_gemm_contiguous(x[:5], w1, p.m_indices, gather_from=p, **gemm), ValueError, "'x'"),
        (lambda: grouped_gemm_contiguous(x, w1, other.m_indices, gather_from=p, **gemm), ValueError, "m_indices"),
        (lambda: grouped_gemm_contiguous(x[:, :16].contiguous(), w2, p.m_indices, align=16, which="down",
                                         config=SMALL_TILES, gather_from=p, sum_slots=(p, weights),
                                         out=torch.zeros(6, 32, device=DEVICE)), ValueError, "gather_from"),
        (lambda: permute(x, ids, 4, align=16, copy=1), TypeError, "copy"),
        (lambda: permute(x, ids, 4, align=16, copy=False, out=torch.empty(64, 32, device=DEVICE)), ValueError, "out"),
        (lambda: permute_module.permute_experts(x, w1, w2, weights, ids, align=16, config=dataclasses.replace(
            SMALL_TILES, gather_rows=1)), TypeError, "gather_rows"),
    ]
    for call, exception, message in cases:
        with pytest.raises(exception, match=message):
            call()
    # A gated fp8 block GEMM whose up half does not start a scale block (F = 192): a tile's up half
    # would straddle two blocks, and reads one scale. Refused, as fused_experts refuses it.
    from moe_kernels.kernels.blocks import assign_blocks
    from moe_kernels.kernels.index_gather import expert_gate_up
    from moe_kernels.kernels.quant import quantize_activations, quantize_weight

    w1q, w1s = quantize_weight(torch.randn(2, 384, 128, device=DEVICE), "block")
    xq, xs = quantize_activations(torch.randn(16, 128, device=DEVICE), "group")
    with pytest.raises(ValueError, match="argument 'w' must have F a multiple of 128"):
        grouped_gemm_contiguous(xq, w1q, torch.zeros(16, dtype=torch.int32, device=DEVICE), align=16, silu_mul=True,
                                config=SMALL_TILES, x_scale=xs, w_scale=w1s)
    with pytest.raises(ValueError, match="argument 'w1' must have F a multiple of 128"):
        expert_gate_up(xq, w1q, assign_blocks(ids[:, :1] % 2, 16, 2), 1, tiles=GemmTiles(16, 32), a_scale=xs,
                       w_scale=w1s)
    from moe_kernels.kernels.index_gather import fused_experts
    with pytest.raises(ValueError, match="gather_rows"):   # index-gather reads through sorted ids already
        fused_experts(x, w1, w2, weights, ids, config=dataclasses.replace(SMALL_TILES, gather_rows=True))
    assert "gather_rows" not in SMALL_TILES.to_dict()
    on = dataclasses.replace(SMALL_TILES, gather_rows=True)
    assert MoEConfig.from_dict(on.to_dict()) == on


_COMPILE_PERMUTE_FOR_HOPPER = """
import torch
torch.cuda.is_available = lambda: True
from moe_kernels.kernels import contiguous_gemm as pm
from moe_kernels.sm90_compile import compile_for_sm90
fn = pm._contiguous_gemm_kernel
for tma, swap, persistent, summed in ((True, False, 0, 0), (True, True, 0, 0), (False, True, 0, 0), (True, False, 1, 0),
                                      (True, True, 1, 8), (True, False, 2, 0)):
    pointers = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", m_indices_ptr="*i32", a_scale_ptr="*fp32",
                    w_scale_ptr="*fp32", rows_used_ptr="*i32", row_assign_ptr="*i32", topk_weights_ptr="*fp32",
                    w_desc="tensordesc<bf16[64, 64]>" if tma else "*bf16",
                    a_desc="tensordesc<bf16[64, 64]>" if tma else "*bf16")
    const = dict(GATED=True, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=0, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                 SCALE_BN=128, SCALE_BK=128, TMA_W=tma, TMA_A=tma, SWAP_AB=swap, GROUP_M=8, PERSISTENT=persistent,
                 SUM_TOP_K=summed, SPLIT_K=2 if summed else 1)
    if summed:   # GEMM 2 adding into an fp32 [T, d] output
        const["GATED"] = False
        pointers["out_ptr"] = "*fp32"
    ptx = compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=3).asm["ptx"]
    print(tma, swap, persistent, "cp.async.bulk.tensor" in ptx, "wgmma" in ptx, "red.global" in ptx or "atom.global" in ptx)
pointers.update(out_ptr="*bf16", w_desc="tensordesc<bf16[64, 64]>", a_desc="*bf16")
const.update(GATED=True, TMA_W=True, TMA_A=False, SWAP_AB=False, PERSISTENT=1, SUM_TOP_K=0, SPLIT_K=1, GATHER_TOP_K=8)
ptx = compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=3,
                       aligned=("stride_am", "stride_we", "stride_wn", "stride_om", "N", "K")).asm["ptx"]
print("gathered", "cp.async.bulk.tensor" in ptx, "cp.async.cg" in ptx or "cp.async.ca" in ptx, "wgmma" in ptx)
# The short last tiles (MoEConfig.short_last_tile): the full launch on 128-row tiles and the half
# launch on 64-row ones, both through TMA on the persistent grid, both wgmma.
for block_m, short in ((128, 1), (64, 2)):
    pointers.update(w_desc="tensordesc<bf16[64, 64]>", a_desc=f"tensordesc<bf16[{block_m}, 64]>")
    const.update(TMA_A=True, GATHER_TOP_K=0, BLOCK_M=block_m, SHORT_LAST=short, M_STEP=short)
    ptx = compile_for_sm90(fn, const, pointers, num_warps=8, num_stages=3,
                           aligned=("stride_am", "stride_we", "stride_wn", "stride_om", "N", "K")).asm["ptx"]
    print("short", short, "cp.async.bulk.tensor" in ptx, "wgmma" in ptx, end=" " if short == 1 else chr(10))
"""


def test_permute_tma_compiles_for_hopper():
    """Compiled for sm_90 on this machine (the interpreter cannot say whether Triton accepts a
    kernel): with TMA both operands arrive by bulk tensor copies, and the 64-row tiles are wgmma,
    on the persistent grid too; GEMM 2 summing the slots adds with global atomics."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_KERNELS_BACKEND")}
    done = subprocess.run([sys.executable, "-c", _COMPILE_PERMUTE_FOR_HOPPER], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:6] == ["True False 0 True True False", "True True 0 True True False",
                                           "False True 0 False True False", "True False 1 True True False",
                                           "True True 1 True True True", "True False 2 True True False"]
    # GEMM 1 reading its rows through the permutation: weights by bulk copies, rows by cp.async
    # (pointer loads the pipeline stages), wgmma.
    assert done.stdout.split("\n")[6] == "gathered True True True", done.stdout
    assert done.stdout.split("\n")[7] == "short 1 True True short 2 True True", done.stdout


@needs_gpu
@pytest.mark.parametrize("variant", PERMUTE_VARIANTS + PERSISTENT_VARIANTS + SUMMED_VARIANTS)
@pytest.mark.parametrize("num_tokens", [1, 64, 600])
def test_permute_tma_and_transposed_tiles_gpu(variant, num_tokens):
    x, w1, w2, weights, ids = make_problem(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=num_tokens)
    config = permute_variant(*variant, block_m=64 if num_tokens == 600 else 16, block_k=128)
    out = permute_experts(x, w1, w2, weights, ids, config=config)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-2


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 600, 4096])
@pytest.mark.parametrize("fp8", [False, True])
def test_gathered_rows_gpu(num_tokens, fp8):
    """GEMM 1 through the permutation at Qwen3-30B-A3B's shape, bf16 and fp8 block: the same bits
    as the copied rows (the same products in the same order, only the rows' addresses differ)."""
    from moe_kernels.kernels.quant import quantize_weight

    x, w1, w2, weights, ids = make_problem(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=num_tokens)
    scales = {}
    if fp8:
        (w1, w1s), (w2, w2s) = quantize_weight(w1, "block"), quantize_weight(w2, "block")
        scales = dict(w1_scale=w1s, w2_scale=w2s)
    copied = permute_variant(True, False, 1, block_m=64, block_n=64, block_k=128)
    outs = [permute_experts(x, w1, w2, weights, ids, align=64, config=dataclasses.replace(copied, gather_rows=g),
                            **scales) for g in (False, True)]
    assert torch.equal(outs[0], outs[1])
    if not fp8:
        assert rel_err(outs[1], moe_reference(x, w1, w2, weights, ids)) < 1e-2


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 600, 4096])
@pytest.mark.parametrize("fp8", [False, True])
def test_short_last_tile_gpu(num_tokens, fp8):
    """The short last tiles at Qwen3-30B-A3B's shape on the prefill tiles (128-row segments, TMA, the
    persistent grid), bf16 and fp8 block: within the tolerance of the full tiles (wgmma on 64 rows
    against 128), and of the reference in bf16."""
    from moe_kernels.kernels.quant import quantize_weight

    x, w1, w2, weights, ids = make_problem(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=num_tokens)
    scales = {}
    if fp8:
        (w1, w1s), (w2, w2s) = quantize_weight(w1, "block"), quantize_weight(w2, "block")
        scales = dict(w1_scale=w1s, w2_scale=w2s)
    tiles = GemmTiles(128, 64 if not fp8 else 128, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=1)
    config = MoEConfig(128, tiles, tiles)
    outs = [permute_experts(x, w1, w2, weights, ids, align=128, config=dataclasses.replace(config, short_last_tile=s),
                            **scales) for s in (False, True)]
    assert rel_err(outs[1], outs[0]) < 1e-2
    if not fp8:
        assert rel_err(outs[1], moe_reference(x, w1, w2, weights, ids)) < 1e-2


@needs_gpu
@pytest.mark.parametrize("seed", range(6))
def test_permute_experts_bf16_gpu(seed):
    x, w1, w2, weights, ids = gpu_sized_bf16_problem(seed)
    out = permute_experts(x, w1, w2, weights, ids)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-2


@pytest.mark.parametrize("seed", range(8))
def test_torch_grouped_mm_baseline(seed):
    shape, rng = random_shape(100 + seed, [torch.float32, torch.float16]
                              + ([torch.bfloat16] if ON_GPU else []))
    x, w1, w2, weights, ids = make_problem(**shape, seed=seed)
    try:
        out = torch_grouped_mm_experts(x, w1, w2, weights, ids, align=rng.choice([16, 128]))
    except NotImplementedError as err:
        pytest.skip(str(err))
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[x.dtype]


@pytest.mark.skipif(not HAS_TRITON, reason="without Triton the alignment always validates ids")
def test_unchecked_bad_ids_add_nothing():
    """With validation off (the GPU default), an out-of-range id is skipped, never dereferenced."""
    x, w1, w2, weights, ids = make_problem(6, 4, 2, 24, 16, torch.float32, seed=8)
    bad = ids.clone()
    bad[1, 0], bad[4, 1] = -1, 4
    out = permute_experts(x, w1, w2, weights, bad, align=16, validate_ids=False)
    kept = weights * (bad == ids)                        # the two bad assignments weigh zero
    assert rel_err(out, moe_reference(x, w1, w2, kept, ids)) < 1e-5
    p = permute(x, bad, 4, align=16, validate_ids=False)
    assert p.src2dst[1, 0] == -1 and p.src2dst[4, 1] == -1
    assert int(p.segment_counts.sum()) == ids.numel() - 2


def test_torch_fallback_when_triton_is_unavailable(monkeypatch):
    """Without Triton every step runs its torch reference and the answer is the same."""
    monkeypatch.setattr(permute_module, "use_triton", lambda *tensors: False)
    x, w1, w2, weights, ids = make_problem(9, 4, 2, 24, 16, torch.float32, seed=5)
    out = permute_experts(x, w1, w2, weights, ids, align=16)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-5


# ------------------------------------------------------------------------------------------
# permute and unpermute
# ------------------------------------------------------------------------------------------


def check_permuted_layout(p, x, ids, num_experts, align, poisoned):
    num_rows = max_padded_rows(ids.numel(), num_experts, align)
    topk = ids.shape[1]
    assert p.rows.shape == (num_rows, x.shape[1]) and p.m_indices.shape == (num_rows,)
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert p.segment_counts.tolist() == counts.tolist()
    padded = (counts + align - 1) // align * align
    assert p.segment_starts.tolist() == (torch.cumsum(padded, 0) - padded).tolist()
    m_indices = p.m_indices.cpu()
    for e, (start, count) in enumerate(zip(p.segment_starts.tolist(), counts.tolist())):
        assert (m_indices[start:start + count] == e).all()
    assert int((m_indices == -1).sum()) == num_rows - ids.numel()
    dst = p.src2dst.flatten().long()
    assert torch.unique(dst).numel() == dst.numel()            # a permutation: no row reused
    assert torch.equal(p.m_indices[dst], ids.flatten().to(torch.int32))
    tokens = torch.arange(ids.numel(), device=x.device) // topk
    assert torch.equal(p.rows[dst], x[tokens])                 # an exact copy
    if poisoned:
        assert p.rows[p.m_indices == -1].isnan().all()         # padding rows never written


@pytest.mark.parametrize("seed", range(12))
def test_permute_layout(seed):
    shape, rng = random_shape(200 + seed, [torch.float32, torch.float16])
    align = rng.choice([1, 4, 16, 128])
    x, _, _, _, ids = make_problem(**shape, seed=seed)
    num_rows = max_padded_rows(ids.numel(), shape["num_experts"], align)
    out = torch.full((num_rows, shape["hidden"]), float("nan"), dtype=x.dtype, device=DEVICE)
    p = permute(x, ids, shape["num_experts"], align=align, out=out)
    assert p.rows is out
    check_permuted_layout(p, x, ids, shape["num_experts"], align, poisoned=True)
    ref = permute_reference(x, ids, shape["num_experts"], align=align)
    check_permuted_layout(ref, x, ids, shape["num_experts"], align, poisoned=False)
    assert torch.equal(ref.m_indices, p.m_indices)


@pytest.fixture(params=["tile", "slots"])
def unpermute_body(request, monkeypatch):
    """Each way :func:`unpermute` can read a token's rows (``combine.UNPERMUTE_BODY``)."""
    from moe_kernels.kernels import combine

    monkeypatch.setattr(combine, "UNPERMUTE_BODY", request.param)
    return request.param


@pytest.mark.parametrize("seed", range(6))
def test_unpermute_round_trip_and_weights(seed, unpermute_body):
    shape, rng = random_shape(300 + seed, [torch.float32])
    x, _, _, weights, ids = make_problem(**shape, seed=seed)
    p = permute(x, ids, shape["num_experts"], align=rng.choice([1, 16]))
    k = ids.shape[1]
    back = unpermute(p.rows, p.src2dst, torch.full_like(weights, 1.0 / k))
    assert rel_err(back, x.double()) < 1e-6
    out = torch.full_like(x, float("nan"))
    scaled = unpermute(p.rows, p.src2dst, weights, out=out)
    assert scaled is out
    expected = x.double() * weights.double().sum(dim=1, keepdim=True)
    assert rel_err(scaled, expected) < 1e-6
    assert rel_err(unpermute_reference(p.rows, p.src2dst, weights), expected) < 1e-6


@pytest.mark.parametrize("tokens, k, d", [(0, 2, 8), (1, 1, 8), (3, 3, 40), (2, 6, 1100), (4, 8, 16), (2, 0, 8)])
def test_unpermute_against_float64(tokens, k, d, unpermute_body):
    """Each token's k rows (k a power of two or not, or none; rows wider than one 1024-column chunk)
    times their weights, summed, against float64; a row named twice adds twice, a row out of range or
    -1 adds nothing; the launch ran the body asked for."""
    from moe_kernels._runtime import record_launches

    gen = torch.Generator().manual_seed(tokens * 100 + k * 10 + d)
    y = torch.randn(7, d, generator=gen).to(DEVICE)
    src2dst = torch.randint(-1, 9, (tokens, k), generator=gen, dtype=torch.int32).to(DEVICE)   # 7, 8: outside
    weights = (torch.rand(tokens, k, generator=gen) + 0.5).to(DEVICE)
    with record_launches() as launches:
        out = unpermute(y, src2dst, weights)
    inside = (src2dst >= 0) & (src2dst < 7)
    rows = y.double()[torch.where(inside, src2dst, 0).long()]                       # [T, k, d]
    want = (rows * (weights.double() * inside)[..., None]).sum(dim=1)
    assert out.shape == (tokens, d) and rel_err(out, want) < 1e-6
    assert rel_err(unpermute_reference(y, src2dst, weights), want) < 1e-6
    ran = [settings["body"] for name, settings in launches if name == "combine.unpermute"]
    assert ran == ([unpermute_body] if tokens and d else []), launches


@pytest.mark.skipif(not HAS_TRITON, reason="the torch fallback launches no kernel")
def test_unpermute_runs_the_slot_loop_by_default():
    """The default body is the one the H200 timed at moe_sum's rate (unpermute-ab.json): "slots"."""
    from moe_kernels._runtime import record_launches

    with record_launches() as launches:
        unpermute(torch.randn(4, 8, device=DEVICE), torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
                  torch.ones(2, 2, device=DEVICE))
    assert [s["body"] for name, s in launches if name == "combine.unpermute"] == ["slots"], launches


def test_an_unknown_unpermute_body_is_refused(monkeypatch):
    from moe_kernels.kernels import combine

    monkeypatch.setattr(combine, "UNPERMUTE_BODY", "slot")
    with pytest.raises(ValueError, match="'UNPERMUTE_BODY' must be 'tile' or 'slots', got 'slot'"):
        unpermute(torch.randn(4, 8, device=DEVICE), torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
                  torch.ones(2, 2, device=DEVICE))


def test_unpermute_accumulates_in_fp32(unpermute_body):
    """A partial sum past the fp16 range (120000) must not turn the answer (60000) into inf."""
    y = torch.tensor([[60000.0], [60000.0], [-60000.0]], dtype=torch.float16, device=DEVICE)
    out = unpermute(y, torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE),
                    torch.ones(1, 3, device=DEVICE))
    assert out.item() == 60000.0


_COMPILE_UNPERMUTE_FOR_HOPPER = """
import re
import torch
torch.cuda.is_available = lambda: True
from moe_kernels.kernels import combine
from moe_kernels.sm90_compile import compile_for_sm90
for slot_loop, block_topk, block_d in ((False, 8, 512), (True, 8, 1024)):
    ptx = compile_for_sm90(combine._unpermute_kernel, dict(BLOCK_TOPK=block_topk, BLOCK_D=block_d, SLOT_LOOP=slot_loop),
                           dict(y_ptr="*bf16", src2dst_ptr="*i32", weights_ptr="*fp32", out_ptr="*bf16"),
                           aligned=("stride_ym", "stride_wt", "stride_ot", "hidden_size", "topk"),
                           num_warps=4).asm["ptx"]
    print(slot_loop, len(re.findall("ld.global.v4", ptx)), "bar.sync" in ptx)
"""


def test_unpermute_bodies_compile_for_hopper():
    """Compiled for sm_90 (Triton 3.6 in CI): the tile body sums its [8, 512] tile across warps
    (shared memory and barriers); the slots body loads each of the 8 rows' 1024 columns as one
    16-byte load per thread and adds them in registers, with no barrier."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_KERNELS_BACKEND")}
    done = subprocess.run([sys.executable, "-c", _COMPILE_UNPERMUTE_FOR_HOPPER], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["False 4 True", "True 8 False"], done.stdout


# ------------------------------------------------------------------------------------------
# the grouped GEMM
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_gemm_skips_padding_rows(silu_mul, dtype):
    x, w1, _, _, ids = make_problem(10, 4, 2, 40, 24, dtype, seed=21)
    p = permute(x, ids, 4, align=32)
    rows = p.rows.clone()
    padding = p.m_indices == -1
    rows[padding] = float("nan")                                 # never read
    n = w1.shape[1] // 2 if silu_mul else w1.shape[1]
    out = torch.full((rows.shape[0], n), float("nan"), dtype=dtype, device=DEVICE)
    grouped_gemm_contiguous(rows, w1, p.m_indices, align=32, silu_mul=silu_mul, out=out,
                            config=SMALL_TILES)
    assert out[padding].isnan().all()                            # never written
    real = ~padding
    experts = p.m_indices[real].long()
    h = torch.einsum("rk,rnk->rn", rows[real].double(), w1.double()[experts])
    expected = silu_and_mul_reference(h) if silu_mul else h
    assert rel_err(out[real], expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("offset", [0, 2])
def test_rows_the_copy_engine_cannot_describe_take_pointer_loads(offset):
    """Activation rows at a base address or row stride that is not a multiple of 16 bytes (a view
    into a larger buffer) cannot be a tensor descriptor: the same tiles load them by pointers,
    with the same numbers, while the weights still come through the copy engine."""
    from moe_kernels._runtime import record_launches

    x, w1, _, _, ids = make_problem(10, 4, 2, 64, 24, torch.float32, seed=22)
    p = permute(x, ids, 4, align=32)
    storage = torch.zeros(p.rows.numel() + p.rows.shape[0] * offset + offset, device=DEVICE)
    view = storage[offset:].as_strided(p.rows.shape, (64 + offset, 1))   # rows 64 + offset floats apart
    view.copy_(p.rows)
    with record_launches() as launches:
        out = grouped_gemm_contiguous(view, w1, p.m_indices, align=32, silu_mul=True,
                                      config=MoEConfig(16, GemmTiles(32, 32, tma=True), GemmTiles(32, 32, tma=True)))
    (gemm,) = [settings for name, settings in launches if name == "permute.gemm"]
    assert (gemm["tma_w"], gemm["tma_a"]) == (True, offset == 0)
    real = p.m_indices >= 0
    h = torch.einsum("rk,rnk->rn", p.rows[real].double(), w1.double()[p.m_indices[real].long()])
    assert rel_err(out[real], silu_and_mul_reference(h)) < TOLERANCE[torch.float32]


def test_max_padded_rows_is_the_tight_bound():
    for n, num_experts, align in itertools.product(range(0, 7), range(1, 4), range(1, 5)):
        worst = 0
        for assignment in itertools.product(range(num_experts), repeat=n):
            counts = [assignment.count(e) for e in range(num_experts)]
            worst = max(worst, sum(-(-c // align) * align for c in counts))
        assert max_padded_rows(n, num_experts, align) == worst
        assert worst <= n + num_experts * (align - 1)           # vLLM's buffer length


def test_copy_bytes():
    cost = permute_copy_bytes(512, 8, 7168, torch.float8_e4m3fn)
    assert 512 * 8 * 7168 == 29_360_128                          # the B*k*d copy, 29.4 MB
    assert cost.permute == cost.unpermute == 512 * 9 * 7168
    assert permute_copy_bytes(1, 1, 4, torch.float32).permute == 2 * 4 * 4


def test_default_tile_config():
    """The permute layout takes the index-gather heuristic (every M tile divides the 128-row
    alignment), lowered to divide a smaller alignment; masked takes 128x128x64."""
    assert default_config(1, 4, 16, 16, layout="permute") == default_config(1, 4, 16, 16)
    assert default_config(4096, 4, 16, 16, layout="permute", align=48).block_m == 16
    tiles = GemmTiles(128, 64, 1, 8, 3)
    assert default_config(1, 4, 16, 16, layout="masked") == MoEConfig(128, tiles, tiles)
    assert default_config(1, 4, 16, 16, layout="masked", dtype=torch.float32).gate_up.block_k == 32
    fp8 = default_config(64, 256, 2048, 7168, dtype=torch.float8_e4m3fn)   # vLLM's block-fp8 default at 64
    assert (fp8.block_m, fp8.down.block_n, fp8.down.block_k, fp8.down.group_m) == (16, 128, 128, 32)


# ------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    problem = make_problem(4, 3, 2, 16, 16, torch.float32, seed=1)
    x, w1, w2, weights, ids = problem
    assert_each_raises(permute_experts, problem, [
        (dict(w1=w1[:, :, :8]), ValueError, "'w1' must have shape"),
        (dict(w2=w2[:, :, :4]), ValueError, "'w2' must have shape"),
        (dict(w2=w2.half()), TypeError, "'w2' must have dtype float32"),
        (dict(hidden_states=x.long()), TypeError, "'hidden_states' must have dtype"),
        (dict(topk_ids=ids.float()), TypeError, "'topk_ids' must have dtype int32 or int64"),
        (dict(w1=w1.to("meta")), ValueError, "'w1' must be on device"),
        (dict(topk_ids=ids[:3]), ValueError, "'topk_ids' must have shape [T=4, k]"),
        (dict(topk_weights=weights[:, :1]), ValueError, "'topk_weights' must have the shape"),
        (dict(topk_weights=weights.T.contiguous().T), ValueError,
         "'topk_weights' must be contiguous in its last dimension"),
        (dict(w1=w1.transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "'w1' must be contiguous in its last dimension"),
    ])
    for bad in (3, -1):   # ids out of range: a ValueError on the CPU, the alignment's device assert on a GPU
        if ON_GPU:
            assert_device_assert(f"""
                from moe_kernels.kernels.permute import permute_experts
                x, w1, w2 = (torch.randn(*shape, device="cuda") for shape in ((4, 16), (3, 32, 16), (3, 16, 16)))
                ids = torch.full((4, 2), {bad}, device="cuda")
                permute_experts(x, w1, w2, torch.ones(4, 2, device="cuda"), ids, validate_ids=True)
                """, "permute: argument 'topk_ids' must hold expert ids in [0, 3)")
        else:
            with pytest.raises(ValueError, match=re.escape("expert ids in [0, 3)")):
                permute_experts(x, w1, w2, weights, torch.full_like(ids, bad), validate_ids=True)
    empty = permute_experts(x[:0], w1, w2, weights[:0], ids[:0], align=16)   # no tokens: no rows, no error
    assert empty.shape == (0, x.shape[1])
    with pytest.raises(ValueError, match="'align' must be >= 1"):
        permute_experts(x, w1, w2, weights, ids, align=0)
    with pytest.raises(ValueError, match=r"'config.block_m' must divide align=16"):
        permute_experts(x, w1, w2, weights, ids, align=16, config=MoEConfig(32, GemmTiles(16, 16), GemmTiles(16, 16)))
    with pytest.raises(ValueError, match="'config.gate_up.block_k' must be a power of two"):
        permute_experts(x, w1, w2, weights, ids, align=16, config=MoEConfig(16, GemmTiles(16, 8), GemmTiles(16, 16)))
    with pytest.raises(ValueError, match="'out' must have shape"):
        permute(x, ids, 3, align=16, out=torch.empty(5, 16, device=DEVICE))
    with pytest.raises(ValueError, match="'m_indices' must have one entry per row"):
        grouped_gemm_contiguous(x, w1, torch.zeros(4, dtype=torch.int32, device=DEVICE), align=16)


@pytest.mark.parametrize("persistent", [0, 1, 2])
def test_tiles_that_must_not_run_store_nothing_on_every_grid(persistent):
    """Tiles of padding (-1), of an expert past E, and a malformed tile whose largest id is past E (its
    rows of expert 0 included) store nothing, and real tiles the product, on each grid: the flattened
    loop (2) enters the K loop for every tile, on expert 0's weights, and must mask all their rows."""
    e = 3
    x = torch.randn(80, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    w = torch.randn(e, 24, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    m_indices = torch.tensor([1] * 16 + [e] * 16 + [-1] * 16 + [0] * 8 + [e] * 8 + [2] * 10 + [-1] * 6,
                             dtype=torch.int32, device=DEVICE)
    tiles = GemmTiles(16, 16, persistent=persistent)
    out = torch.full((80, 24), 7.0, device=DEVICE)
    grouped_gemm_contiguous(x, w, m_indices, align=16, out=out, config=MoEConfig(16, tiles, tiles),
                            rows_used=torch.tensor([80], dtype=torch.int32, device=DEVICE))
    want = torch.full((80, 24), 7.0, dtype=torch.float64, device=DEVICE)
    want[:16] = x[:16].double() @ w[1].double().T
    want[64:74] = x[64:74].double() @ w[2].double().T
    assert rel_err(out, want) < 1e-6

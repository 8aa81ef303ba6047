"""Index-gather fused MoE (moe_kernels.kernels.index_gather) against the float64 per-token reference.

Runs on default_device(): the Triton interpreter on a CPU machine, the compiled kernels on a GPU.
"""

import dataclasses
import random
import re
from functools import partial

import pytest
import torch

import moe_testing
from moe_kernels.kernels import blocks as block_map
from moe_kernels.kernels import combine, config, gather_tile
from moe_kernels.kernels import index_gather as fm
from moe_kernels.reference import moe_reference, silu_and_mul_reference
from moe_testing import DEVICE, ON_GPU, TOLERANCE, assert_device_assert, needs_gpu, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")
# Routed as vLLM's fused_topk hands it over: int32 ids, weights that sum to one.
make_problem = partial(moe_testing.make_problem, fused_topk_like=True)


def check(problem, dtype, **kwargs):
    hidden, w1, w2, weights, ids = problem
    out = fm.fused_experts(hidden, w1, w2, weights, ids, **kwargs)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.device == hidden.device
    err = rel_err(out, moe_reference(hidden, w1, w2, weights, ids))
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"


# ---- random shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_shapes(seed):
    rnd = random.Random(seed)
    num_experts = rnd.randint(1, 12)
    top_k = rnd.randint(1, min(num_experts, 4))
    dtype = (torch.float32, torch.float16)[seed % 2]
    problem = make_problem(rnd.randint(1, 24), num_experts, top_k, rnd.choice([16, 32, 40, 64]),
                           rnd.choice([8, 16, 24, 40]), dtype, seed=seed)
    check(problem, dtype, block_size_m=rnd.choice([16, 32]), naive_block_assignment=rnd.choice([None, False, True]))


# ---- edge cases ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("naive", [False, True])
def test_one_token(dtype, naive):
    check(make_problem(1, 8, 3, 32, 16, dtype, seed=1), dtype, naive_block_assignment=naive)


def test_expert_with_no_tokens():
    ids = torch.tensor([[0, 2], [2, 5], [5, 0], [0, 5]])  # experts 1, 3, 4 receive nothing
    check(make_problem(4, 6, 2, 32, 16, torch.float32, seed=2, topk_ids=ids), torch.float32)


@pytest.mark.parametrize("block_m", [16, 32])
def test_all_tokens_on_one_expert(block_m):
    ids = torch.full((40, 1), 3)  # 40 rows on expert 3: several blocks, the last one partial
    check(make_problem(40, 5, 1, 32, 24, torch.float32, seed=3, topk_ids=ids), torch.float32, block_size_m=block_m)


def test_k_equals_1():
    check(make_problem(17, 6, 1, 48, 16, torch.float16, seed=4), torch.float16)


def test_k_equals_num_experts():
    check(make_problem(9, 4, 4, 32, 16, torch.float32, seed=5), torch.float32)


def test_single_expert():
    check(make_problem(5, 1, 1, 16, 8, torch.float32, seed=6), torch.float32)


def test_naive_path_is_chosen_by_vllm_rule():
    hidden, w1, w2, weights, ids = make_problem(2, 64, 8, 32, 16, torch.float32, seed=7)
    assert block_map.assign_blocks(ids, 16, 64).naive and not block_map.assign_blocks(ids[:, :3].repeat(3, 1), 16, 64).naive
    check((hidden, w1, w2, weights, ids), torch.float32)


def test_naive_map_matches_explicit_naive_alignment():
    # align.naive_block_assignment writes the naive map out as tensors: the aligned kernel path
    # over those tensors must give what the index-free naive path gives.
    from moe_kernels.kernels.blocks import naive_block_assignment

    hidden, w1, w2, weights, ids = make_problem(3, 16, 2, 32, 16, torch.float32, seed=21)
    sorted_ids, expert_ids, used = naive_block_assignment(ids, 16)
    explicit = block_map.BlockAssignment(16, expert_ids, sorted_ids, used, expert_ids.numel())
    a = fm.fused_experts(hidden, w1, w2, weights, ids, blocks=explicit)
    b = fm.fused_experts(hidden, w1, w2, weights, ids, naive_block_assignment=True)
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_naive_path_with_repeated_expert():
    # Two tokens on the same expert: two naive blocks stream the same weights, both must be right.
    ids = torch.tensor([[3, 1], [3, 0]])
    check(make_problem(2, 40, 2, 32, 16, torch.float32, seed=8, topk_ids=ids), torch.float32, naive_block_assignment=True)


@pytest.mark.skipif(not fm.HAS_TRITON, reason="the grouped naive map is a Triton kernel's")
def test_naive_map_reads_each_expert_once_per_block():
    """On the naive map block m is assignment m; ``_naive_group_rows`` gives the first block of
    each BLOCK_M assignments on one expert all of their rows, and the other blocks none, so that
    two tokens on one expert read its weights once (here: block_m 2, expert 5 taken four times)."""
    from moe_kernels._runtime import kernel, tl

    @kernel
    def rows_of_blocks(ids_ptr, rows_ptr, used_ptr, numel, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
        m = tl.program_id(0)
        rows, in_use = gather_tile._naive_group_rows(ids_ptr, m, numel, BLOCK_M, GROUP)
        tl.store(rows_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M), rows)
        tl.store(used_ptr + m, in_use.to(tl.int32))

    def run(ids, block_m):
        ids = ids.to(torch.int32).to(DEVICE)
        rows = torch.empty(ids.numel(), block_m, dtype=torch.int64, device=DEVICE)
        used = torch.empty(ids.numel(), dtype=torch.int32, device=DEVICE)
        group = max(16, 1 << (ids.numel() - 1).bit_length())
        rows_of_blocks[(ids.numel(),)](ids, rows, used, ids.numel(), BLOCK_M=block_m, GROUP=group)
        return rows, used.bool().tolist()

    rows, used = run(torch.tensor([5, 1, 5, 7, 5, 5, 2]), 2)
    assert used == [True, True, False, True, True, False, True]
    pad = 7   # (a row index past the assignments: padding)
    assert [rows[m].tolist() for m in range(7) if used[m]] == [[0, 2], [1, pad], [3, pad], [4, 5], [6, pad]]
    # Against the Python reference: random ids with many repeats (out-of-range ones among them), and
    # more assignments on one expert than a block holds.
    gen = torch.Generator().manual_seed(23)
    for numel, experts, block_m in ((1, 3, 16), (24, 3, 2), (40, 2, 16), (64, 40, 16), (100, 5, 32)):
        ids = torch.randint(-1, experts + 1, (numel,), generator=gen)
        rows, used = run(ids, block_m)
        want_rows, want_used = gather_tile.naive_group_rows_reference(ids, block_m)
        assert used == want_used, (numel, experts, block_m)   # (a block not in use stores nothing: its rows don't count)
        assert [r for r, u in zip(rows.tolist(), used) if u] == [r for r, u in zip(want_rows, used) if u]


def test_naive_map_with_more_assignments_on_an_expert_than_a_block():
    """40 tokens, top-1, all on expert 2, forced onto the naive map with 16-row blocks: three
    blocks take 16, 16 and 8 rows; with the top-k sum in GEMM 2 (atomic adds) a row computed twice
    would count twice."""
    ids = torch.full((40, 1), 2, dtype=torch.int32)
    problem = make_problem(40, 4, 1, 32, 16, torch.float32, seed=21, topk_ids=ids)
    base = config.get_config(40, 4, 16, 32, torch.float32, DEVICE)
    for summed in (False, True):
        check(problem, torch.float32, naive_block_assignment=True,
              config=dataclasses.replace(base, block_m=16, sum_in_gemm=summed))


@pytest.mark.skipif(not fm.HAS_TRITON, reason="launch records are the Triton kernels'")
def test_naive_map_groups_up_to_its_limit():
    from moe_kernels._runtime import record_launches
    # (top-2: one token, whose two experts are distinct; 6 assignments; 258, past the limit)
    if block_map.NAIVE_GROUP_MAX < 6:
        pytest.skip("MOE_KERNELS_NAIVE_GROUP_MAX turns the grouping off (an A/B against vLLM's map)")
    for tokens, group in ((1, 0), (3, 16), (block_map.NAIVE_GROUP_MAX // 2 + 1, 0)):
        hidden, w1, w2, weights, ids = make_problem(tokens, 8, 2, 32, 16, torch.float32, seed=22)
        with record_launches() as launches:
            fm.fused_experts(hidden, w1, w2, weights, ids, naive_block_assignment=True)
        gemms = [settings for name, settings in launches if name == "index_gather.gemm"]
        assert len(gemms) == 2 and {g["naive_group"] for g in gemms} == {group}


def test_naive_group_must_cover_every_id():
    ids = torch.zeros(40, dtype=torch.int32)
    block_map.BlockAssignment(16, ids, None, None, 40, naive_group=64)
    for bad in (32, 48, -1):
        with pytest.raises(ValueError, match="naive_group"):
            block_map.BlockAssignment(16, ids, None, None, 40, naive_group=bad)


def test_no_tokens():
    hidden, w1, w2, weights, ids = make_problem(0, 4, 2, 32, 16, torch.float32, seed=9)
    assert fm.fused_experts(hidden, w1, w2, weights, ids).shape == (0, 32)


def test_precomputed_blocks():
    hidden, w1, w2, weights, ids = make_problem(12, 6, 2, 32, 16, torch.float32, seed=10)
    blocks = block_map.assign_blocks(ids, 32, 6, naive=False)
    assert blocks.block_m == 32 and not blocks.naive
    check((hidden, w1, w2, weights, ids), torch.float32, blocks=blocks)


def test_bf16_on_cpu_is_upcast():
    if ON_GPU:
        pytest.skip("the upcast is the interpreter's workaround; bf16 runs natively on the GPU")
    check(make_problem(6, 5, 2, 32, 16, torch.bfloat16, seed=11), torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("seed", range(6))
def test_bf16_gpu(seed):
    rnd = random.Random(1000 + seed)
    e = rnd.choice([8, 64, 128])
    k = rnd.choice([1, 2, 8])
    problem = make_problem(rnd.choice([1, 3, 33, 300]), e, k, rnd.choice([256, 512, 384]),
                           rnd.choice([128, 192, 256]), torch.bfloat16, seed=seed)
    check(problem, torch.bfloat16)


@needs_gpu
def test_bf16_gpu_default_sizes():
    # A GPU-sized problem, through get_config's choice (tuned table or defaults).
    check(make_problem(700, 32, 4, 1024, 512, torch.bfloat16, seed=12), torch.bfloat16)


def test_torch_fallback_matches(monkeypatch):
    monkeypatch.setattr(fm, "use_triton", lambda *tensors: False)
    check(make_problem(7, 5, 2, 32, 16, torch.float32, seed=13), torch.float32)
    check(make_problem(2, 40, 2, 32, 16, torch.float32, seed=14), torch.float32, naive_block_assignment=True)


# ---- stages, each writing into a NaN-poisoned buffer ----------------------------------------


@pytest.mark.parametrize("naive", [False, True])
def test_stages_write_every_row(naive):
    hidden, w1, w2, weights, ids = make_problem(5, 8, 3, 40, 24, torch.float32, seed=15)
    num_tokens, top_k = ids.shape
    blocks = block_map.assign_blocks(ids, 16, 8, naive=naive)
    tiles = config.GemmTiles(block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)

    inter = torch.full((num_tokens * top_k, 24), float("nan"), device=DEVICE)
    fm.expert_gate_up(hidden, w1, blocks, top_k, tiles=tiles, out=inter)
    flat_ids = ids.reshape(-1).long()
    x = hidden.double()[torch.arange(num_tokens * top_k, device=DEVICE) // top_k]
    want = silu_and_mul_reference(torch.einsum("ad,afd->af", x, w1.double()[flat_ids]))
    assert rel_err(inter, want) < 1e-5

    per_slot = torch.full((num_tokens, top_k, 40), float("nan"), device=DEVICE)
    fm.expert_down(inter, w2, weights, blocks, tiles=tiles, out=per_slot)
    want = weights.reshape(-1, 1).double() * torch.einsum("af,adf->ad", inter.double(), w2.double()[flat_ids])
    assert rel_err(per_slot.reshape(-1, 40), want) < 1e-5

    out = torch.full((num_tokens, 40), float("nan"), device=DEVICE)
    combine.moe_sum(per_slot, out=out)
    assert rel_err(out, moe_reference(hidden, w1, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("persistent", [0, 1, 2])
@pytest.mark.parametrize("label", [-1, 4])
def test_expert_minus_one_writes_zeros(label, persistent):
    # A block whose expert id is -1 (vLLM: an expert held by another GPU) contributes zeros, and so
    # does one whose id is past the experts (unchecked input), on every grid: the flattened
    # persistent loop (2) runs such a tile's K loop on expert 0's weights and keeps zeros.
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 32, 16, torch.float32, seed=16)
    blocks = block_map.assign_blocks(ids, 16, 4, naive=False)
    first_expert = int(blocks.expert_ids[0])
    expert_ids = blocks.expert_ids.clone()
    expert_ids[0] = label
    hidden_blocks = block_map.BlockAssignment(16, expert_ids, blocks.sorted_token_ids, blocks.num_tokens_post_padded,
                                       blocks.num_m_blocks)
    tiles = dataclasses.replace(config.default_config(3, 4, 16, 32).gate_up, persistent=persistent)
    inter = torch.full((6, 16), float("nan"), device=DEVICE)
    fm.expert_gate_up(hidden, w1, hidden_blocks, 2, tiles=tiles, out=inter)
    on_missing = (ids.reshape(-1) == first_expert)
    assert (inter[on_missing] == 0).all() and torch.isfinite(inter).all()
    others = ~on_missing
    want = gather_tile.rows_reference(hidden, w1, blocks, 6, 2)
    assert rel_err(inter[others], want[others]) < 1e-5
    # GEMM 2 too, with an infinite routing weight on a missing row: zeros, not 0 * inf = NaN
    weights = torch.where(on_missing.reshape(weights.shape), torch.inf, weights)
    down_tiles = dataclasses.replace(config.default_config(3, 4, 16, 32).down, persistent=persistent)
    down = fm.expert_down(torch.nan_to_num(inter), w2, weights, hidden_blocks, tiles=down_tiles).reshape(6, -1)
    assert (down[on_missing] == 0).all() and torch.isfinite(down).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 8), (3, 8, 1500), (5, 2, 40)])
def test_moe_sum(dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(17)).to(DEVICE, dtype)
    out = torch.full((shape[0], shape[2]), float("nan"), device=DEVICE, dtype=dtype)
    combine.moe_sum(x, out=out)
    assert rel_err(out, x.double().sum(1)) < TOLERANCE[dtype]
    assert rel_err(combine.moe_sum_reference(x), x.double().sum(1)) < TOLERANCE[dtype]


# ---- the routed layer from logits ------------------------------------------------------------


def test_fused_moe_from_logits():
    routing = pytest.importorskip("moe_kernels.kernels.routing")
    hidden, w1, w2, _, _ = make_problem(6, 8, 2, 32, 16, torch.float32, seed=18)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(19)).to(DEVICE)
    weights, ids = routing.fused_topk(hidden, logits, 2, True)
    out = fm.fused_moe(hidden, w1, w2, logits, 2, True)
    assert rel_err(out, moe_reference(hidden, w1, w2, weights, ids)) < 1e-5


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("m, block_m, block_n, block_k", [(1, 16, 64, 128), (32, 16, 64, 128), (64, 32, 64, 128),
                                                          (96, 32, 128, 64), (512, 64, 128, 64), (513, 128, 128, 64)])
def test_default_config_follows_vllm(m, block_m, block_n, block_k):
    cfg = config.default_config(m, 128, 768, 2048)
    assert (cfg.block_m, cfg.down.block_n, cfg.down.block_k) == (block_m, block_n, block_k)
    assert cfg.gate_up.block_n == block_n // 2  # half the N tile: it loads gate and up rows
    assert config.MoEConfig.from_dict(cfg.to_dict()) == cfg


def test_chunked_k_steps_round_trip_through_a_table():
    """A table entry holds ``k_chunks`` only where it is not 1 (the tables written before it existed stay as they
    are), and reads back to the same config either way."""
    import dataclasses

    cfg = config.default_config(512, 256, 2048, 7168)
    chunked = dataclasses.replace(cfg, down=dataclasses.replace(cfg.down, k_chunks=2))
    assert "k_chunks" not in cfg.to_dict()["down"] and chunked.to_dict()["down"]["k_chunks"] == 2
    for c in (cfg, chunked):
        assert config.MoEConfig.from_dict(c.to_dict()) == c


def test_tuned_table_takes_nearest_m():
    a, b = config.default_config(1, 8, 64, 64), config.default_config(4096, 8, 64, 64)
    table = {1: a, 4096: b}
    assert config.nearest(table, 60) == a      # nearest by ratio: 60x vs 68x
    assert config.nearest(table, 70) == b
    h200 = config.load_table(config.table_name("NVIDIA H200", 128, 768, 2048, torch.bfloat16, "index_gather"))
    assert config.nearest(h200, 8).block_m == 16
    assert config.load_table(config.table_name("GPU Y", 8, 64, 64, torch.bfloat16, "index_gather")) is None
    assert config.get_config(5, 8, 64, 64, torch.float32, "cpu") == config.default_config(5, 8, 64, 64)


def test_tuned_tables_are_valid_configs():
    for path in sorted(config.CONFIG_DIR.glob("*.json")):
        for m, cfg in config.load_table(path.stem).items():
            assert m >= 1
            config.check_config("test", cfg)


# ---- bad inputs ------------------------------------------------------------------------------


def _good():
    return list(make_problem(3, 4, 2, 32, 16, torch.float32, seed=20))


@pytest.mark.parametrize("index, bad, exc, words", [
    (0, lambda p: p[0].reshape(3, 2, 16), ValueError, "'hidden_states' must have 2 dimensions"),
    (0, lambda p: p[0].to(torch.int32), TypeError, "'hidden_states' must have dtype"),
    (1, lambda p: p[1][:, :, :16], ValueError, "'w1' must have shape [E, 2F, d=32]"),
    (1, lambda p: p[1][:, :31], ValueError, "'w1' must have shape"),
    (1, lambda p: p[1].half(), TypeError, "'w1' must have dtype float32"),
    (1, lambda p: p[1].transpose(1, 2).contiguous().transpose(1, 2), ValueError, "'w1' must be contiguous in its last"),
    (2, lambda p: p[2][:, :, :8], ValueError, "'w2' must have shape [E=4, d=32, F=16]"),
    (2, lambda p: p[2].transpose(1, 2).contiguous().transpose(1, 2), ValueError, "'w2' must be contiguous in its last"),
    (3, lambda p: p[3][:, :1], ValueError, "'topk_weights' must have the shape of topk_ids"),
    (3, lambda p: p[3].to(torch.int64), TypeError, "'topk_weights' must have dtype"),
    (4, lambda p: p[4].float(), TypeError, "'topk_ids' must have dtype int32 or int64"),
    (4, lambda p: p[4][:2], ValueError, "'topk_ids' must have shape [T=3, k]"),
    (4, lambda p: p[4] + 3, ValueError, "'topk_ids' must hold expert ids in [0, 4)"),
    (4, lambda p: p[4] - 1, ValueError, "'topk_ids' must hold expert ids in [0, 4)"),
    (2, lambda p: torch.empty(4, 32, 16, device="meta"), ValueError, "'w2' must be on device"),
])
def test_bad_inputs(index, bad, exc, words):
    if DEVICE.type == "cuda" and "expert ids" in words:
        pytest.skip("on a GPU a bad id is a device-side assert (test_bad_id_stops_the_kernel_that_reads_it)")
    problem = _good()
    problem[index] = bad(problem)
    with pytest.raises(exc, match=re.escape("fused_experts: argument " + words)):
        fm.fused_experts(*problem)


def test_bad_arguments():
    problem = _good()
    with pytest.raises(ValueError, match="'block_size_m' must be a power of two >= 16"):
        fm.fused_experts(*problem, block_size_m=8)
    with pytest.raises(ValueError, match="'block_size_m' must be a power of two >= 16"):
        fm.fused_experts(*problem, block_size_m=24)
    with pytest.raises(ValueError, match="moe_sum: argument 'x' must have 3 dimensions"):
        combine.moe_sum(torch.zeros(3, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"moe_sum: argument 'out' must have shape \(2, 4\)"):
        combine.moe_sum(torch.zeros(2, 3, 4, device=DEVICE), out=torch.zeros(2, 5, device=DEVICE))


# ---- the benchmark harness (its timings need a GPU; its logic does not) ----------------------


def test_bench_cli_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the CLI runs the sweep")
    from moe_kernels.bench import sweep

    assert sweep.main(["--batches", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_tuning_candidates_fit_shared_memory():
    from moe_kernels.bench import tune

    assert tune.block_m_candidates(0.06) == [16] and tune.block_m_candidates(512) == [128]
    assert tune.block_m_candidates(32) == [16, 32, 64]
    for rho in (0.5, 40, 400):
        for bm in tune.block_m_candidates(rho):
            for gated in (True, False):
                tiles = tune.tile_candidates(rho, bm, gated)
                assert tiles
                for t in tiles:
                    weight_tiles = 2 if gated else 1
                    assert t.num_stages * (bm + weight_tiles * t.block_n) * t.block_k * 2 <= 220 * 1024
                    assert not t.swap_ab or (bm <= 32 and t.block_n >= 64)   # transposed only to reach wgmma
                assert any(t.swap_ab for t in tiles) == (bm <= 32 and any(t.block_n >= 64 for t in tiles))
                # two stages only for wide tiles at decode (two programs per SM where three stages allow one)
                assert all(t.block_n >= 128 and rho < 128 for t in tiles if t.num_stages == 2)
    assert any(t.num_stages == 2 and t.block_n == 128 and t.swap_ab for t in tune.tile_candidates(32, 32, False))


def test_bench_tuning_fp8_candidates_run_the_fp8_k_step():
    """fp8 tiles: K steps the kernel runs (<= 128, one scale block), 1-byte shared memory, 8 warps
    offered; and ``--refine`` offers the transposed product on 64- and 128-row weight tiles, on each grid."""
    from moe_kernels.bench import tune, tune_candidates
    from moe_kernels.kernels.config import GemmTiles, MoEConfig
    from moe_kernels.kernels.formats import FORMATS

    fp8 = FORMATS["block"]
    for rho in (0.5, 40, 400):
        for bm in tune.block_m_candidates(rho):
            tiles = tune.tile_candidates(rho, bm, True, fp8)
            assert tiles and len(set(tiles)) == len(tiles)
            assert all(t.block_k <= 128 and t.num_stages * (bm + 2 * t.block_n) * t.block_k <= 220 * 1024
                       for t in tiles)
            assert {t.num_warps for t in tiles} >= {4, 8}
    base = MoEConfig(16, GemmTiles(32, 128), GemmTiles(16, 256), False)
    variants = [t for gated, _, t in tune_candidates.candidates(1.0, 16, base=base) if gated]
    assert [(t.block_n, t.persistent, t.tma) for t in variants if t.swap_ab] == [
        (n, grid, tma) for n in (64, 128) for grid in (0, 1, 2) for tma in (False, True)]   # each grid, transposed too
    assert len([t for t in variants if not t.swap_ab and t.split_k == 1]) == 6
    assert [t.split_k for t in variants if t.split_k > 1] == [2, 4]   # GEMM 1 split over K, at decode
    wide = MoEConfig(64, GemmTiles(128, 64), GemmTiles(128, 64), False)
    assert not any(t.swap_ab for _, _, t in tune_candidates.candidates(100.0, 64, base=wide))
    # fp8 weights: two scale blocks a K step too (GemmTiles.k_chunks), as they are and transposed, one program a
    # tile, each as deep as still fits; 16-bit weights never (their 128-value step is 256 bytes already)
    deep = MoEConfig(32, GemmTiles(64, 128, num_stages=5), GemmTiles(256, 128, num_stages=3, tma=True, swap_ab=True))
    chunked = [(gated, t) for gated, _, t in tune_candidates.candidates(16.0, 32, base=deep, fmt=fp8)
               if t.k_chunks > 1]
    assert sorted((gated, t.block_n, t.swap_ab, t.tma) for gated, t in chunked) == [
        (False, 256, True, False), (False, 256, True, True), (True, 64, False, False), (True, 64, False, True),
        (True, 64, True, False), (True, 64, True, True)]
    for gated, t in chunked:
        assert t.k_chunks == 2 and t.persistent == 0 and tune_candidates.fits(32, t.block_n, 128, t.num_stages,
                                                                              gated, fp8, 2)
        assert not tune_candidates.fits(32, t.block_n, 128, t.num_stages + 1, gated, fp8, 2) or (
            t.num_stages == (5 if gated else 3))
    assert not any(t.k_chunks > 1 for _, _, t in tune_candidates.candidates(16.0, 32, base=deep,
                                                                               fmt=FORMATS["none"]))


@pytest.mark.parametrize("weight_format", ["none", "block"])
def test_bench_tuning_compile_job_runs_each_format(weight_format):
    """The tuner's precompile job builds inputs in the format tuned (fp8 needs scales)."""
    from moe_kernels.bench import tune_compile as tune

    job = {"d": 256, "f": 128, "top_k": 2, "block_m": 16, "naive": False, "sum_slots": False,
           "device": "cpu", "dtype": "float32", "format": weight_format,
           "tiles": {"block_n": 64, "block_k": 128, "swap_ab": True}}
    assert tune._compile_jobs([{**job, "gated": True}, {**job, "gated": False}]) == 2


@needs_gpu
@pytest.mark.parametrize("naive", [True, False])
def test_bad_id_stops_the_kernel_that_reads_it(naive):
    """On a GPU the id check is a device assert in a kernel that reads the ids: GEMM 2 on the
    naive path, the alignment otherwise (no launch, no host sync of its own)."""
    assert_device_assert(f"""
        from moe_kernels import fused_experts
        x, w1, w2 = (torch.randn(1, 32, device="cuda"), torch.randn(64, 32, 32, device="cuda"),
                     torch.randn(64, 32, 16, device="cuda"))
        ids = torch.tensor([[0, 64]], device="cuda")
        fused_experts(x, w1, w2, torch.rand(1, 2, device="cuda"), ids, naive_block_assignment={naive})
        """, "fused_experts: argument 'topk_ids' must hold expert ids in [0, 64)")

"""The GEMM core's options against the float64 per-token reference: the top-k sum in GEMM 2's
epilogue (``MoEConfig.sum_in_gemm``), split-K over GEMM 2's K loop (``GemmTiles.split_k``) and over
GEMM 1's (its SiLU·mul then a launch of its own),
weight tiles through tensor descriptors (``GemmTiles.tma``), the persistent grid
(``GemmTiles.persistent``) and the transposed tile product (``GemmTiles.swap_ab``), alone and
together; and GEMM 2 as a programmatic dependent launch of GEMM 1 (``MoEConfig.pdl``).

Runs on default_device(): the Triton interpreter on a CPU machine (float32 and float16), the
compiled kernels on a GPU (bf16 and fp8, at the models' own shapes).
"""

import dataclasses
import random

import pytest
import torch

from moe_kernels.kernels import index_gather as fm
from moe_kernels.kernels.config import GemmTiles, MoEConfig, check_config
from moe_kernels.kernels.quant import quantize_weight
from moe_kernels.reference import moe_reference, moe_reference_fp8
from moe_testing import DEVICE, EDGE_SHAPES, TOLERANCE, compiled_for_hopper, make_problem, needs_gpu, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")

# (sum_in_gemm, split_k, tma, persistent, swap_ab): the options alone and together.
VARIANTS = [(True, 1, False, 0, False), (True, 2, False, 0, False), (True, 3, False, 0, False),
            (False, 1, True, 0, False), (True, 2, True, 0, False), (False, 1, False, 1, False),
            (False, 1, False, 2, False), (True, 2, True, 2, False),
            (False, 1, False, 0, True), (True, 2, False, 0, True), (False, 1, True, 2, True)]


def variant(block_m, sum_in_gemm, split_k, tma, persistent=0, swap_ab=False, block_n=16, block_k=16):
    return MoEConfig(block_m, GemmTiles(block_n, block_k, tma=tma, persistent=persistent, swap_ab=swap_ab),
                     GemmTiles(block_n, block_k, split_k=split_k, tma=tma, persistent=persistent, swap_ab=swap_ab),
                     sum_in_gemm)


def check(problem, dtype, config, **kwargs):
    hidden, w1, w2, weights, ids = problem
    out = fm.fused_experts(hidden, w1, w2, weights, ids, config=config, **kwargs)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    err = rel_err(out, moe_reference(hidden, w1, w2, weights, ids))
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("seed", range(len(VARIANTS)))   # each combination once
def test_random_shapes(seed):
    rnd = random.Random(500 + seed)
    num_experts = rnd.randint(1, 10)
    dtype = (torch.float32, torch.float16)[seed % 2]
    problem = make_problem(rnd.randint(1, 20), num_experts, rnd.randint(1, min(num_experts, 4)),
                           rnd.choice([16, 32, 40, 64]), rnd.choice([16, 24, 40]), dtype, seed=seed,
                           fused_topk_like=True)
    check(problem, dtype, variant(rnd.choice([16, 32]), *VARIANTS[seed % len(VARIANTS)]),
          naive_block_assignment=rnd.choice([None, False, True]))


@pytest.mark.parametrize("case", sorted(EDGE_SHAPES))
@pytest.mark.parametrize("options", [VARIANTS[2], VARIANTS[4], VARIANTS[7], VARIANTS[9]])
def test_edge_cases(case, options):
    problem = make_problem(**EDGE_SHAPES[case], hidden=48, inter=40, seed=3)
    check(problem, torch.float32, variant(16, *options))


def test_no_tokens_and_an_expert_with_none():
    hidden, w1, w2, weights, ids = make_problem(6, 5, 2, 32, 16, seed=4, topk_ids=torch.tensor([[0, 1]] * 6))
    check((hidden, w1, w2, weights, ids), torch.float32, variant(16, True, 2, True, 2))   # experts 2..4 idle
    empty = fm.fused_experts(hidden[:0], w1, w2, weights[:0], ids[:0], config=variant(16, True, 2, False))
    assert empty.shape == (0, 32)


def test_more_k_slices_than_k_steps():
    # 3 K steps split 4 ways: one slice is empty and must add nothing.
    check(make_problem(5, 4, 2, 32, 48, seed=5), torch.float32, variant(16, True, 4, False))


def test_unchecked_ids_out_of_range_add_nothing():
    hidden, w1, w2, weights, ids = make_problem(7, 4, 2, 32, 16, seed=6)
    bad = ids.clone()
    bad[2, 1] = 9
    bad[5, 0] = -3
    out = fm.fused_experts(hidden, w1, w2, weights, bad, config=variant(16, True, 2, True, 1), validate_ids=False)
    keep = (bad >= 0) & (bad < 4)
    want = moe_reference(hidden, w1, w2, weights * keep, bad.clamp(0, 3))
    assert rel_err(out, want) < TOLERANCE[torch.float32]


def split_up(config: MoEConfig, split: int) -> MoEConfig:
    """``config`` with GEMM 1 split over ``split`` K slices."""
    return dataclasses.replace(config, gate_up=dataclasses.replace(config.gate_up, split_k=split))


@pytest.mark.parametrize("case", sorted(EDGE_SHAPES))
@pytest.mark.parametrize("split", [2, 3])
def test_gate_up_split_over_k_edge_cases(case, split):
    """GEMM 1 split over K (partial gate and up sums added in fp32, SiLU·mul a launch of its own),
    with GEMM 2 plain and summed-and-split, against the float64 reference."""
    problem = make_problem(**EDGE_SHAPES[case], hidden=48, inter=40, seed=11)
    check(problem, torch.float32, split_up(variant(16, False, 1, False), split))
    check(problem, torch.float32, split_up(variant(16, True, 2, True, 1), split))


@pytest.mark.parametrize("seed", range(6))
def test_gate_up_split_over_k_random_shapes(seed):
    rnd = random.Random(900 + seed)
    num_experts = rnd.randint(1, 9)
    dtype = (torch.float32, torch.float16, torch.bfloat16)[seed % 3]
    problem = make_problem(rnd.randint(1, 20), num_experts, rnd.randint(1, min(num_experts, 4)),
                           rnd.choice([32, 48, 64]), rnd.choice([16, 24, 40]), dtype, seed=seed, fused_topk_like=True)
    options = VARIANTS[rnd.randrange(len(VARIANTS))]
    check(problem, dtype, split_up(variant(rnd.choice([16, 32]), *options), rnd.choice([2, 4])),
          naive_block_assignment=rnd.choice([None, False, True]))


def test_gate_up_split_takes_its_path():
    """The launches say what ran: GEMM 1 ungated over all 2F rows, summing its K slices into fp32
    (sum_top_k 1, split_k), then the SiLU·mul launch, then GEMM 2 as configured."""
    from moe_kernels._runtime import record_launches

    hidden, w1, w2, weights, ids = make_problem(5, 4, 2, 32, 16, seed=12)
    with record_launches() as launches:
        fm.fused_experts(hidden, w1, w2, weights, ids, config=split_up(variant(16, False, 1, False), 4))
    gemms = [info for name, info in launches if name == "index_gather.gemm"]
    names = [name for name, _ in launches]
    assert names.index("activation.silu_mul") == names.index("index_gather.gemm") + 1
    assert [(g["gemm"], g["tiles"].split_k, g["sum_top_k"]) for g in gemms] == [("gate_up", 4, 1), ("down", 1, 0)]
    with record_launches() as launches:
        fm.fused_experts(hidden, w1, w2, weights, ids, config=variant(16, False, 1, False))
    assert "activation.silu_mul" not in [name for name, _ in launches]


def test_gate_up_split_more_slices_than_k_steps_and_bad_ids():
    """A K (40) that is no multiple of the K step, split in more slices than it has steps (one
    slice is empty and adds nothing), and unchecked ids out of range on both block maps."""
    check(make_problem(5, 4, 2, 40, 24, seed=15), torch.float32, split_up(variant(16, False, 1, False), 4))
    hidden, w1, w2, weights, ids = make_problem(7, 4, 2, 32, 16, seed=16)
    bad = ids.clone()
    bad[2, 1], bad[5, 0] = 9, -3
    keep = (bad >= 0) & (bad < 4)
    want = moe_reference(hidden, w1, w2, weights * keep, bad.clamp(0, 3))
    for naive in (False, True):
        out = fm.fused_experts(hidden, w1, w2, weights, bad, config=split_up(variant(16, False, 1, False), 2),
                               validate_ids=False, naive_block_assignment=naive)
        assert rel_err(out, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("check_in", ["gate_up", "down"])
def test_one_gemm_checks_the_naive_maps_ids(monkeypatch, check_in):
    """On the naive map one GEMM carries the ids' device-side check, the one that
    NAIVE_ID_CHECK_IN names, with GEMM 1 split over K or not (on a CPU the check runs on the host:
    the block map's id_check is set here to see which launch would carry it)."""
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels import index_gather

    monkeypatch.setattr(index_gather, "NAIVE_ID_CHECK_IN", check_in)
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 32, 16, seed=17)
    blocks = dataclasses.replace(fm.assign_blocks(ids, 16, 4, naive=True), id_check="topk_ids out of range")
    for split in (1, 2):
        with record_launches() as launches:
            fm.fused_experts(hidden, w1, w2, weights, ids, config=split_up(variant(16, False, 1, False), split),
                             blocks=blocks, validate_ids=False)
        checked = [(info["gemm"], info["id_check"]) for name, info in launches if name == "index_gather.gemm"]
        assert checked == [("gate_up", check_in == "gate_up"), ("down", check_in == "down")], (split, checked)


def test_naive_id_check_environment_is_checked():
    import os
    import subprocess
    import sys

    env = {**os.environ, "MOE_KERNELS_NAIVE_ID_CHECK_IN": "gemm2"}
    done = subprocess.run([sys.executable, "-c", "import moe_kernels.kernels.index_gather"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert "environment variable MOE_KERNELS_NAIVE_ID_CHECK_IN must be 'down' or 'gate_up'" in done.stderr, \
        done.stderr[-2000:]


def test_naive_id_check_setting_is_checked(monkeypatch):
    from moe_kernels.kernels import index_gather

    monkeypatch.setattr(index_gather, "NAIVE_ID_CHECK_IN", "gemm1")
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 32, 16, seed=17)
    with pytest.raises(ValueError, match="NAIVE_ID_CHECK_IN.*'gate_up' or 'down'"):
        fm.fused_experts(hidden, w1, w2, weights, ids, config=variant(16, False, 1, False), validate_ids=False,
                         naive_block_assignment=True)


@pytest.mark.parametrize("granularity", ["block", "channel", "tensor"])
def test_fp8_gate_up_split_over_k(granularity):
    problem = make_problem(9, 4, 2, 256, 256, torch.float32, seed=13, fused_topk_like=True)
    config = split_up(MoEConfig(16, GemmTiles(32, 128), GemmTiles(32, 128)), 2)
    check_fp8(problem, granularity, config, 2e-2)


def test_dense_shared_expert_with_gate_up_split():
    """The shared expert's dense path runs GEMM 1 through the same split."""
    from moe_kernels.kernels.formats import FORMATS
    from moe_kernels.kernels._gemm_operands import expert_rows_product

    g = torch.Generator().manual_seed(14)
    x, w1, w2 = torch.randn(7, 32, generator=g), torch.randn(48, 32, generator=g) / 6, torch.randn(32, 24, generator=g) / 5
    out = fm.dense_expert(x, w1, w2, fmt=FORMATS["none"], config=split_up(variant(16, False, 1, False), 2))
    want = expert_rows_product(expert_rows_product(x.double(), w1.double(), silu_mul=True), w2.double(),
                               silu_mul=False)
    assert rel_err(out, want) < TOLERANCE[torch.float32]


def check_fp8(problem, granularity, config, tolerance):
    """fp8 experts with ``config`` against the float64 reference on the same quantised numbers."""
    hidden, w1, w2, weights, ids = problem
    w1q, w1s = quantize_weight(w1, granularity)
    w2q, w2s = quantize_weight(w2, granularity)
    out = fm.fused_experts(hidden, w1q, w2q, weights, ids, config=config, w1_scale=w1s, w2_scale=w2s)
    ref = moe_reference_fp8(hidden, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity=granularity,
                            intermediate_dtype=hidden.dtype)
    assert rel_err(out, ref) < tolerance


@pytest.mark.parametrize("granularity", ["block", "channel", "tensor"])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fp8_summed_split(granularity, swap_ab):
    config = MoEConfig(16, GemmTiles(32, 128, tma=True, persistent=1, swap_ab=swap_ab),
                       GemmTiles(32, 32, split_k=2, tma=True, swap_ab=swap_ab), True)
    check_fp8(make_problem(9, 6, 2, 256, 128, seed=7), granularity, config, 1e-3)


# (K, F, options): K steps of two and four chunks on K that they divide and K that they do not (the last step's
# later chunks past K), with the options that touch the K loop: TMA, the transposed product, both persistent grids
# (2 flattens the tile and K loops), GEMM 2 summed and split over K.
CHUNK_CASES = [(64, 40, {}), (48, 24, dict(swap_ab=True)), (80, 48, dict(tma=True)), (96, 40, dict(persistent=2)),
               (112, 24, dict(persistent=1, swap_ab=True, tma=True)), (64, 48, dict(sum=True, split_k=2))]


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("case", range(len(CHUNK_CASES)))
def test_k_steps_in_chunks(chunks, case):
    """``GemmTiles.k_chunks``: each K step loads ``k_chunks`` K-adjacent chunks of ``block_k`` and multiplies them
    one by one, in K order, so the sums are those of one chunk a step, bit for bit, and match the float64
    reference; on the shapes of ``CHUNK_CASES`` and, for the first, the edge shapes."""
    K, F, options = CHUNK_CASES[case]
    options = dict(options)
    summed, split = options.pop("sum", False), options.pop("split_k", 1)
    dtype = (torch.float32, torch.float16)[case % 2]
    config = MoEConfig(16, GemmTiles(16, 16, k_chunks=chunks, **options),
                       GemmTiles(16, 16, k_chunks=chunks, split_k=split, **options), summed)
    naive = (None, True, False)[case % 3]
    problem = make_problem(9 + case, 5, 2, K, F, dtype, seed=40 + case, fused_topk_like=True)
    check(problem, dtype, config, naive_block_assignment=naive)
    if not summed:   # (fp32 atomics add in any order)
        one = dataclasses.replace(config, gate_up=dataclasses.replace(config.gate_up, k_chunks=1),
                                  down=dataclasses.replace(config.down, k_chunks=1))
        runs = [fm.fused_experts(*problem, config=c, naive_block_assignment=naive) for c in (config, one)]
        assert torch.equal(runs[0], runs[1])
    for shape in sorted(EDGE_SHAPES) if case == 0 else ():
        check(make_problem(**EDGE_SHAPES[shape], hidden=K, inter=F, seed=3), torch.float32, config)


@pytest.mark.parametrize("K, F", [(256, 384), (384, 256)])
def test_a_chunk_past_k_reads_no_scale_past_the_end(K, F):
    """Where two chunks a step do not divide K, the last step's second chunk lies past K: its values load as 0, and
    its scale group, which does not exist, is the last one's. The weights' scales here are the first experts of a
    buffer whose next expert is NaN: a read one group past the last expert's would poison its rows (0 x NaN)."""
    hidden, w1, w2, weights, ids = make_problem(9, 6, 2, K, F, seed=7, fused_topk_like=True)
    w1q, w1s = quantize_weight(w1, "block")
    w2q, w2s = quantize_weight(w2, "block")

    def poisoned(scale):   # the same values, with NaN right after them in memory
        buffer = torch.full((scale.shape[0] + 1, *scale.shape[1:]), float("nan"))
        buffer[:-1] = scale
        return buffer[:-1]

    tiles = GemmTiles(32, 128, k_chunks=2)
    out = fm.fused_experts(hidden, w1q, w2q, weights, ids, config=MoEConfig(16, tiles, tiles),
                           w1_scale=poisoned(w1s), w2_scale=poisoned(w2s))
    ref = moe_reference_fp8(hidden, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity="block",
                            intermediate_dtype=hidden.dtype)
    assert bool(out.isfinite().all()) and rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("granularity", ["block", "channel", "tensor"])
@pytest.mark.parametrize("K, F", [(256, 128), (384, 256), (256, 384)])
def test_fp8_k_steps_in_chunks(granularity, K, F):
    """Block fp8 with two 128-value scale blocks a step (and channel and tensor scales), each chunk's product
    times its own scales, against the float64 reference; K and F of 384 leave the last step's second chunk past K."""
    for swap_ab in (False, True):
        tiles = GemmTiles(32, 128, k_chunks=2, swap_ab=swap_ab, tma=swap_ab)
        check_fp8(make_problem(9, 6, 2, K, F, seed=7, fused_topk_like=True), granularity,
                  MoEConfig(16, tiles, tiles), 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("block_n", [64, 128, 256])
def test_quant_in_gemm_gives_the_quantisers_numbers(dtype, num_tokens, block_n):
    """GEMM 1 quantising GEMM 2's input in its epilogue (``MoEConfig.quant_in_gemm``) gives the same
    bits as GEMM 1 followed by the group quantiser; it runs where GEMM 1's tile holds whole 128-wide
    groups and the weights have block scales, and elsewhere the config asks for it in vain."""
    from moe_kernels._runtime import record_launches

    hidden, w1, w2, weights, ids = make_problem(num_tokens, 6, 2, 256, 256, dtype, seed=40 + num_tokens,
                                                fused_topk_like=True)
    for granularity in ("block", "channel"):
        w1q, w1s = quantize_weight(w1, granularity)
        w2q, w2s = quantize_weight(w2, granularity)
        plain = MoEConfig(16, GemmTiles(block_n, 128, swap_ab=block_n == 64), GemmTiles(32, 128))
        want = fm.fused_experts(hidden, w1q, w2q, weights, ids, config=plain, w1_scale=w1s, w2_scale=w2s)
        with record_launches() as launches:
            got = fm.fused_experts(hidden, w1q, w2q, weights, ids, config=dataclasses.replace(plain, quant_in_gemm=True),
                                   w1_scale=w1s, w2_scale=w2s)
        assert torch.equal(got, want)
        quantised = [settings["quant"] for name, settings in launches if name == "index_gather.gemm"]
        fused = granularity == "block" and block_n >= 128 and not (dtype == torch.bfloat16 and DEVICE.type == "cpu")
        assert quantised == [fused, False]   # (the interpreter's in-kernel bf16 rounding truncates)


def test_quant_in_gemm_with_unchecked_bad_ids():
    """Rows of an out-of-range id (unchecked) are zero rows with a finite scale, as the quantiser
    makes them: the fused epilogue writes them too, and they add nothing."""
    hidden, w1, w2, weights, ids = make_problem(7, 4, 2, 256, 128, seed=41)
    bad = ids.clone()
    bad[2, 1], bad[5, 0] = 9, -3
    w1q, w1s = quantize_weight(w1, "block")
    w2q, w2s = quantize_weight(w2, "block")
    runs = [fm.fused_experts(hidden, w1q, w2q, weights, bad, validate_ids=False, w1_scale=w1s, w2_scale=w2s,
                             config=MoEConfig(16, GemmTiles(128, 128), GemmTiles(32, 128), quant_in_gemm=q))
            for q in (False, True)]
    assert torch.equal(runs[0], runs[1]) and bool(runs[1].isfinite().all())


def test_configs_that_cannot_work_name_their_field():
    tiles = GemmTiles(16, 16)
    cases = [
        (MoEConfig(16, GemmTiles(16, 16, split_k=2), tiles, quant_in_gemm=True), "config.quant_in_gemm"),
        (MoEConfig(16, tiles, GemmTiles(16, 16, split_k=2)), "config.down.split_k"),
        (MoEConfig(16, tiles, GemmTiles(16, 16, split_k=0), True), "config.down.split_k"),
        (MoEConfig(16, tiles, tiles, 1), "config.sum_in_gemm"),
        (MoEConfig(16, GemmTiles(16, 16, tma=1), tiles), "config.gate_up.tma"),
        (MoEConfig(16, tiles, GemmTiles(16, 16, persistent=3)), "config.down.persistent"),
        (MoEConfig(16, GemmTiles(16, 16, swap_ab=1), tiles), "config.gate_up.swap_ab"),
        (MoEConfig(16, tiles, tiles, pdl=1), "config.pdl"),
        (MoEConfig(16, tiles, tiles, quant_in_gemm="yes"), "config.quant_in_gemm"),
        (MoEConfig(16, tiles, GemmTiles(16, 16, k_chunks=3)), "config.down.k_chunks"),
        (MoEConfig(16, GemmTiles(16, 16, k_chunks=0), tiles), "config.gate_up.k_chunks"),
        (MoEConfig(16, GemmTiles(16, 16, k_chunks=2), tiles, stream_lag=4), "config.gate_up.k_chunks"),
    ]
    for config, field in cases:
        with pytest.raises((ValueError, TypeError), match=field.replace(".", r"\.")):
            check_config("f", config)
    for field, bad in (("config.sum_in_gemm", MoEConfig(16, tiles, tiles, True)),
                       ("config.gate_up.tma", MoEConfig(16, GemmTiles(16, 16, tma=True), tiles))):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            check_config("f", bad, align=128, layout="masked")
    # the permute layout sums in GEMM 2 (split K too) and walks a persistent grid
    check_config("f", MoEConfig(16, tiles, GemmTiles(16, 16, split_k=2, persistent=2), True), align=128,
                 layout="permute")
    for layout in ("permute", "masked"):   # (chunked K steps: the index-gather GEMM's only)
        with pytest.raises(ValueError, match=rf"config\.down\.k_chunks.*{layout} layout"):
            check_config("f", MoEConfig(16, tiles, GemmTiles(16, 16, k_chunks=2)), align=128, layout=layout)
    with pytest.raises(ValueError, match=r"config\.down\.swap_ab.*masked layout"):
        check_config("f", MoEConfig(16, tiles, GemmTiles(16, 16, swap_ab=True)), align=128, layout="masked")
    for layout in ("permute", "masked"):
        with pytest.raises(ValueError, match=rf"config\.gate_up\.split_k.*{layout} layout"):
            check_config("f", MoEConfig(16, GemmTiles(16, 16, split_k=2), tiles), align=128, layout=layout)
        for switch in ("pdl", "quant_in_gemm"):
            with pytest.raises(ValueError, match=rf"config\.{switch}.*{layout} layout"):
                check_config("f", MoEConfig(16, tiles, tiles, **{switch: True}), align=128, layout=layout)


def test_pdl_settings_are_checked():
    from moe_kernels.kernels import index_gather

    for kwargs, name in ((dict(trigger=3), "TRIGGER"), (dict(trigger=True), "TRIGGER"),
                         (dict(prefetch_k=-2), "PREFETCH_K"), (dict(prefetch_k=1.5), "PREFETCH_K")):
        with pytest.raises(ValueError, match=name):
            index_gather._pdl_options("wait", 2, **kwargs)
    assert index_gather._pdl_options("wait", 2)["PREFETCH_K"] == -1 and index_gather._pdl_options("", 2) == {}


def test_pdl_is_a_speed_setting_off_where_the_gpu_cannot():
    """``MoEConfig.pdl`` changes no number, round-trips through a table entry, and where there is no
    Hopper to overlap the GEMMs on (here: the interpreter) neither GEMM is launched for it."""
    from moe_kernels._runtime import record_launches

    config = MoEConfig(16, GemmTiles(32, 32), GemmTiles(32, 32), False, pdl=True)
    assert MoEConfig.from_dict(config.to_dict()) == config
    assert MoEConfig.from_dict({"block_m": 16, "gate_up": {"block_n": 16, "block_k": 16},
                                "down": {"block_n": 16, "block_k": 16}}).pdl is False
    problem = make_problem(9, 6, 2, 64, 32, seed=9, fused_topk_like=True)
    with record_launches() as launches:
        check(problem, torch.float32, config)
    gemms = [settings for name, settings in launches if name == "index_gather.gemm"]
    assert len(gemms) == 2 and all(settings["pdl"] == "" for settings in gemms)


def test_stage_options_are_checked():
    hidden, w1, w2, weights, ids = make_problem(4, 3, 2, 32, 16, seed=8)
    blocks = fm.assign_blocks(ids, 16, 3)
    inter = fm.expert_gate_up(hidden, w1, blocks, 2, tiles=GemmTiles(16, 16))
    with pytest.raises(ValueError, match=r"tiles\.split_k.*sum_slots"):
        fm.expert_down(inter, w2, weights, blocks, tiles=GemmTiles(16, 16, split_k=2))
    with pytest.raises(ValueError, match=r"out.*\(4, 32\)"):
        fm.expert_down(inter, w2, weights, blocks, tiles=GemmTiles(16, 16), sum_slots=True,
                       out=torch.zeros(4, 2, 32, device=DEVICE))
    split = fm.expert_gate_up(hidden, w1, blocks, 2, tiles=GemmTiles(16, 16, split_k=2))   # GEMM 1 may split K
    assert rel_err(split, inter) < TOLERANCE[torch.float32]
    for field, value in (("split_k", True), ("persistent", 1.0), ("persistent", True)):
        with pytest.raises((ValueError, TypeError), match=rf"tiles\.{field}"):
            fm.expert_down(inter, w2, weights, blocks, tiles=GemmTiles(16, 16, **{field: value}))


def test_tma_on_weights_the_copy_engine_cannot_describe_falls_back():
    # A speed setting: strided weights (and rows not a multiple of 16 bytes) take pointer loads.
    hidden, w1, w2, weights, ids = make_problem(6, 3, 2, 40, 24, seed=15)
    wide1 = torch.zeros(3, 2 * 24 + 8, 40, device=DEVICE)
    wide1[:, :48] = w1
    config = variant(16, False, 1, True, 1)
    check((hidden, wide1[:, :48], w2, weights, ids), torch.float32, config)


def test_summed_stage_without_out_starts_from_zero():
    hidden, w1, w2, weights, ids = make_problem(5, 4, 2, 32, 16, seed=16)
    blocks = fm.assign_blocks(ids, 16, 4)
    inter = fm.expert_gate_up(hidden, w1, blocks, 2, tiles=GemmTiles(16, 16))
    out = fm.expert_down(inter, w2, weights, blocks, tiles=GemmTiles(16, 16, split_k=2), sum_slots=True)
    assert rel_err(out, moe_reference(hidden, w1, w2, weights, ids)) < TOLERANCE[torch.float32]


def test_summed_stage_adds_into_out():
    hidden, w1, w2, weights, ids = make_problem(5, 4, 2, 32, 16, seed=9)
    blocks = fm.assign_blocks(ids, 16, 4)
    inter = fm.expert_gate_up(hidden, w1, blocks, 2, tiles=GemmTiles(16, 16))
    start = torch.ones(5, 32, device=DEVICE)
    out = fm.expert_down(inter, w2, weights, blocks, tiles=GemmTiles(16, 16, split_k=2), sum_slots=True, out=start)
    assert out is start
    assert rel_err(out - 1, moe_reference(hidden, w1, w2, weights, ids)) < TOLERANCE[torch.float32]


_COMPILE_FOR_HOPPER = """
import re, sys
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import index_gather as ig
from moe_kernels.sm90_compile import compile_for_sm90

fn = ig._index_gather_gemm_kernel
for dtype, scales, swap in (("bf16", 0, False), ("bf16", 0, True), ("fp8e4nv", 1, True)):
    pointers = dict(a_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*bf16", topk_weights_ptr="*fp32",
                    sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32",
                    a_scale_ptr="*fp32", w_scale_ptr="*fp32", w_desc="*" + dtype)
    const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, TOP_K=8, NAIVE_BLOCKS=False, DENSE=False, GATED=True,
                 MUL_ROUTED_WEIGHT=False, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=scales, SUM_TOP_K=0, SPLIT_K=1,
                 TMA_W=False, PERSISTENT=0, SCALE_BN=128, SCALE_BK=128, ID_CHECK="", SWAP_AB=swap,
                 PDL_TRIGGER=False, PDL_WAIT=False, PREFETCH_LINE=64, QUANT_GROUP=0, ROUND_TO="")
    ptx = compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=3).asm["ptx"]
    print(dtype, swap, "wgmma" in ptx, len(re.findall(r"mma[.]sync", ptx)) > 0)
"""


def test_swap_ab_reaches_hoppers_wgmma():
    """Compiled for an H100/H200 (sm_90) on this machine, no GPU needed: a 16-row tile of GEMM 1 is
    ``mma.sync``; transposed (``swap_ab``, 64 weight rows on the M side) it is a wgmma, in bf16 and
    in fp8 with block scales. (The interpreter runs a kernel as Python, so it cannot tell whether
    the compiler accepts it: the first swap_ab kernel returned two shapes from one helper, which
    Python allows and Triton refuses.)"""
    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    expected = ["bf16 False False True", "bf16 True True False", "fp8e4nv True True False"]
    assert lines[:3] == expected, lines


_COMPILE_SWITCHES_FOR_HOPPER = """
import sys
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import index_gather as ig
from moe_kernels.sm90_compile import compile_for_sm90

fn = ig._index_gather_gemm_kernel
cases = [dict(PDL_TRIGGER=True, GATED=True), dict(PDL_WAIT=True), dict(PDL_WAIT=True, NAIVE_BLOCKS=True), dict(),
         dict(GATED=True, SCALES=1, QUANT_GROUP=128, ROUND_TO="bf16")]
for case in cases:
    fp8 = case.get("SCALES", 0) == 1
    pointers = dict(a_ptr="*fp8e4nv" if fp8 else "*bf16", w_ptr="*fp8e4nv" if fp8 else "*bf16",
                    out_ptr="*fp8e4nv" if "QUANT_GROUP" in case else "*bf16", topk_weights_ptr="*fp32",
                    sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32",
                    a_scale_ptr="*fp32", w_scale_ptr="*fp32", w_desc="*bf16", out_scale_ptr="*fp32")
    const = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, TOP_K=1, NAIVE_BLOCKS=False, DENSE=False,
                 GATED=False, MUL_ROUTED_WEIGHT=False, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=0, SUM_TOP_K=0,
                 SPLIT_K=1, TMA_W=False, PERSISTENT=0, SCALE_BN=128, SCALE_BK=128, ID_CHECK="", SWAP_AB=False,
                 PDL_TRIGGER=False, PDL_WAIT=False, PREFETCH_LINE=64, QUANT_GROUP=0, ROUND_TO="")
    const.update(case, MUL_ROUTED_WEIGHT=not case.get("GATED", False))
    ptx = compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=3, launch_pdl=const["PDL_WAIT"]).asm["ptx"]
    found = ["griddepcontrol.launch_dependents", "griddepcontrol.wait", "prefetch.global.L2", "e4m3x2.f32"]
    print(" ".join(str(word in ptx) for word in found))
# GEMM 2 on the naive map with the ids' check (where the layer puts it), with the switches of
# Qwen3's fp8 one-token GEMM 2 (block-scaled fp8, TMA weights, swapped operands, a programmatic
# dependent) and, as from two tokens on, each expert's assignments in one block (NAIVE_GROUP);
# the assert's call is in the code.
from moe_kernels._runtime import device_assert_options
pointers = dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", out_ptr="*bf16", topk_weights_ptr="*fp32",
                sorted_token_ids_ptr="*i64", expert_ids_ptr="*i64", num_tokens_post_padded_ptr="*i64",
                a_scale_ptr="*fp32", w_scale_ptr="*fp32", w_desc="tensordesc<fp8e4nv[128,128]>", out_scale_ptr="*fp32")
const = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, TOP_K=1, NAIVE_BLOCKS=True, DENSE=False, GATED=False,
             MUL_ROUTED_WEIGHT=True, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=1, SUM_TOP_K=0, SPLIT_K=1,
             TMA_W=True, PERSISTENT=0, SCALE_BN=128, SCALE_BK=128, ID_CHECK="topk_ids out of range", SWAP_AB=True,
             PDL_TRIGGER=False, PDL_WAIT=True, PREFETCH_LINE=64, QUANT_GROUP=0, ROUND_TO="", NAIVE_GROUP=64)
ptx = compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=4, launch_pdl=True,
                       **device_assert_options(const["ID_CHECK"])).asm["ptx"]
print("__assertfail" in ptx, "griddepcontrol.wait" in ptx)
"""


_COMPILE_SPLIT_GATE_UP_FOR_HOPPER = """
import re
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import activation, index_gather as ig
from moe_kernels.sm90_compile import compile_for_sm90

def ptx(fn, pointers, const, **options):
    return compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=3, **options).asm["ptx"]

for fp8, naive in ((False, True), (True, False)):
    pointers = dict(a_ptr="*fp8e4nv" if fp8 else "*bf16", w_ptr="*fp8e4nv" if fp8 else "*bf16", out_ptr="*fp32",
                    topk_weights_ptr="*fp32", sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32",
                    num_tokens_post_padded_ptr="*i32", a_scale_ptr="*fp32", w_scale_ptr="*fp32", w_desc="*bf16",
                    out_scale_ptr="*fp32")
    const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, TOP_K=8, NAIVE_BLOCKS=naive, DENSE=False,
                 GATED=False, MUL_ROUTED_WEIGHT=False, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=int(fp8),
                 SUM_TOP_K=1, SPLIT_K=4, TMA_W=False, PERSISTENT=0, SCALE_BN=128, SCALE_BK=128,
                 ID_CHECK="topk_ids out of range" if naive else "", SWAP_AB=False, PDL_TRIGGER=False,
                 PDL_WAIT=False, PREFETCH_LINE=64, QUANT_GROUP=0, ROUND_TO="")
    code = ptx(ig._index_gather_gemm_kernel, pointers, const, debug=naive)
    print(bool(re.search(r"(red|atom)\\.global\\.[a-z.]*add\\.f32", code)))   # the K slices' fp32 atomics
code = ptx(activation._silu_mul_kernel, dict(h_ptr="*fp32", out_ptr="*bf16"), dict(BLOCK=1024))
print("cvt.rn.bf16" in code)
"""


def test_split_gate_up_compiles_for_hopper():
    """GEMM 1 split over K (ungated over 2F rows, K slices added with fp32 atomics; bf16 on the
    naive map with its id check, fp8 block on the aligned one) and the SiLU·mul kernel compile for
    sm_90; the atomics and the round-to-nearest bf16 store are in the PTX."""
    lines = compiled_for_hopper(_COMPILE_SPLIT_GATE_UP_FOR_HOPPER)
    assert lines[:3] == ["True", "True", "True"], lines


def test_switches_compile_for_hopper():
    """Compiled for sm_90 on this machine (the interpreter never takes these branches): GEMM 1 with
    ``PDL_TRIGGER`` signals its dependents; GEMM 2 with ``PDL_WAIT`` prefetches its weights into L2
    and waits, on the aligned and the naive block map; with neither, no such instruction; an fp8
    GEMM 1 with ``QUANT_GROUP`` converts its output to e4m3 in the epilogue; an fp8 GEMM 2 on the
    naive map with the ids' check (TMA, swapped operands, PDL) carries the assert."""
    pytest.importorskip("triton.language.extra.cuda.gdc")
    lines = compiled_for_hopper(_COMPILE_SWITCHES_FOR_HOPPER)
    assert lines[:6] == ["True False False False", "False True True False", "False True True False",
                         "False False False False", "False False False True", "True True"], lines


_COMPILE_CHUNKS_FOR_HOPPER = """
import torch
import triton
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import index_gather as ig
from moe_kernels.sm90_compile import assemble_for_sm90, compile_for_sm90

# DeepSeek-V3's fp8 GEMM 2 entry at 512 tokens (TMA, transposed, 256 weight rows, 8 warps) and its GEMM 1
# (cp.async, transposed, 64 gate and 64 up rows), one and two chunks a K step.
for gated, block_n, warps, tma in ((False, 256, 8, True), (True, 64, 4, False)):
    for chunks, stages in ((1, 3), (2, 3)):
        pointers = dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", out_ptr="*bf16", topk_weights_ptr="*fp32",
                        sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32",
                        a_scale_ptr="*fp32", w_scale_ptr="*fp32",
                        w_desc=f"tensordesc<fp8e4nv[{block_n},128]>" if tma else "*fp8e4nv", out_scale_ptr="*fp32")
        const = dict(BLOCK_M=32, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, TOP_K=1 if not gated else 8,
                     NAIVE_BLOCKS=False, DENSE=False, GATED=gated, MUL_ROUTED_WEIGHT=not gated, EVEN_K=True,
                     INPUT_PRECISION="tf32", SCALES=1, SUM_TOP_K=0, SPLIT_K=1, TMA_W=tma, PERSISTENT=0, SCALE_BN=128,
                     SCALE_BK=128, ID_CHECK="", SWAP_AB=True, PDL_TRIGGER=False, PDL_WAIT=False, PREFETCH_LINE=64,
                     QUANT_GROUP=0, ROUND_TO="", K_CHUNKS=chunks)
        ptx = compile_for_sm90(ig._index_gather_gemm_kernel, const, pointers, num_warps=warps, num_stages=stages,
                               aligned=("N", "K", "stride_am", "stride_we", "stride_wn", "stride_om", "stride_as",
                                        "stride_wse", "stride_wsn", "stride_wsk")).asm["ptx"]
        spills = 0
        if triton.__version__.startswith("3.6."):   # (a newer Triton's ptxas may not read its own PTX)
            built = assemble_for_sm90(ptx)
            spills = built["spill_stores"] + built["spill_loads"]
        copies = ptx.count("cp.async.bulk.tensor") if tma else ptx.count("cp.async.cg")
        print(gated, chunks, copies, ptx.count("wgmma.mma_async"), spills)
"""


def test_chunked_k_steps_compile_for_hopper():
    """Two chunks a K step, compiled for sm_90 with Triton's pipeline: each chunk's weight tile is one more copy
    in flight (TMA or cp.async), each its own wgmma (DeepSeek-V3's fp8 decode tiles); and, where the Triton is the
    H200's, 3.6 (CI's second pass; a newer Triton's ptxas may not read its own PTX), nothing spills."""
    lines = [line.split() for line in compiled_for_hopper(_COMPILE_CHUNKS_FOR_HOPPER) if line]
    (g2_one, g2_two, g1_one, g1_two) = [[int(v) for v in line[1:]] for line in lines[:4]]
    assert g2_two[1] == 2 * g2_one[1] and g2_two[2] == 2 * g2_one[2] and g2_one[1] > 0, lines
    assert g1_two[1] == 2 * g1_one[1] and g1_two[2] == 2 * g1_one[2] and g1_one[1] > 0, lines
    assert g2_one[3] == g2_two[3] == g1_one[3] == g1_two[3] == 0, lines   # (no spills)


# ---- GPU: the models' own shapes, bf16 and fp8, and CUDA-graph capture -----------------------------


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 600])
@pytest.mark.parametrize("options", VARIANTS)
def test_qwen3_shape_bf16_gpu(num_tokens, options):
    problem = make_problem(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=num_tokens, fused_topk_like=True)
    check(problem, torch.bfloat16, variant(16 if num_tokens < 600 else 64, *options, block_n=64, block_k=128))


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_gate_up_split_over_k_gpu(num_tokens, split, fp8):
    """GEMM 1 split over K at Qwen3-30B-A3B's shape and the decode tiles, bf16 and fp8 block."""
    problem = make_problem(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=20 + num_tokens, fused_topk_like=True)
    config = split_up(MoEConfig(16, GemmTiles(64, 128, num_stages=4), GemmTiles(128, 128, num_stages=4)), split)
    if fp8:
        check_fp8(problem, "block", config, 2e-2)
    else:
        check(problem, torch.bfloat16, config)


@needs_gpu
@pytest.mark.parametrize("persistent", [1, 2])
def test_persistent_large_tiles_gpu(persistent):
    # Prefill-sized tiles at 4,096 tokens over 64 experts: each persistent program walks many tiles.
    problem = make_problem(4096, 64, 8, 1024, 512, torch.bfloat16, seed=14, fused_topk_like=True)
    tiles = GemmTiles(128, 64, 8, 8, 3, tma=True, persistent=persistent)
    check(problem, torch.bfloat16, MoEConfig(128, tiles, tiles))


@needs_gpu
@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fp8_gpu(granularity, swap_ab):
    problem = make_problem(200, 64, 8, 1024, 512, torch.bfloat16, seed=10, fused_topk_like=True)
    config = MoEConfig(16, GemmTiles(64, 128, tma=True, persistent=2, swap_ab=swap_ab),
                       GemmTiles(128, 128, split_k=2, tma=True, swap_ab=swap_ab), True)
    check_fp8(problem, granularity, config, 2e-2)


@needs_gpu
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fp8_k_steps_in_chunks_gpu(chunks, swap_ab):
    """Chunked K steps compiled: block fp8 at DeepSeek-V3's K (7168 and 2048 divide 256 and 512) and at a K that
    two chunks do not divide (640: the last step's second chunk past K)."""
    for hidden, inter in ((7168, 2048), (640, 384)):
        problem = make_problem(64, 16, 8, hidden, inter, torch.bfloat16, seed=15, fused_topk_like=True)
        tiles = GemmTiles(64, 128, num_stages=2, k_chunks=chunks, tma=swap_ab, swap_ab=swap_ab)
        check_fp8(problem, "block", MoEConfig(32, tiles, tiles), 2e-2)


def replayed_outputs(problem, config, seeds):
    """``fused_experts`` captured in a CUDA graph (after a warm-up call on a side stream), then
    replayed on fresh hidden states, one per seed: yields after each replay (``out`` is the graph's
    output buffer)."""
    hidden, w1, w2, weights, ids = problem
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fm.fused_experts(hidden, w1, w2, weights, ids, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_experts(hidden, w1, w2, weights, ids, config=config)
    for seed in seeds:
        hidden.copy_(torch.randn(*hidden.shape, generator=torch.Generator().manual_seed(seed)).to(hidden))
        graph.replay()
        torch.cuda.synchronize()
        yield out


@needs_gpu
def test_summed_split_tma_captures_and_replays():
    problem = make_problem(40, 32, 4, 512, 256, torch.bfloat16, seed=11, fused_topk_like=True)
    for out in replayed_outputs(problem, variant(16, True, 2, True, 2, block_n=64, block_k=128), (12, 13)):
        assert rel_err(out, moe_reference(*problem)) < 1e-2


@needs_gpu
@pytest.mark.parametrize("naive", [False, True])
def test_gate_up_split_captures_and_replays(naive):
    """GEMM 1 split over K inside a CUDA graph: the zero-fill and the SiLU·mul launch are captured
    and replayed with it, on new hidden states, with GEMM 2 as a programmatic dependent too."""
    problem = make_problem(6 if naive else 40, 32, 4, 512, 256, torch.bfloat16, seed=18, fused_topk_like=True)
    config = dataclasses.replace(split_up(variant(16, False, 1, False, block_n=64, block_k=128), 4), pdl=True)
    hidden, w1, w2, weights, ids = problem
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fm.fused_experts(hidden, w1, w2, weights, ids, config=config, naive_block_assignment=naive)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_experts(hidden, w1, w2, weights, ids, config=config, naive_block_assignment=naive)
    for seed in (19, 20):
        hidden.copy_(torch.randn(*hidden.shape, generator=torch.Generator().manual_seed(seed)).to(hidden))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, moe_reference(*problem)) < 1e-2


def _deterministic(config: MoEConfig, pdl: bool) -> MoEConfig:
    """``config`` without the atomic sums (the top-k sum, either GEMM's K split: so two runs give the
    same bits), as two launches (the fp8 table's stream of both GEMMs at 256-512 tokens always
    quantises in GEMM 1 and has no dependent launch, which these tests count), ``pdl`` as asked."""
    return dataclasses.replace(config, sum_in_gemm=False, gate_up=dataclasses.replace(config.gate_up, split_k=1),
                               down=dataclasses.replace(config.down, split_k=1), pdl=pdl, stream_lag=None)


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 600])
@pytest.mark.parametrize("fp8", [False, True])
def test_pdl_changes_no_number_gpu(num_tokens, fp8):
    """GEMM 2 launched as a programmatic dependent of GEMM 1 (Hopper) computes the same bits as
    without, at Qwen3-30B-A3B's shape on its tuned tiles, and each GEMM takes its role (on a GPU
    before Hopper, neither)."""
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels.config import get_config

    hidden, w1, w2, weights, ids = make_problem(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=20 + num_tokens,
                                                fused_topk_like=True)
    scales = {}
    if fp8:
        w1, w1_scale = quantize_weight(w1, "block")
        w2, w2_scale = quantize_weight(w2, "block")
        scales = dict(w1_scale=w1_scale, w2_scale=w2_scale)
    tuned = get_config(num_tokens, 128, 768, 2048, w1.dtype, "cuda")
    plain = fm.fused_experts(hidden, w1, w2, weights, ids, config=_deterministic(tuned, False), **scales)
    with record_launches() as launches:
        overlapped = fm.fused_experts(hidden, w1, w2, weights, ids, config=_deterministic(tuned, True), **scales)
    roles = [settings["pdl"] for name, settings in launches if name == "index_gather.gemm"]
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert roles == (["trigger", "wait"] if hopper else ["", ""])
    assert torch.equal(overlapped, plain)


@needs_gpu
def test_pdl_captures_and_replays():
    """A CUDA graph of the layer with GEMM 2 as a programmatic dependent replays new inputs to the
    same bits as an eager call without it."""
    problem = make_problem(8, 128, 8, 2048, 768, torch.bfloat16, seed=31, fused_topk_like=True)
    config = MoEConfig(16, GemmTiles(64, 128, swap_ab=True), GemmTiles(128, 128), False, pdl=True)
    for out in replayed_outputs(problem, config, (32, 33)):
        want = fm.fused_experts(*problem, config=dataclasses.replace(config, pdl=False))
        assert torch.equal(out, want)


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 600])
@pytest.mark.parametrize("shape", [(128, 8, 2048, 768), (64, 8, 7168, 2048)])   # Qwen3; DeepSeek-V3, 64 experts
def test_quant_in_gemm_gpu(num_tokens, shape):
    """On the GPU, with bf16 activations at both models' d and F: GEMM 1 quantising GEMM 2's input
    gives the bits of GEMM 1 then the quantiser, with one quantiser launch fewer (and with PDL)."""
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels.config import get_config

    experts, top_k, d, f = shape
    hidden, w1, w2, weights, ids = make_problem(num_tokens, experts, top_k, d, f, torch.bfloat16, seed=50 + num_tokens,
                                                fused_topk_like=True)
    w1, w1_scale = quantize_weight(w1, "block")
    w2, w2_scale = quantize_weight(w2, "block")
    tuned = _deterministic(get_config(num_tokens, experts, f, d, w1.dtype, "cuda"), False)
    tuned = dataclasses.replace(tuned, gate_up=dataclasses.replace(tuned.gate_up, block_n=128))
    runs = {}
    for quant, pdl in ((False, False), (True, False), (True, True)):
        with record_launches() as launches:
            runs[quant, pdl] = fm.fused_experts(hidden, w1, w2, weights, ids, w1_scale=w1_scale, w2_scale=w2_scale,
                                                config=dataclasses.replace(tuned, quant_in_gemm=quant, pdl=pdl))
        quantisers = sum(name == "quant.groups" for name, _ in launches)
        assert quantisers == (1 if quant else 2)   # the hidden states' quantiser, and GEMM 2's unless fused
    assert torch.equal(runs[True, False], runs[False, False]) and torch.equal(runs[True, True], runs[False, False])


@needs_gpu
@pytest.mark.parametrize("options", [VARIANTS[1], VARIANTS[6], VARIANTS[7], VARIANTS[10]])
def test_pdl_with_the_other_machinery_gpu(options):
    """GEMM 2 as a programmatic dependent with the atomic top-k sum and split-K, a persistent grid,
    TMA and the transposed tile (the atomics' order varies: checked against the float64 reference)."""
    problem = make_problem(64, 128, 8, 2048, 768, torch.bfloat16, seed=60, fused_topk_like=True)
    check(problem, torch.bfloat16, dataclasses.replace(variant(16, *options, block_n=64, block_k=128), pdl=True))


_COMPILE_FLATTENED_FOR_HOPPER = """
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import contiguous_gemm as pm, index_gather as ig
from moe_kernels.sm90_compile import compile_for_sm90, loop_nesting

aligned = ("stride_am", "stride_we", "stride_wn", "stride_om", "N", "K")
for persistent in (1, 2):
    pointers = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", topk_weights_ptr="*fp32",
                    sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32",
                    a_scale_ptr="*fp32", w_scale_ptr="*fp32", w_desc="tensordesc<bf16[256, 128]>")
    const = dict(BLOCK_M=32, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, TOP_K=8, NAIVE_BLOCKS=False, DENSE=False, GATED=False,
                 MUL_ROUTED_WEIGHT=True, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=0, SUM_TOP_K=0, SPLIT_K=1,
                 TMA_W=True, PERSISTENT=persistent, SCALE_BN=128, SCALE_BK=128, ID_CHECK="", SWAP_AB=True,
                 PDL_TRIGGER=False, PDL_WAIT=False, PREFETCH_LINE=64, QUANT_GROUP=0, ROUND_TO="")
    ttgir = compile_for_sm90(ig._index_gather_gemm_kernel, const, pointers, num_warps=4, num_stages=3,
                             aligned=aligned).asm["ttgir"]
    pointers = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", m_indices_ptr="*i32", a_scale_ptr="*fp32",
                    w_scale_ptr="*fp32", rows_used_ptr="*i32", row_assign_ptr="*i32", topk_weights_ptr="*fp32",
                    w_desc="tensordesc<bf16[128, 64]>", a_desc="tensordesc<bf16[128, 64]>")
    const = dict(GATED=True, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=0, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                 SCALE_BN=128, SCALE_BK=128, TMA_W=True, TMA_A=True, SWAP_AB=False, GROUP_M=8, PERSISTENT=persistent,
                 SUM_TOP_K=0, SPLIT_K=1, GATHER_TOP_K=0, SHORT_LAST=0, M_STEP=1)
    ttgir_permute = compile_for_sm90(pm._contiguous_gemm_kernel, const, pointers, num_warps=8, num_stages=3,
                                     aligned=aligned).asm["ttgir"]
    print(persistent, loop_nesting(ttgir), loop_nesting(ttgir_permute))
"""


_COMPILE_GEMM_1_BEHIND_THE_ROUTER = """
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import index_gather as ig
from moe_kernels.sm90_compile import compile_for_sm90

aligned = ("stride_am", "stride_we", "stride_wn", "stride_om", "N", "K")
pointers = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", topk_weights_ptr="*fp32", sorted_token_ids_ptr="*i32",
                expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32", a_scale_ptr="*fp32", w_scale_ptr="*fp32")
for persistent in (0, 2):   # one tile per program; the flattened persistent loop (it reads the block map's length)
    const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, TOP_K=8, NAIVE_BLOCKS=False, DENSE=False, GATED=True,
                 MUL_ROUTED_WEIGHT=False, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=0, SUM_TOP_K=0, SPLIT_K=1,
                 TMA_W=False, PERSISTENT=persistent, SCALE_BN=128, SCALE_BK=128, ID_CHECK="", SWAP_AB=False,
                 PDL_TRIGGER=1, PDL_WAIT=True, PREFETCH_LINE=64, PREFETCH_K=0, QUANT_GROUP=0, ROUND_TO="")
    ptx = compile_for_sm90(ig._index_gather_gemm_kernel, const, pointers, num_warps=4, num_stages=3,
                           aligned=aligned).asm["ptx"]
    wait, trigger, load = (ptx.find(op) for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                    "ld.global"))
    print(persistent, 0 <= wait < trigger, 0 <= wait < load)
"""


def test_gemm_1_behind_the_router_reads_nothing_before_its_wait_for_hopper():
    """GEMM 1 as the chained router's dependent ("wait+trigger"), compiled for sm_90: its first global load comes after
    its wait (the block map is the router's, still being written before it), and it lets GEMM 2 launch only after the
    wait, in one tile per program and in the flattened persistent loop, which reads the block map's length."""
    lines = compiled_for_hopper(_COMPILE_GEMM_1_BEHIND_THE_ROUTER)
    assert lines[:2] == ["0 True True", "2 True True"], lines


def test_flattened_persistent_loops_fuse_for_hopper():
    """``persistent=2`` asks Triton to flatten a persistent program's tile loop and K loop into one software
    pipeline (the next tile's first loads under this tile's epilogue). Triton 3.6 does so only when the
    K loop sits under no branch and runs as many steps in every tile; until the tile bodies were written
    for it (``FLAT``), both layouts compiled ``persistent=2`` exactly like ``persistent=1``: a loop in a loop.
    Compiled for sm_90 here: with 1 the K loop stays inside the tile loop, with 2 there is one loop."""
    lines = compiled_for_hopper(_COMPILE_FLATTENED_FOR_HOPPER)
    assert lines[:2] == ["1 2 2", "2 1 1"], lines

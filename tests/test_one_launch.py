"""Both expert GEMMs in one launch (moe_kernels/kernels/one_launch.py) against the float64 per-token
reference: random shapes and the edge cases, slices that do not divide F, tiles wider than d,
every fp8 format (W8A16: the weights dequantised, the activations not), ids out of range, and
which kernel a call launches.

Runs on default_device(): the Triton interpreter on a CPU machine (float32 and float16), the
compiled kernel on a GPU (bf16 and fp8 at the models' own shapes too).
"""

import dataclasses
import random

import pytest
import torch

from moe_kernels._runtime import BACKEND, record_launches
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import GemmTiles, MoEConfig, check_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.layer import MoELayer
from moe_kernels.model.shapes import MODELS
from moe_kernels.kernels.one_launch import (OneLaunchTiles, grid_programs, one_launch_experts,
                                            one_launch_reference)
from moe_kernels.reference import moe_reference
from moe_testing import (DEVICE, EDGE_SHAPES, ON_GPU, TOLERANCE, assert_device_assert, check_one_launch,
                         compiled_for_hopper, make_problem, needs_gpu, rel_err, skewed_problems)

pytestmark = pytest.mark.usefixtures("true_fp32")

SMALL = OneLaunchTiles(block_f=16, block_d=16)
#: The two-phase kernel (moe_kernels/kernels/two_phase.py; its own tests in tests/test_two_phase.py) shares the
#: edge cases and the id tests here.
TWO_PHASE = OneLaunchTiles(block_f=16, block_d=16, phases=2, block_k=16, num_stages=2)
BOTH = pytest.mark.parametrize("tiles", [SMALL, TWO_PHASE], ids=["one phase", "two phases"])


def check(problem, dtype, tiles=SMALL, **kwargs):
    return check_one_launch(problem, dtype, tiles, **kwargs)


@pytest.mark.parametrize("phases", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed, phases):
    rnd = random.Random(900 * phases + seed)
    num_experts = rnd.randint(1, 9)
    dtype = (torch.float32, torch.float16)[seed % 2]
    problem = make_problem(rnd.randint(1, 12), num_experts, rnd.randint(1, num_experts),
                           rnd.choice([16, 40, 64]), rnd.choice([8, 24, 40]), dtype, seed=seed,
                           fused_topk_like=seed % 3 == 0)
    if phases == 1:
        tiles = OneLaunchTiles(rnd.choice([8, 16, 32]), rnd.choice([16, 32, 128]), 4, rnd.choice([1, 3]))
    else:   # (units of 16-32 GEMM 1 rows and 16-64 output rows, K steps of 16-64, 1 or 4 programs an SM)
        tiles = OneLaunchTiles(rnd.choice([16, 32]), rnd.choice([16, 32, 64]), 4, rnd.choice([1, 2, 3]), phases=2,
                               block_k=rnd.choice([16, 32, 64]), programs_per_sm=rnd.choice([1, 4]),
                               swap_ab=seed % 2 == 1,   # (the weights as the MMA's A operand, or the token)
                               k_chunks=rnd.choice([1, 2, 4]))   # (more cases: test_two_phase.py)
    check(problem, dtype, tiles)


@BOTH
@pytest.mark.parametrize("case", sorted(EDGE_SHAPES))
def test_edge_cases(case, tiles):
    check(make_problem(**EDGE_SHAPES[case], hidden=48, inter=40, seed=3), torch.float32, tiles)


@BOTH
def test_an_idle_expert_and_every_token_on_one(tiles):
    for problem in skewed_problems():
        check(problem, torch.float32, tiles)


@BOTH
def test_bf16_rounds_h_to_nearest_as_the_reference(tiles):
    # (under the interpreter the launch runs in float32: h is still rounded to bf16, by its bits)
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 64, 32, torch.bfloat16, seed=12)
    out = one_launch_experts(hidden, w1, w2, weights, ids, tiles=tiles)
    ref = one_launch_reference(hidden, w1, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    # (without rounding h, about a third of the outputs differ from the reference by an ulp)
    assert float((out != ref).float().mean()) < 0.05


@BOTH
def test_no_tokens(tiles):
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 32, 16, seed=4)
    out = one_launch_experts(hidden[:0], w1, w2, weights[:0], ids[:0], tiles=tiles)
    assert out.shape == (0, 32)


def test_the_same_answer_as_fused_experts():
    hidden, w1, w2, weights, ids = make_problem(2, 6, 3, 64, 32, seed=5)
    ours = one_launch_experts(hidden, w1, w2, weights, ids, tiles=SMALL)
    assert rel_err(ours, fused_experts(hidden, w1, w2, weights, ids).double()) < 1e-5


def test_grid_and_the_launch_it_names():
    hidden, w1, w2, weights, ids = make_problem(3, 5, 2, 32, 40, seed=6)
    assert grid_programs(3, 2, 40, SMALL) == 3 * 2 * 3   # 40 rows of F in slices of 16: 3
    if BACKEND == "torch":
        pytest.skip("no Triton here: the torch reference runs")
    with record_launches() as launches:
        one_launch_experts(hidden, w1, w2, weights, ids, tiles=SMALL)
    assert launches == [("one_launch.experts", {"format": "unquantized", **SMALL.as_dict(), "add": False})]


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
def test_fp8_formats_are_w8a16(fmt):
    # d and F of whole 128 blocks; the weights dequantised exactly, the activations unquantised
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 256, 128, seed=7)
    (q1, s1), (q2, s2) = FORMATS[fmt].quantize_weight(w1), FORMATS[fmt].quantize_weight(w2)
    out = one_launch_experts(hidden, q1, q2, weights, ids, tiles=OneLaunchTiles(32, 64), w1_scale=s1, w2_scale=s2)
    dequantized = (FORMATS[fmt].dequantize_weight(q.float(), s) for q, s in ((q1, s1), (q2, s2)))
    assert rel_err(out, moe_reference(hidden, *dequantized, weights, ids)) < 1e-5
    assert rel_err(out, one_launch_reference(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2).double()) < 1e-5


@BOTH
def test_unchecked_bad_ids_add_nothing_and_spoil_no_other_token(tiles):
    hidden, w1, w2, weights, ids = make_problem(4, 5, 2, 32, 16, seed=8)
    bad = ids.clone()
    bad[1, 0], bad[2, 1] = 5, -3
    out = one_launch_experts(hidden, w1, w2, weights, bad, tiles=tiles, validate_ids=False)
    kept = torch.where((bad >= 0) & (bad < 5), weights, torch.zeros_like(weights))
    assert rel_err(out, moe_reference(hidden, w1, w2, kept, bad.clamp(0, 4))) < 1e-5


@BOTH
def test_bad_ids_are_named(tiles):
    hidden, w1, w2, weights, ids = make_problem(2, 4, 2, 32, 16, seed=9)
    bad = ids.clone()
    bad[0, 1] = 4
    if ON_GPU:
        assert_device_assert(f"""
            from moe_kernels.kernels.config import OneLaunchTiles
            from moe_kernels.kernels.one_launch import one_launch_experts
            x, w1, w2 = (torch.randn(*s, device="cuda") for s in ((2, 32), (4, 32, 32), (4, 32, 16)))
            one_launch_experts(x, w1, w2, torch.rand(2, 2, device="cuda"),
                               torch.tensor({bad.tolist()}, device="cuda"),
                               tiles=OneLaunchTiles(**{tiles.as_dict()}))""",
                             "one_launch_experts: argument 'topk_ids' must hold expert ids in [0, 4)")
        return
    with pytest.raises(ValueError, match=r"one_launch_experts: argument 'topk_ids' must hold expert ids in \[0, 4\)"):
        one_launch_experts(hidden, w1, w2, weights, bad, tiles=tiles)


@pytest.mark.parametrize("name, value, message", [
    ("block_f", 256, "must be <= 128"), ("block_f", 24, "must be a power of two"),
    ("block_d", 8, "must be >= 16"), ("num_warps", 3, "must be a power of two"), ("num_stages", 0, "must be >= 1")])
def test_bad_tiles_are_named(name, value, message):
    with pytest.raises(ValueError, match=f"OneLaunchTiles: argument '{name}' {message}"):
        OneLaunchTiles(**{**SMALL.as_dict(), name: value})


def test_tiles_of_another_type_are_named():
    hidden, w1, w2, weights, ids = make_problem(1, 4, 2, 32, 16, seed=10)
    with pytest.raises(TypeError, match="one_launch_experts: argument 'tiles' must be a OneLaunchTiles"):
        one_launch_experts(hidden, w1, w2, weights, ids, tiles={"block_f": 16})


# ---- as a tile choice: MoEConfig.one_launch -------------------------------------------------------------

ONE = MoEConfig(16, GemmTiles(16, 16), GemmTiles(16, 16), one_launch=SMALL)


def test_config_round_trip_and_old_tables():
    assert MoEConfig.from_dict(ONE.to_dict()) == ONE
    plain = MoEConfig(16, GemmTiles(16, 16), GemmTiles(16, 16))
    assert "one_launch" not in plain.to_dict() and MoEConfig.from_dict(plain.to_dict()) == plain
    with pytest.raises(ValueError, match=r"argument 'd\['one_launch'\]' must be None or a dict of OneLaunchTiles"):
        MoEConfig.from_dict({**plain.to_dict(), "one_launch": {"block_f": 16, "block_z": 2}})


@pytest.mark.parametrize("layout", ["permute", "masked"])
def test_other_layouts_refuse_it(layout):
    with pytest.raises(ValueError, match=f"argument 'config.one_launch' must be None for the {layout} layout"):
        check_config("f", ONE, layout=layout)
    with pytest.raises(TypeError, match="argument 'config.one_launch' must be None or a OneLaunchTiles"):
        check_config("f", dataclasses.replace(ONE, one_launch={"block_f": 16}))


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton here: the torch reference runs")
def test_fused_experts_takes_it_only_without_a_block_map():
    hidden, w1, w2, weights, ids = make_problem(3, 6, 2, 32, 16, seed=11)
    ref = moe_reference(hidden, w1, w2, weights, ids)
    with record_launches() as launches:
        out = fused_experts(hidden, w1, w2, weights, ids, config=ONE)
    assert [name for name, _ in launches] == ["one_launch.experts"] and rel_err(out, ref) < 1e-5
    blocks = assign_blocks(ids, 16, 6)
    with record_launches() as launches:
        out = fused_experts(hidden, w1, w2, weights, ids, config=ONE, blocks=blocks)
    assert "one_launch.experts" not in [name for name, _ in launches] and rel_err(out, ref) < 1e-5


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton here: the torch reference runs")
@pytest.mark.parametrize("fmt", ["none", "block"])
@pytest.mark.parametrize("phases", [1, 2])
def test_a_layer_with_a_shared_expert_adds_it_in_the_same_sum(fmt, phases):
    style = dataclasses.replace(MODELS["deepseek-v3"], num_experts=16)
    layer = MoELayer.random(style, hidden_size=128, intermediate_size=128, dtype=torch.float32, device=DEVICE,
                            seed=2)
    layer = layer if fmt == "none" else layer.quantized(fmt)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    config = ONE if phases == 1 else dataclasses.replace(
        ONE, one_launch=dataclasses.replace(TWO_PHASE, block_k=128 if fmt == "block" else 16))
    with record_launches() as launches:
        out = layer(x, config=config)
    names = [name for name, _ in launches]
    # the routed experts in one launch (two phases in fp8 on the CPU: the torch reference, no launch); the two
    # GEMMs left are the shared expert's, on its dense map; no alignment
    launched = "one_launch.experts" if phases == 1 else "two_phase.experts"
    assert names.count(launched) == (0 if phases == 2 and fmt == "block" and not ON_GPU else 1), names
    assert "align.moe_align_block_size" not in names, names
    assert all(settings["dense"] for name, settings in launches if name == "index_gather.gemm"), launches
    # fp8: one phase runs W8A16, the reference W8A8 (a few percent apart); two phases W8A8, up to where h's
    # rounding lands; unquantised: exact arithmetic
    assert rel_err(out, layer.reference(x)) < ({1: 0.1, 2: 2e-2}[phases] if fmt == "block" else 1e-5)


@needs_gpu
@pytest.mark.parametrize("model, fmt", [("qwen3-30b-a3b", "none"), ("qwen3-30b-a3b", "block"),
                                        ("deepseek-v3", "none"), ("deepseek-v3", "block")])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("phases", [1, 2])
def test_model_shapes_on_the_gpu(model, fmt, batch, phases):
    from moe_kernels.bench.problems import make_batch, make_weights
    from moe_kernels.model.shapes import MODELS

    shape = MODELS[model]
    w1, w2 = make_weights(shape, torch.bfloat16, 0, DEVICE)
    (q1, s1), (q2, s2) = FORMATS[fmt].quantize_weight(w1), FORMATS[fmt].quantize_weight(w2)
    del w1, w2
    x, _, weights, ids = make_batch(shape, batch, torch.bfloat16, batch, DEVICE)
    # (two phases: fp8 as W8A8, the activations quantised in the kernel; and the same output twice, no atomics)
    ref = one_launch_reference(x, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2,
                               quantize_activations=phases == 2 and fmt != "none").double()
    tiles = ((OneLaunchTiles(32, 256, 4), OneLaunchTiles(64, 256, 8, 2), OneLaunchTiles(16, 512, 4, 3)) if phases == 1
             else (OneLaunchTiles(16, 16, 4, 4, phases=2), OneLaunchTiles(32, 32, 4, 6, phases=2, programs_per_sm=2),
                   OneLaunchTiles(32, 64, 4, 4, phases=2, programs_per_sm=2, swap_ab=True),   # (wgmma on Hopper)
                   OneLaunchTiles(32, 64, 4, 3, phases=2, programs_per_sm=2, swap_ab=True, k_chunks=2),
                   OneLaunchTiles(64, 128, 4, 3, phases=2, programs_per_sm=3, swap_ab=True)))
    for t in tiles:
        out = one_launch_experts(x, q1, q2, weights, ids, tiles=t, w1_scale=s1, w2_scale=s2)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
        if phases == 2:
            assert torch.equal(out, one_launch_experts(x, q1, q2, weights, ids, tiles=t, w1_scale=s1, w2_scale=s2))


_COMPILE_FOR_HOPPER = """
import re
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import one_launch
from moe_kernels.sm90_compile import compile_for_sm90

fn = one_launch._one_launch_kernel
for weights, scales in (("*bf16", 0), ("*fp8e4nv", 1), ("*fp8e4nv", 2)):
    pointers = dict(x_ptr="*bf16", w1_ptr=weights, w2_ptr=weights, topk_weights_ptr="*fp32", topk_ids_ptr="*i32",
                    acc_ptr="*fp32", arrivals_ptr="*i32", out_ptr="*bf16", add_ptr="*bf16", w1_scale_ptr="*fp32",
                    w2_scale_ptr="*fp32")
    const = dict(TOP_K=8, SLICES=24, BLOCK_F=32, BLOCK_D=256, SCALES=scales, ID_CHECK="", STAGES=1 + scales,
                 HAS_ADD=scales == 2, ROUND=2)
    ptx = compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=2).asm["ptx"]
    adds = [m.start() for m in re.finditer(r"(red|atom)[.a-z]*[.]global[.a-z0-9]*[.]f32", ptx)]
    arrival = re.search(r"atom[.a-z]*[.](gpu[.]acq_rel|acq_rel[.]gpu)[.a-z]*add", ptx)
    read = ptx.find("ld.global.cg", arrival.end()) if arrival else -1
    ordered = arrival is not None and adds[-1] < arrival.start() and "bar.sync" in ptx[adds[-1]:arrival.start()]
    print(bool(adds), ordered,
          read > 0 and "bar.sync" in ptx[arrival.end():read], "mma" not in ptx)
"""


def test_compiles_for_hopper_with_its_release_and_acquire():
    """Compiled for an H100/H200 (sm_90) on this machine, bf16 and fp8 (block and per-row
    scales): float32 atomic adds, then a CTA barrier, then the acquire-release arrival at GPU
    scope, then a barrier before the token's row is read back through L2 (``.cg``); no tensor-core
    instruction (the products are matrix-vector sums on the CUDA cores)."""
    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    assert lines[:3] == ["True True True True"] * 3, lines

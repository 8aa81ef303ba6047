"""Both expert GEMMs in one launch, in two phases (moe_kernels/kernels/two_phase.py), against the float64
per-token reference: fp8 block weights run W8A8 as the two-GEMM path runs them (the other fp8 formats refused by
name), the tiles' checks, which kernel fused_experts launches with a config whose ``one_launch`` has ``phases=2``,
and what the compiler makes of it. Random shapes and tiles (units that do not divide d or F), the edge cases,
bf16's rounding of h, ids out of range, the layer and the models' shapes on a GPU: tests/test_one_launch.py, for
both kernels.

Runs on default_device(): the Triton interpreter on a CPU machine (float32 and float16; fp8 there is the torch
reference), the compiled kernel on a GPU (bf16 and fp8 at the models' own shapes too). The interpreter runs the
programs one after another, so there the first program takes every ticket: the waits, other programs' scratch rows
and arrivals that race are exercised on a GPU only (tests/test_one_launch.py's model shapes, twice each, bit-equal).
"""

import dataclasses

import pytest
import torch

from moe_kernels._runtime import BACKEND, default_device, record_launches
from moe_kernels.kernels.config import GemmTiles, MoEConfig, OneLaunchTiles
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.one_launch import one_launch_experts, one_launch_reference, runs_in_one_launch
from moe_kernels.kernels.two_phase import two_phase_reference, units
from moe_kernels.reference import moe_reference
from moe_testing import ON_GPU, compiled_for_hopper, make_problem, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")

SMALL = OneLaunchTiles(block_f=16, block_d=16, phases=2, block_k=16, num_stages=2)


def test_the_unit_counts():
    # GEMM 1: 3 tokens x 2 experts x 40 rows of F in 16s; GEMM 2: x 48 rows of d in 16s
    assert units(3, 2, 48, 40, SMALL) == (3 * 2 * 3, 3 * 2 * 3)


def test_the_launch_it_names_from_fused_experts():
    hidden, w1, w2, weights, ids = make_problem(2, 6, 3, 64, 32, seed=5)
    config = MoEConfig(16, GemmTiles(16, 16), GemmTiles(16, 16), one_launch=SMALL)
    if BACKEND == "torch":
        pytest.skip("no Triton here: the torch reference runs")
    with record_launches() as launches:
        out = fused_experts(hidden, w1, w2, weights, ids, config=config)
    assert launches == [("two_phase.experts", {"format": "unquantized", **SMALL.as_dict(), "add": False})]
    assert rel_err(out, moe_reference(hidden, w1, w2, weights, ids)) < 1e-5


def test_fp8_block_is_w8a8_and_other_formats_are_refused():
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 256, 128, seed=7)
    (q1, s1), (q2, s2) = FORMATS["block"].quantize_weight(w1), FORMATS["block"].quantize_weight(w2)
    tiles = dataclasses.replace(SMALL, block_k=128)
    out = one_launch_experts(hidden, q1, q2, weights, ids, tiles=tiles, w1_scale=s1, w2_scale=s2)
    w8a8 = two_phase_reference(hidden, q1, q2, weights, ids, fmt=FORMATS["block"], w1_scale=s1, w2_scale=s2)
    w8a16 = one_launch_reference(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    assert rel_err(out, w8a8.double()) < (2e-3 if ON_GPU else 1e-6)
    assert rel_err(w8a8, w8a16.double()) > 1e-3   # (the activations' fp8 rounding shows)
    with pytest.raises(ValueError, match=r"one_launch_experts: argument 'tiles.block_k' must be 128 for fp8-block"):
        one_launch_experts(hidden, q1, q2, weights, ids, tiles=SMALL, w1_scale=s1, w2_scale=s2)
    (c1, t1), (c2, t2) = FORMATS["channel"].quantize_weight(w1), FORMATS["channel"].quantize_weight(w2)
    with pytest.raises(ValueError, match=r"one_launch_experts: argument 'w1_scale' must be block scales"):
        one_launch_experts(hidden, c1, c2, weights, ids, tiles=tiles, w1_scale=t1, w2_scale=t2)


@pytest.mark.parametrize("changes, message", [
    (dict(phases=3), "'phases' must be <= 2"), (dict(block_f=8), "'block_f' must be >= 16 with phases=2"),
    (dict(block_d=512), "'block_d' must be <= 256 with phases=2"), (dict(block_k=48), "'block_k' must be a power"),
    (dict(programs_per_sm=0), "'programs_per_sm' must be >= 1"),
    (dict(phases=1, swap_ab=True), "'swap_ab' must be False with phases=1"),
    (dict(k_chunks=3), "'k_chunks' must be a power of two"), (dict(k_chunks=32), "'k_chunks' must be <= 16"),
    (dict(phases=1, k_chunks=2), "'k_chunks' must be 1 with phases=1")])
def test_bad_tiles_are_named(changes, message):
    with pytest.raises(ValueError, match=f"OneLaunchTiles: argument {message}"):
        dataclasses.replace(SMALL, **changes)
    with pytest.raises(TypeError, match="OneLaunchTiles: argument 'swap_ab' must be a bool, got 1"):
        dataclasses.replace(SMALL, swap_ab=1)


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("d, f, chunks", [(64, 32, 2), (96, 40, 2), (48, 24, 4), (40, 40, 16)])
def test_steps_in_chunks(swap_ab, d, f, chunks):
    """``k_chunks``: each step's chunks of a weight row stacked as rows of one tile, the token's chunks as rows of its
    tile. Against the float64 reference where K divides the step (64 = 2 x 32) and where it does not: a last step
    whose later chunks start past K (96 = 2 x 32 + 32; 40 < 16 x 16)."""
    hidden, w1, w2, weights, ids = make_problem(5, 6, 3, d, f, seed=d + chunks)
    tiles = dataclasses.replace(SMALL, block_k=32 if d % 32 == 0 else 16, k_chunks=chunks, swap_ab=swap_ab)
    out = one_launch_experts(hidden, w1, w2, weights, ids, tiles=tiles)
    assert rel_err(out, moe_reference(hidden, w1, w2, weights, ids)) < 1e-5


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (fp8 runs the torch reference under the interpreter)")
@pytest.mark.parametrize("d, f", [(384, 128), (128, 384)])
def test_fp8_chunks_past_k_read_no_scale_gpu(d, f):
    """fp8 steps of two chunks where K (384) is no multiple of 256: the last step's second chunk lies past K, and its
    scale group does not exist. It must read none (a NaN in the scratch or past the scales would poison the row: 0 x
    NaN), and match the W8A8 reference as one chunk does."""
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, d, f, torch.bfloat16, seed=11)
    (q1, s1), (q2, s2) = FORMATS["block"].quantize_weight(w1), FORMATS["block"].quantize_weight(w2)
    ref = two_phase_reference(hidden, q1, q2, weights, ids, fmt=FORMATS["block"], w1_scale=s1, w2_scale=s2).double()
    for chunks in (1, 2):
        tiles = OneLaunchTiles(16, 64, 4, 3, phases=2, block_k=128, swap_ab=True, k_chunks=chunks)
        out = one_launch_experts(hidden, q1, q2, weights, ids, tiles=tiles, w1_scale=s1, w2_scale=s2)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-2, chunks


@pytest.mark.skipif(ON_GPU or BACKEND == "torch", reason="the interpreter's fp8 path, forced on")
def test_fp8_chunks_past_k_read_no_scale_interpreted():
    """The same under the interpreter, its fp8 kernel forced on (its fp8 casts are off by about 1%, the same for one
    chunk and two) and every new float32 buffer filled with NaN, as uninitialised memory may be: two chunks give one
    chunk's result, with no NaN from a scale past K."""
    from unittest import mock

    from moe_kernels.kernels import quant

    empty = torch.empty

    def nan_filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t

    hidden, w1, w2, weights, ids = make_problem(2, 3, 2, 384, 128, seed=1)
    (q1, s1), (q2, s2) = FORMATS["block"].quantize_weight(w1), FORMATS["block"].quantize_weight(w2)
    outs = []
    with mock.patch.object(quant, "INTERPRETER_ROUNDS_FP8_WRONGLY", False), mock.patch("torch.empty", nan_filled):
        for chunks in (1, 2):
            tiles = OneLaunchTiles(16, 16, 4, 2, phases=2, block_k=128, swap_ab=True, k_chunks=chunks,
                                   programs_per_sm=1)
            outs.append(one_launch_experts(hidden, q1, q2, weights, ids, tiles=tiles, w1_scale=s1, w2_scale=s2))
    assert torch.isfinite(outs[1]).all() and rel_err(outs[1], outs[0].double()) < 1e-5


def test_config_round_trip():
    config = MoEConfig(16, GemmTiles(16, 16), GemmTiles(16, 16), one_launch=SMALL)
    assert MoEConfig.from_dict(config.to_dict()) == config and config.to_dict()["one_launch"]["phases"] == 2


_COMPILE_FOR_HOPPER = """
import itertools
import re
import torch
import triton
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import two_phase
from moe_kernels.sm90_compile import assemble_for_sm90, compile_for_sm90

builds = [(w, swap, 1) for w, swap in itertools.product(("*bf16", "*fp8e4nv"), (False, True))] + [("*fp8e4nv", True, 2)]
for weights, swap, chunks in builds:
    quant = weights == "*fp8e4nv"
    pointers = dict(x_ptr="*bf16", w1_ptr=weights, w2_ptr=weights, h_ptr="*bf16", part_ptr="*fp32", q_ptr=weights,
                    qs_ptr="*fp32", out_ptr="*bf16", add_ptr="*bf16", topk_weights_ptr="*fp32", topk_ids_ptr="*i32",
                    counters_ptr="*i32", w1_scale_ptr="*fp32", w2_scale_ptr="*fp32", timeline_ptr="*i64")
    const = dict(TOP_K=8, BLOCK_F=32, BLOCK_D=64, BLOCK_K=128, CHUNKS=chunks, QUANT=quant, ID_CHECK="", STAGES=4,
                 HAS_ADD=False, ROUND=2, PRECISION="tf32", EVEN_D=True, EVEN_F=True, SWAP=swap, TIMELINE=False)
    # (the H100 tables' one-token tiles; the launch specialises these integers as multiples of 16, as at every
    # model shape)
    kernel = compile_for_sm90(two_phase._two_phase_kernel, const, pointers, num_warps=4,
                              aligned=("D", "F", "stride_x", "stride_w1e", "stride_w1n", "stride_w2e", "stride_w2n"))
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    pipelined = [m.group(1) for m in re.finditer(r"%(a|w|scale)_?[0-9]* = ttg.async_copy_global_to_local", ttgir)]
    release = re.search(r"(atom|red)[.]global[.](gpu[.]release|release[.]gpu)[.]add", ptx)
    acquire = re.search(r"(atom|ld)[.]global[.](gpu[.]acquire|acquire[.]gpu)", ptx)   # (3.6: an ld, not an add of 0)
    # (the H200's Triton, 3.6: a newer Triton's bundled ptxas may not read its own PTX)
    spills = assemble_for_sm90(ptx)["spill_stores"] if triton.__version__.startswith("3.6.") else 0
    mma = ("wgmma" if "wgmma.mma_async" in ptx else "") + ("mma.sync" if "mma.sync" in ptx else "")
    converts = len(re.findall(r"cvt[.]rn[.]f16x2[.]e4m3x2", ptx))   # (fp8 pairs to fp16 for mma.sync)
    print(weights, swap, chunks, mma, converts > 0, sorted(set(pipelined)), release is not None, acquire is not None,
          spills)
"""


def test_compiles_for_hopper_with_its_weights_pipelined():
    """Compiled for an H100/H200 (sm_90), bf16 and fp8, at the tables' tiles (64 rows a unit): the token as the
    MMA's A operand runs on ``mma.sync`` (fp8 converted to fp16 pair by pair); with ``swap_ab`` the weights are A
    and the products run on ``wgmma``, fp8 with no conversion. Either way every weight tile (GEMM 1's gate and up
    rows in one tile) and the token's row (``a``: x or h, in fp8 from the program's scratch row) are copied by
    cp.async in the software pipeline, and fp8's scales too; the release after a GEMM 1 unit and the acquire before a
    GEMM 2 unit are at GPU scope (it also drops the SM's L1 copies, so that ``h`` is read as the other SMs wrote it);
    no spills (counted under Triton 3.6). The last build reads each fp8 row 256 bytes a step, in two chunks
    (``k_chunks=2``) stacked as rows of one weight tile, the same way."""
    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    assert lines[:5] == ["*bf16 False 1 mma.sync False ['a', 'w'] True True 0",
                         "*bf16 True 1 wgmma False ['a', 'w'] True True 0",
                         "*fp8e4nv False 1 mma.sync True ['a', 'scale', 'w'] True True 0",
                         "*fp8e4nv True 1 wgmma False ['a', 'scale', 'w'] True True 0",
                         "*fp8e4nv True 2 wgmma False ['a', 'scale', 'w'] True True 0"], lines


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton here: the torch reference runs")
def test_a_table_entry_meets_channel_fp8_with_its_two_gemms():
    # (a tuned table is keyed by the element type: its fp8 entry serves every fp8 format)
    hidden, w1, w2, weights, ids = make_problem(2, 4, 2, 256, 128, seed=13)
    (q1, s1), (q2, s2) = FORMATS["channel"].quantize_weight(w1), FORMATS["channel"].quantize_weight(w2)
    config = MoEConfig(16, GemmTiles(16, 128), GemmTiles(16, 128), one_launch=dataclasses.replace(SMALL, block_k=128))
    assert not runs_in_one_launch(config, FORMATS["channel"]) and runs_in_one_launch(config, FORMATS["block"])
    # (nor does a block-fp8 entry whose K steps are not the format's 128: one activation group a step)
    other_k = dataclasses.replace(config, one_launch=dataclasses.replace(SMALL, block_k=64))
    assert not runs_in_one_launch(other_k, FORMATS["block"]) and runs_in_one_launch(other_k, FORMATS["none"])
    with record_launches() as launches:
        out = fused_experts(hidden, q1, q2, weights, ids, config=config, w1_scale=s1, w2_scale=s2)
    names = [name for name, _ in launches]
    assert "two_phase.experts" not in names and names.count("index_gather.gemm") == 2, names
    assert rel_err(out, fused_experts(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2).double()) < 1e-6


def test_a_layer_running_it_quantises_nothing_first():
    """fp8: the two-phase kernel quantises x itself, so the layer hands the experts no activations of its own (with
    the two GEMMs, or a shared expert apart, it quantises once for all of them); and it reads the routing's ids, so
    where vLLM's rule would align the rows the layer runs no alignment."""
    from unittest import mock

    from moe_kernels import layer as layer_module
    from moe_kernels.layer import MoELayer
    from moe_kernels.model.shapes import MODELS

    style = dataclasses.replace(MODELS["qwen3-30b-a3b"], num_experts=16)
    layer = MoELayer.random(style, hidden_size=256, intermediate_size=128, dtype=torch.float32,
                            device=default_device(), seed=4).quantized("block")
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)).to(default_device())
    two_phase = MoEConfig(16, GemmTiles(16, 128), GemmTiles(16, 128),
                          one_launch=dataclasses.replace(SMALL, block_k=128))
    for config, quantised in ((two_phase, False), (dataclasses.replace(two_phase, one_launch=None), True)):
        with mock.patch.object(layer_module, "run_experts", wraps=layer_module.run_experts) as spy:
            with record_launches() as launches:
                layer(x, config=config)
        assert (spy.call_args.kwargs["activations"] is not None) == quantised, config
        # (8 of 16 experts: vLLM's rule would align this token's rows; the one launch reads the ids, no block map)
        names = [name for name, _ in launches]
        if not quantised:   # (under the interpreter fp8 runs the kernel's torch reference: no launch to see)
            assert spy.call_args.kwargs["naive"] is False and spy.call_args.kwargs["blocks"] is None
            assert ("two_phase.experts" in names or not ON_GPU) and not any(
                n.startswith(("align.", "chained_routing.align")) for n in names), names

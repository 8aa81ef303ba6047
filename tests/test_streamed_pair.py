"""Both expert GEMMs as one stream of tiles (moe_kernels/kernels/streamed_pair.py) against the float64
per-token reference: random shapes, the edge cases, every lag (none, some, more than the blocks), the
naive and the aligned block maps; the config field that selects it, its errors, which kernel a call
launches; the sm_90 build (its release and acquire); on a GPU, bf16 and fp8 at Qwen3-30B-A3B's shape,
bit for bit the two launches' rows, replay after replay.

Runs on default_device(): the Triton interpreter on a CPU machine (float32 and float16; the interpreter
runs programs one after another, so no program ever waits there), the compiled kernel on a GPU.
"""

import dataclasses
import random

import pytest
import torch

from moe_kernels._runtime import BACKEND, record_launches
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import GemmTiles, MoEConfig, check_config, check_stream, choose_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.streamed_pair import streamed_pair, streamed_pair_reference, tickets
from moe_kernels.reference import moe_reference
from moe_testing import (DEVICE, EDGE_SHAPES, ON_GPU, TOLERANCE, compiled_for_hopper, make_problem, needs_gpu, rel_err,
                         skewed_problems)

pytestmark = pytest.mark.usefixtures("true_fp32")

SMALL = GemmTiles(block_n=16, block_k=16)


def check(problem, dtype, *, lag=2, block_m=16, naive=False, gate_up=SMALL, down=SMALL):
    hidden, w1, w2, weights, ids = problem
    blocks = assign_blocks(ids, block_m, w1.shape[0], naive=naive)
    per_slot = streamed_pair(hidden, w1, w2, weights, blocks, ids.shape[1], gate_up=gate_up, down=down, lag=lag)
    assert per_slot.shape == (hidden.shape[0], ids.shape[1], w2.shape[1])
    err = rel_err(per_slot.sum(1), moe_reference(hidden, w1, w2, weights, ids))
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    rnd = random.Random(1700 + seed)
    num_experts = rnd.randint(1, 9)
    dtype = (torch.float32, torch.float16)[seed % 2]
    problem = make_problem(rnd.randint(1, 40), num_experts, rnd.randint(1, num_experts), rnd.choice([16, 40, 64]),
                           rnd.choice([8, 24, 40]), dtype, seed=seed, fused_topk_like=seed % 3 == 0)
    check(problem, dtype, lag=rnd.choice([0, 1, 3, 1000]), naive=seed == 4,
          gate_up=GemmTiles(rnd.choice([16, 32]), rnd.choice([16, 32])), down=GemmTiles(rnd.choice([16, 64]), 16))


@pytest.mark.parametrize("case", sorted(EDGE_SHAPES))
def test_edge_cases(case):
    check(make_problem(**EDGE_SHAPES[case], hidden=48, inter=40, seed=3), torch.float32)


@pytest.mark.parametrize("lag", [0, 1, 5, 10_000])
def test_an_idle_expert_and_every_token_on_one(lag):
    for problem in skewed_problems():
        check(problem, torch.float32, lag=lag)


@pytest.mark.parametrize("naive", [False, True])
def test_the_torch_reference_is_the_kernel_in_float32(naive):
    hidden, w1, w2, weights, ids = make_problem(7, 5, 2, 48, 24, seed=11)
    blocks = assign_blocks(ids, 16, 5, naive=naive)
    kernel_rows = streamed_pair(hidden, w1, w2, weights, blocks, 2, gate_up=SMALL, down=SMALL, lag=1)
    h = torch.empty(14, 24, device=hidden.device)
    reference_rows = streamed_pair_reference(hidden, w1, w2, weights, blocks, 2, h=h)
    assert rel_err(kernel_rows, reference_rows.double()) < TOLERANCE[torch.float32]


def test_bf16_called_directly_under_the_interpreter_takes_the_reference():
    """The interpreter's bf16 dot is wrong: a direct bf16 call computes in float32 (the reference)."""
    if ON_GPU or BACKEND == "torch":
        pytest.skip("the interpreter's fallback")
    hidden, w1, w2, weights, ids = make_problem(4, 4, 2, 32, 16, seed=12)
    bf16 = [t.to(torch.bfloat16) for t in (hidden, w1, w2)]
    blocks = assign_blocks(ids, 16, 4)
    with record_launches() as launches:
        per_slot = streamed_pair(*bf16, weights, blocks, 2, gate_up=SMALL, down=SMALL, lag=1)
    assert launches == [] and per_slot.dtype == torch.bfloat16
    assert rel_err(per_slot.sum(1), moe_reference(*bf16, weights, ids)) < TOLERANCE[torch.bfloat16]


def test_no_tokens():
    hidden, w1, w2, weights, ids = make_problem(1, 4, 2, seed=1)
    blocks = assign_blocks(ids[:0], 16, 4, naive=False)
    out = streamed_pair(hidden[:0], w1, w2, weights[:0], blocks, 2, gate_up=SMALL, down=SMALL, lag=1)
    assert out.shape == (0, 2, w2.shape[1])


def test_tickets_cover_every_tile_once():
    # 5 blocks x (F/16 GEMM 1 tiles + d/32 GEMM 2 tiles), whatever the lag
    assert tickets(5, 48, 64, SMALL, GemmTiles(32, 16)) == 5 * (3 + 2)


@pytest.mark.parametrize("name, value, error, message", [
    ("lag", -1, ValueError, "'lag' must be an int >= 0"), ("lag", True, TypeError, "'lag' must be an int >= 0"),
    ("lag", 2.0, TypeError, "'lag' must be an int >= 0"),
    ("gate_up", GemmTiles(16, 16, split_k=2), ValueError, "'gate_up' must have split_k=1"),
    ("down", GemmTiles(16, 16, persistent=1), ValueError, "'down' must have split_k=1 and persistent=0")])
def test_bad_settings_are_named(name, value, error, message):
    settings = dict(gate_up=SMALL, down=SMALL, lag=1)
    settings[name] = value
    with pytest.raises(error, match=message):
        check_stream("streamed_pair", **settings)


def test_the_config_field_round_trips_and_old_tables_lack_it():
    config = MoEConfig(16, SMALL, SMALL, stream_lag=32)
    assert MoEConfig.from_dict(config.to_dict()) == config
    assert "stream_lag" not in MoEConfig(16, SMALL, SMALL).to_dict()
    assert MoEConfig.from_dict(MoEConfig(16, SMALL, SMALL).to_dict()).stream_lag is None


@pytest.mark.parametrize("config, layout, message", [
    (MoEConfig(16, SMALL, SMALL, stream_lag=-2), "index_gather", "config.stream_lag"),
    (MoEConfig(16, SMALL, SMALL, stream_lag=1.5), "index_gather", "config.stream_lag"),
    (MoEConfig(16, SMALL, SMALL, stream_lag=4), "permute", "index_gather only"),
    (MoEConfig(16, SMALL, SMALL, stream_lag=4), "masked", "index_gather only"),
    (MoEConfig(16, SMALL, SMALL, sum_in_gemm=True, stream_lag=4), "index_gather", "config.sum_in_gemm"),
    (MoEConfig(16, GemmTiles(16, 16, persistent=1), SMALL, stream_lag=4), "index_gather", "config.gate_up"),
])
def test_bad_configs_are_named(config, layout, message):
    with pytest.raises((ValueError, TypeError), match=message):
        check_config("fused_experts", config, layout=layout)


@pytest.mark.parametrize("naive", [False, True])
def test_fused_experts_takes_the_stream_when_the_config_says_so(naive):
    hidden, w1, w2, weights, ids = make_problem(6, 8, 2, 32, 24, seed=5)
    config = MoEConfig(16, SMALL, SMALL, stream_lag=3)
    with record_launches() as launches:
        out = fused_experts(hidden, w1, w2, weights, ids, config=config,
                            blocks=assign_blocks(ids, 16, 8, naive=naive))
    assert rel_err(out, moe_reference(hidden, w1, w2, weights, ids)) < TOLERANCE[torch.float32]
    if BACKEND != "torch":
        names = [name for name, _ in launches]
        assert "streamed_pair" in names and "index_gather.gemm" not in names, names
        settings = dict(launches)["streamed_pair"]
        assert settings["lag"] == 3 and settings["naive"] == naive


def test_bf16_under_the_interpreter_keeps_the_two_launches():
    """The interpreter's bf16 dot is wrong (moe_kernels._runtime.interpreted_bf16): bf16 calls
    compute in float32 through the two launches there, the stream's config notwithstanding."""
    if ON_GPU or BACKEND == "torch":
        pytest.skip("the interpreter's fallback")
    hidden, w1, w2, weights, ids = make_problem(3, 4, 2, 32, 16, seed=6)
    bf16 = [t.to(torch.bfloat16) for t in (hidden, w1, w2)]
    with record_launches() as launches:
        fused_experts(*bf16, weights, ids, config=MoEConfig(16, SMALL, SMALL, stream_lag=1))
    assert "streamed_pair" not in [name for name, _ in launches]


def test_bool_and_float_lags_are_type_errors():
    for lag in (True, 1.5):
        with pytest.raises(TypeError, match="config.stream_lag"):
            check_config("fused_experts", MoEConfig(16, SMALL, SMALL, stream_lag=lag))


def test_fp8_under_the_interpreter_keeps_the_two_launches():
    """The stream's GEMM 1 quantises GEMM 2's input in its epilogue, which the interpreter rounds
    wrongly (moe_kernels.kernels.quant): there the two launches run, with the same numbers."""
    if ON_GPU or BACKEND == "torch":
        pytest.skip("the interpreter's fallback")
    fmt = FORMATS["block"]
    hidden, w1, w2, weights, ids = make_problem(4, 4, 2, 128, 128, seed=2)
    (w1q, w1s), (w2q, w2s) = fmt.quantize_weight(w1), fmt.quantize_weight(w2)
    config = MoEConfig(16, GemmTiles(128, 128), GemmTiles(16, 128), stream_lag=1)
    with record_launches() as launches:
        fused_experts(hidden, w1q, w2q, weights, ids, config=config, w1_scale=w1s, w2_scale=w2s)
    assert "streamed_pair" not in [name for name, _ in launches]


def test_unchecked_bad_ids_add_nothing_and_a_shared_addend_joins_the_sum():
    """Through the stream: an id outside [0, E) declined unchecked lands in no block and adds
    nothing to its token (the [T, k, d] rows start at zero), and an ``add`` joins the top-k sum."""
    from moe_kernels.kernels.index_gather import run_experts

    hidden, w1, w2, weights, ids = make_problem(5, 4, 2, 32, 16, seed=9)
    bad = ids.clone()
    bad[2, 1] = 7
    config = MoEConfig(16, SMALL, SMALL, stream_lag=1)
    extra = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(hidden.device)
    out = run_experts(hidden, w1, w2, weights, bad, fmt=FORMATS["none"], config=config, ids="unchecked", add=extra)
    kept = weights.clone()
    kept[2, 1] = 0.0   # the bad slot adds nothing
    ref = moe_reference(hidden, w1, w2, kept, ids) + extra.double()
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_other_layouts_drop_the_stream_when_they_borrow_a_table():
    from moe_kernels.kernels.config import _adapted

    config = MoEConfig(16, SMALL, SMALL, stream_lag=8)
    assert _adapted(config, "permute", 128).stream_lag is None
    assert _adapted(config, "index_gather", 128).stream_lag == 8


def test_one_launch_and_the_stream_exclude_each_other():
    from moe_kernels.kernels.config import OneLaunchTiles

    with pytest.raises(ValueError, match="config.one_launch is set"):
        check_config("fused_experts", MoEConfig(16, SMALL, SMALL, one_launch=OneLaunchTiles(), stream_lag=2))


def test_fp8_without_its_quantiser_or_in_another_format_is_named():
    hidden, w1, w2, weights, ids = make_problem(2, 4, 2, 128, 128, seed=4)
    blocks = assign_blocks(ids, 16, 4, naive=False)
    for name, quant, message in (("block", None, "argument 'quant'"), ("channel", (None, 128, ""), "argument 'fmt'")):
        with pytest.raises(ValueError, match=message):
            streamed_pair(hidden, w1, w2, weights, blocks, 2, gate_up=SMALL, down=SMALL, lag=1, fmt=FORMATS[name],
                          quant=quant)


def test_the_h200_table_takes_the_stream_where_it_was_measured_faster():
    """Qwen3-30B-A3B, fp8 block: the two GEMMs as one stream at 512 tokens (the A/B in
    results/nvidia-h200/streamed-pair-ab-fp8.json: 0.92-0.93x the two launches); the two launches at
    1, 8 and 64 (at 64 the stream's 0.97-0.99x is inside the tuner's 3% margin) and at 256, where the
    full fp8 search (fused-moe-tuning-fp8-block-s26q.json) found transposed TMA tiles for both GEMMs:
    185.6 us, the stream on them 180.6 (0.973x, inside the margin)."""
    qwen = dict(E=128, N=768, K=2048, dtype=torch.float8_e4m3fn, device="cpu", device_name="NVIDIA H200")
    lags = {m: choose_config(m, **qwen).config.stream_lag for m in (1, 8, 64, 256, 512)}
    assert lags == {1: None, 8: None, 64: None, 256: None, 512: 32}
    # the stream runs with GEMM 1's warps: 4 at 512 (8 measured 30% slower at 256)
    assert choose_config(512, **qwen).config.gate_up.num_warps == 4


_COMPILE_FOR_HOPPER = """
import re
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import streamed_pair as sp
from moe_kernels.sm90_compile import compile_for_sm90

for fp8, swap in ((False, False), (True, True)):
    element = "fp8e4nv" if fp8 else "bf16"
    const = dict(BLOCK_M=16, TOP_K=8, NAIVE_BLOCKS=False, SCALES=int(fp8), SCALE_BN=128, SCALE_BK=128,
                 INPUT_PRECISION="tf32", ID_CHECK_1="", ID_CHECK_2="", BN1=128, BK1=128, SWAP1=swap, TMA1=False,
                 EVEN_K1=True, BN2=128, BK2=128, SWAP2=swap, TMA2=False, EVEN_K2=True,
                 QUANT_GROUP=128 if fp8 else 0, ROUND_TO="bf16" if fp8 else "", PREFETCH_W2=False, TICKETS=True,
                 PREFETCH_LINE=64)
    pointers = {n: "*" + element for n in ("x_ptr", "w1_ptr", "h_ptr", "w2_ptr", "w1_desc", "w2_desc")}
    pointers.update(out_ptr="*bf16", topk_weights_ptr="*fp32", sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32",
                    num_tokens_post_padded_ptr="*i32", counters_ptr="*i32", x_scale_ptr="*fp32",
                    w1_scale_ptr="*fp32", h_scale_ptr="*fp32", w2_scale_ptr="*fp32")
    aligned = ("D", "F", "stride_xm", "stride_w1e", "stride_w1n", "stride_hm", "stride_w2e", "stride_w2n", "stride_om")
    ptx = compile_for_sm90(sp._streamed_pair_kernel, const, pointers, aligned=aligned, num_warps=4,
                           num_stages=3).asm["ptx"]
    release = re.search(r"(atom|red)[.]global[.]gpu[.]release[.]add", ptx)   # (red: the count is not read back)
    acquire = re.search(r"(atom|ld)[.]global[.]gpu[.]acquire", ptx)   # (an atomic add of 0 becomes a load)
    print(release is not None and "bar.sync" in ptx[:release.start()], acquire is not None,
          "cp.async" in ptx, ("wgmma" in ptx) == swap)
"""


def test_compiles_for_hopper_with_its_release_and_acquire():
    """Compiled for an H100/H200 (sm_90) on this machine, bf16 and fp8: a CTA barrier before the
    release that counts a GEMM 1 tile in, an acquire load for GEMM 2's wait, both GEMMs' loads in the
    cp.async pipeline, and wgmma where the tile is transposed."""
    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    assert lines[:2] == ["True True True True"] * 2, lines


@needs_gpu
@pytest.mark.parametrize("fmt_name", ["none", "block"])
@pytest.mark.parametrize("num_tokens", [64, 512])
def test_qwen3_shape_on_gpu_matches_the_two_launches_every_replay(fmt_name, num_tokens):
    """The stream's rows are the two launches' rows, bit for bit (the same tiles, sums in the same
    order): a GEMM 2 tile that read its block of h before GEMM 1 finished it would show here."""
    from moe_kernels.bench.problems import make_batch, tool_weights

    fmt = FORMATS[fmt_name]
    model, dtype, w1, w1s, w2, w2s = tool_weights("qwen3-30b-a3b", fmt, DEVICE)
    x, _, weights, ids = make_batch(model, num_tokens, dtype, 7, DEVICE)
    config = choose_config(num_tokens, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                           w1.dtype, DEVICE).config
    gate_up = config.gate_up if config.gate_up.block_n % 128 == 0 else dataclasses.replace(config.gate_up, block_n=128)
    # (the stream writes the [T, k, d] rows: a table entry that sums in GEMM 2, as the fp8 tables do at 64 tokens,
    # is compared without that sum)
    two = dataclasses.replace(config, gate_up=gate_up, stream_lag=None, quant_in_gemm=fmt.quantized, sum_in_gemm=False)
    blocks = assign_blocks(ids, config.block_m, model.num_experts, validate_ids=False)
    scales = dict(w1_scale=w1s, w2_scale=w2s)
    expected = fused_experts(x, w1, w2, weights, ids, config=two, blocks=blocks, **scales)
    for lag in (0, 32):
        streamed = dataclasses.replace(two, stream_lag=lag)
        with record_launches() as launches:
            fused_experts(x, w1, w2, weights, ids, config=streamed, blocks=blocks, **scales)
        assert "streamed_pair" in [name for name, _ in launches]
        for _ in range(20):
            out = fused_experts(x, w1, w2, weights, ids, config=streamed, blocks=blocks, **scales)
            assert torch.equal(out, expected)


@needs_gpu
@pytest.mark.parametrize("fmt_name", ["none", "block"])
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_the_stream_replays_and_graphs_like_the_eager_call_gpu(fmt_name, num_tokens):
    """``fused_experts`` with a streamed config and no block map: its recorded replay (which redoes
    the counters' zero fill) and then its CUDA graph give the eager call's rows bit for bit, on new
    inputs at every call; at one token the block map is naive and GEMM 2 checks the ids."""
    from moe_kernels.bench.problems import make_batch, tool_weights
    from moe_kernels.kernels.index_gather import _PLANS

    fmt = FORMATS[fmt_name]
    model, dtype, w1, w1s, w2, w2s = tool_weights("qwen3-30b-a3b", fmt, DEVICE)
    e = model.num_experts
    table = choose_config(num_tokens, e, model.moe_intermediate_size, model.hidden_size, w1.dtype, DEVICE).config
    gate_up = table.gate_up if table.gate_up.block_n % 128 == 0 else dataclasses.replace(table.gate_up, block_n=128)
    config = dataclasses.replace(table, gate_up=gate_up, stream_lag=32, sum_in_gemm=False)   # (the stream needs it)
    scales = dict(w1_scale=w1s, w2_scale=w2s)
    for call in range(4):
        x, _, weights, ids = make_batch(model, num_tokens, dtype, 100 * num_tokens + call, DEVICE)
        got = fused_experts(x, w1, w2, weights, ids, config=config, **scales)
        expected = fused_experts(x, w1, w2, weights, ids, config=config, validate_ids=False,
                                 blocks=assign_blocks(ids, config.block_m, e, validate_ids=False), **scales)
        assert torch.equal(got, expected), call
    plan = _PLANS.get(_PLANS.key((x, w1, w2, weights, ids, w1s, w2s), (None, config, None, True)))
    assert plan is not None and plan.replays >= 2, _PLANS.last_refusal
    assert sum(len(s.graphs) for s in plan.graphs.by_stream.values()) == 1, plan.graphs.refusal

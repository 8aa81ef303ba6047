"""The traced decode layer (moe_kernels.trace): its counts against each other and against
the alignment's invariants, its output against the float64 reference, the small-batch rule; and
the stage timer built on it (moe_kernels.bench.decode_step).

Runs on default_device(): the Triton interpreter on a CPU machine, the compiled kernels on a GPU.
Shapes are DeepSeek-V3's real E=256, top-8 and groups with d and F shrunk.
"""

import json
import math

import pytest
import torch

from moe_kernels.bench import decode_step
from moe_kernels import trace as layer_trace
from moe_kernels.kernels import blocks
from moe_kernels.kernels.grouped_routing import grouped_topk_reference
from moe_kernels.kernels.routing import gate
from moe_kernels.model.shapes import GPUS, MODELS
from moe_kernels.reference import moe_reference
from moe_testing import DEVICE, needs_gpu, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")
DSV3 = MODELS["deepseek-v3"]
SMALL = dict(hidden_size=32, intermediate_size=16)


def trace(num_tokens, model="deepseek-v3", dtype=torch.float32, seed=0, **kwargs):
    return layer_trace.trace_moe_layer(model, num_tokens, dtype=dtype, device=DEVICE, seed=seed,
                                       **{**SMALL, **kwargs})


@pytest.fixture(scope="module")
def step64():
    return trace(64)


# ---- counts --------------------------------------------------------------------------------------


def test_alignment_counts_are_consistent(step64):
    t = step64
    E, k, T, bm = t.num_experts, t.top_k, t.num_tokens, t.block_m
    assert (E, k, t.num_expert_group, t.topk_group) == (256, 8, 8, 4)
    assert not t.naive and t.naive_rule_lhs == T * k * 4
    assert bm == 16  # the tuned M tile at 64 tokens: the source's BLOCK_SIZE_M
    assert t.max_num_tokens_padded == T * k + E * (bm - 1) == t.sorted_token_ids.numel() == 4352
    assert t.expert_ids_len == math.ceil(t.max_num_tokens_padded / bm) == 272
    blocks.check_alignment(t.topk_ids, bm, E, t.sorted_token_ids, t.expert_ids,
                          torch.tensor([t.num_tokens_post_padded], dtype=torch.int32))
    live_blocks = t.num_tokens_post_padded // bm
    assert t.expert_ids_unused == t.expert_ids_len - live_blocks
    assert (t.expert_ids[live_blocks:] == -1).all() and (t.expert_ids[:live_blocks] >= 0).all()
    counts = torch.bincount(t.topk_ids.flatten().long(), minlength=E)
    assert t.experts_touched == int((counts > 0).sum()) == torch.unique(t.expert_ids[:live_blocks]).numel()
    assert t.max_rows_per_expert == int(counts.max())
    assert t.num_tokens_post_padded == int(((counts + bm - 1) // bm * bm).sum())
    if t.max_rows_per_expert <= bm:  # every touched expert is one tile
        assert t.num_tokens_post_padded == t.experts_touched * bm
    assert t.padded_rows_per_real_row == t.num_tokens_post_padded / (T * k)


def test_routing_follows_the_group_rule(step64):
    t = step64
    assert t.topk_ids.shape == (64, 8) and t.topk_weights.shape == (64, 8)
    assert t.max_groups_per_token <= t.topk_group
    assert all(len(set(row)) == 8 for row in t.topk_ids.tolist())
    # renormalised, then scaled by the routed scaling factor
    torch.testing.assert_close(t.topk_weights.sum(dim=1).cpu(), torch.full((64,), DSV3.routed_scaling_factor),
                               rtol=1e-5, atol=1e-5)
    assert 0 <= t.bias_changed_tokens <= 64


def test_launch_bytes_and_flops_use_the_real_shape(step64):
    t = step64
    d, f, E, k, T = 7168, 2048, 256, 8, 64
    assert (t.real_hidden_size, t.real_intermediate_size) == (d, f)
    assert t.gemm1_grid == (math.ceil((T * k + E * (t.block_m - 1)) / t.block_m), math.ceil(f / t.gemm1_block_n))
    assert t.gemm1_programs == t.gemm1_grid[0] * t.gemm1_grid[1]
    assert t.gemm1_live_programs == t.num_tokens_post_padded // t.block_m * t.gemm1_grid[1]
    assert t.expert_params == 3 * d * f
    assert t.routed_bytes_fp8 == t.experts_touched * 3 * d * f
    assert t.routed_bytes_bf16 == 2 * t.routed_bytes_fp8
    assert t.routed_flops_per_token == k * 2 * 3 * d * f
    assert t.routed_flops == T * t.routed_flops_per_token
    assert t.intensity_fp8 == pytest.approx(2 * T * k / t.experts_touched)
    assert t.intensity_bf16 == pytest.approx(t.intensity_fp8 / 2)
    assert t.ridge_h100_fp8 == GPUS["H100 SXM"].ridge("fp8")
    assert t.ridge_h200_bf16 == GPUS["H200"].ridge("bf16")


def test_block_m_override():
    t = trace(9, block_m=32)   # 9 tokens: the smallest batch past the naive rule
    assert t.block_m == 32 and not t.naive
    assert t.max_num_tokens_padded == 9 * 8 + 256 * 31
    assert t.expert_ids_len == math.ceil(t.max_num_tokens_padded / 32)
    blocks.check_alignment(t.topk_ids, 32, 256, t.sorted_token_ids, t.expert_ids,
                          torch.tensor([t.num_tokens_post_padded], dtype=torch.int32))
    assert t.rel_error < 1e-5


# ---- the output ------------------------------------------------------------------------------------


def test_output_matches_the_float64_reference(step64):
    t = step64
    layer = layer_trace.make_layer("deepseek-v3", 64, dtype=torch.float32, device=DEVICE, seed=0, **SMALL)
    logits = gate(layer.hidden_states, layer.gate_weight)
    weights, ids = grouped_topk_reference(layer.hidden_states, logits, 8, True, 8, 4, "sigmoid", 2.5,
                                          layer.correction_bias)
    assert torch.equal(ids, t.topk_ids)
    torch.testing.assert_close(weights, t.topk_weights)
    routed = moe_reference(layer.hidden_states, layer.w1, layer.w2, weights, ids)
    shared = moe_reference(layer.hidden_states, layer.shared_w1[None], layer.shared_w2[None],
                           torch.ones(64, 1, device=DEVICE), torch.zeros(64, 1, dtype=torch.int32, device=DEVICE))
    assert torch.isfinite(t.output).all()
    assert t.output.shape == (64, 32) and t.output.dtype == torch.float32
    assert rel_err(t.output, routed + shared) < 1e-5
    assert rel_err(t.routed_output, routed) < 1e-5 and rel_err(t.shared_output, shared) < 1e-5
    assert t.rel_error < 1e-5


@pytest.mark.parametrize("model,num_tokens,dtype,tol", [
    ("qwen3-30b-a3b", 4, torch.float32, 1e-5),      # softmax, one group, no bias, no shared expert
    ("deepseek-v2-lite", 3, torch.float16, 1e-3),   # softmax, two shared experts
    ("deepseek-v3", 1, torch.float32, 1e-5),        # one token
])
def test_other_models_and_edge_batches(model, num_tokens, dtype, tol):
    t = trace(num_tokens, model=model, dtype=dtype)
    m = MODELS[model]
    assert t.output.dtype == dtype and torch.isfinite(t.output).all()
    assert t.rel_error < tol
    assert (t.shared_output is None) == (m.num_shared_experts == 0)
    assert t.bias_changed_tokens == 0 or m.scoring_func == "sigmoid"


# ---- the small-batch rule --------------------------------------------------------------------------


def test_small_batch_rule_at_8_and_9_tokens():
    assert blocks.use_naive_block_assignment(8, 8, 256)  # 8 * 8 * 4 = 256 <= 256
    assert not blocks.use_naive_block_assignment(9, 8, 256)  # 288 > 256
    t8, t9 = trace(8), trace(9)
    assert t8.naive and t8.naive_rule_lhs == 256 and t8.sorted_token_ids is None
    assert t8.expert_ids_len == 64 and t8.expert_ids_unused == 0
    assert torch.equal(t8.expert_ids.cpu(), t8.topk_ids.flatten().cpu())
    assert t8.num_tokens_post_padded == blocks.naive_padded_rows(8, 8, 16) == t8.max_num_tokens_padded
    assert t8.gemm1_grid[0] == 64
    assert not t9.naive and t9.naive_rule_lhs == 288
    blocks.check_alignment(t9.topk_ids, t9.block_m, 256, t9.sorted_token_ids, t9.expert_ids,
                          torch.tensor([t9.num_tokens_post_padded], dtype=torch.int32))
    assert t8.rel_error < 1e-5 and t9.rel_error < 1e-5


# ---- GPU bf16 ---------------------------------------------------------------------------------------


@needs_gpu
def test_bf16_on_gpu():
    t = layer_trace.trace_moe_layer("deepseek-v3", 64, dtype=torch.bfloat16, device="cuda", seed=1,
                                    hidden_size=512, intermediate_size=256)
    assert t.output.dtype == torch.bfloat16 and torch.isfinite(t.output).all()
    assert t.rel_error < 1e-2


# ---- the measurement harness ------------------------------------------------------------------------


def test_measure_times_every_stage_after_checking():
    calls = []

    def fake_timer(fn):
        fn()
        calls.append(fn)
        return 1.5

    run = decode_step.measure("deepseek-v3", 9, dtype=torch.float32, device=DEVICE, seed=3, timer=fake_timer,
                              **SMALL)
    assert list(run["stages_us"]) == list(decode_step.STAGES)
    # every stage, the chained router and the whole layer
    assert len(calls) == len(decode_step.STAGES) + 2 and run["layer_us"] == run["router_chained_us"] == 1.5
    assert run["trace"]["rel_error"] < 1e-5 and run["config"]["block_m"] == 16
    json.dumps(run)  # recordable as is


def test_the_chained_router_stage_routes_as_the_trace():
    """What the decode-step bench times as ``router_chained_us``: the same ids as the traced layer's
    routing (a float32 layer here: the gate's sums differ only in order), and its alignment."""
    from moe_kernels.kernels.align import moe_align_block_size_reference
    from moe_kernels.trace import make_layer, route

    layer = make_layer("deepseek-v3", 9, dtype=torch.float32, device=DEVICE, seed=3, **SMALL)
    weights, ids, _, *alignment = decode_step.chained_router(layer, 16, False)()
    want_weights, want_ids = route(layer)
    assert torch.equal(ids.sort(dim=1).values, want_ids.sort(dim=1).values)
    torch.testing.assert_close(weights.sum(dim=1), want_weights.sum(dim=1))
    # (72 assignments: the ranked alignment, whose segments may order their rows otherwise on a GPU)
    assert blocks.same_segments(alignment, moe_align_block_size_reference(ids, 16, layer.model.num_experts), 16,
                                ids.numel())
    assert len(decode_step.chained_router(layer, 16, True)()) == 3   # the naive block map: no alignment
    big = make_layer("deepseek-v3", 513, dtype=torch.float32, device=DEVICE, seed=3, **SMALL)
    assert decode_step.chained_router(big, 16, False) is None   # past the chain's reach


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cli_needs_a_gpu(capsys):
    assert decode_step.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ---- bad inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(model="deepseek-v4"), ValueError, "argument 'model' must be a MoEModel or one of"),
    (dict(num_tokens=0), ValueError, "argument 'num_tokens' must be >= 1"),
    (dict(num_tokens=2.0), TypeError, "argument 'num_tokens' must be an int"),
    (dict(hidden_size=0), ValueError, "argument 'hidden_size' must be >= 1"),
    (dict(intermediate_size=-4), ValueError, "argument 'intermediate_size' must be >= 1"),
    (dict(dtype=torch.int32), TypeError, "argument 'dtype' must be float32, float16 or bfloat16"),
    (dict(block_m=8), ValueError, "argument 'block_m' must be >= 16"),
    (dict(seed="0"), TypeError, "argument 'seed' must be an int"),
])
def test_bad_inputs(kwargs, exc, message):
    args = dict(model="deepseek-v3", num_tokens=4, dtype=torch.float32, device=DEVICE, seed=0, **SMALL)
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        layer_trace.trace_moe_layer(args.pop("model"), args.pop("num_tokens"), **args)

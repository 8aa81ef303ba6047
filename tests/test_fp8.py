"""fp8 W8A8 experts (moe_kernels.kernels.quant and the fp8 path of the GEMM core).

The kernels are checked against the *same* quantised numbers (moe_kernels.reference.moe_reference_fp8):
tight where the activations are float32 (only the accumulation order differs), loose where an
fp8 code of the requantised intermediate may land on the other side of a rounding boundary.
The fp8 error itself (against the unquantised layer) is reported by the benchmark, not asserted
tightly. Triton's interpreter (3.9) computes fp8 ``tl.dot`` and fp8 casts exactly, so the
kernels run on the CPU too.
"""

import dataclasses
import re

import pytest
import torch

from moe_kernels import MODELS, MoELayer, fused_experts, masked_experts, moe_reference, permute_experts
from moe_kernels._runtime import HAS_TRITON, record_launches
from moe_kernels.checkpoint import load_layer
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import GemmTiles
from moe_kernels.kernels import quant
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import expert_down, expert_gate_up
from moe_kernels.kernels.quant import (FP8, dequantize_activations, dequantize_weight, per_token_group_quant_fp8,
                                       per_token_group_quant_fp8_reference, quantize_activations, quantize_weight)
from moe_kernels.reference import moe_reference_fp8, silu_and_mul_reference
from moe_testing import DEVICE, ON_GPU, exact_fp8_inputs, needs_gpu, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")
GRANULARITIES = ["block", "channel", "tensor"]
LAYOUTS = {"index_gather": fused_experts, "permute": lambda *a, **k: permute_experts(*a, align=16, **k)}


def problem(num_tokens=9, num_experts=6, topk=2, d=256, f=128, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, d, generator=g).to(DEVICE, dtype)
    w1 = (torch.randn(num_experts, 2 * f, d, generator=g) / d**0.5).to(DEVICE)
    w2 = (torch.randn(num_experts, d, f, generator=g) / f**0.5).to(DEVICE)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(1)[:, :topk].to(DEVICE)
    weights = torch.rand(num_tokens, topk, generator=g).to(DEVICE)
    return x, w1, w2, weights, ids


# ---- the quantisers -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 128), (5, 384), (33, 2048), (0, 256)])
def test_group_quantiser_matches_its_reference(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 3
    q, s = per_token_group_quant_fp8(x)
    q_ref, s_ref = per_token_group_quant_fp8_reference(x)
    assert q.dtype == FP8 and s.shape == (shape[0], shape[1] // 128)
    if ON_GPU:   # the kernel divides with div.full.f32 (within 2 ulp): scales that close, codes one step apart at most
        torch.testing.assert_close(s, s_ref, rtol=3e-7, atol=0)
        step = torch.maximum(q_ref.float().abs() * 2.0**-3, torch.full_like(q_ref.float(), 2.0**-9))
        assert bool(((q.float() - q_ref.float()).abs() <= step).all())
    else:
        assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
    if shape[0]:
        # amax of each group lands on +-448, and dequantising loses at most half an fp8 step (1/16).
        assert torch.allclose(q.float().abs().view(shape[0], -1, 128).amax(-1), torch.full_like(s, 448.0))
        err = (dequantize_activations(q, s, "group") - x).abs() / x.abs().view(shape[0], -1, 128).amax(-1).repeat_interleave(128, 1)
        assert float(err.max()) <= 1 / 16


@pytest.mark.parametrize("tile", [(4, 1), (8, 4), (2, 8), (1, 16)])
@pytest.mark.parametrize("shape, group", [((7, 128 * 11), 128), ((1, 2048), 128), ((9, 192), 64)])
def test_group_quantiser_kernel_on_each_program_tile(monkeypatch, tile, shape, group):
    """The quantiser kernel itself with each program tile (rows, column groups), edges masked: on values that
    quantise exactly it runs under the interpreter too, and must give the reference's bits."""
    monkeypatch.setattr(quant, "INTERPRETER_ROUNDS_FP8_WRONGLY", False)
    monkeypatch.setattr(quant, "QUANT_TILE", tile)
    x = exact_fp8_inputs(*shape, group, torch.Generator().manual_seed(shape[0])).to(DEVICE)
    with record_launches() as launches:
        q, s = per_token_group_quant_fp8(x, group)
    if HAS_TRITON:
        assert [(name, r["rows"]) for name, r in launches] == [("quant.groups", tile[0])], launches
    if ON_GPU:   # (against the one-group program: the same arithmetic, div.full.f32, whatever the tiling)
        monkeypatch.setattr(quant, "QUANT_TILE", (4, 1))
        q_ref, s_ref = per_token_group_quant_fp8(x, group)
    else:
        q_ref, s_ref = per_token_group_quant_fp8_reference(x, group)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("interpreted_kernel", [True, False], ids=["kernel", "torch path"])
@pytest.mark.parametrize("used", [0, 1, 5, 7, 100])
def test_the_quantiser_bounded_by_rows_used_writes_only_those_rows(monkeypatch, used, interpreted_kernel):
    """With rows_used (a count on the device) the rows below it get the unbounded call's bits and the others
    keep what the output held (here sentinels); a count past the rows is the whole tensor."""
    monkeypatch.setattr(quant, "INTERPRETER_ROUNDS_FP8_WRONGLY", not interpreted_kernel)
    x = exact_fp8_inputs(7, 384, 128, torch.Generator().manual_seed(used)).to(DEVICE)
    want_q, want_s = per_token_group_quant_fp8(x)
    q = torch.full_like(want_q, 3.0)
    s = torch.full_like(want_s, -1.0)
    rows_used = torch.tensor([used], dtype=torch.int32, device=DEVICE)
    with record_launches() as launches:
        quant._quant_groups(x, 128, rows_used, out=(q, s))
    if HAS_TRITON and interpreted_kernel:
        assert [r["bounded"] for name, r in launches if name == "quant.groups"] == [True], launches
    below = min(used, 7)
    assert torch.equal(q[:below].view(torch.uint8), want_q[:below].view(torch.uint8))
    assert torch.equal(s[:below], want_s[:below])
    assert bool((q[below:].float() == 3.0).all()) and bool((s[below:] == -1.0).all())


@pytest.mark.parametrize("rows_used, message", [(torch.zeros(2, dtype=torch.int32), "must have shape"),
                                                (torch.zeros(1, dtype=torch.int64), "rows_used")])
def test_a_bad_rows_used_is_named(rows_used, message):
    with pytest.raises((ValueError, TypeError), match=f"argument 'rows_used'.*{message}|argument 'rows_used'"):
        per_token_group_quant_fp8(torch.ones(4, 256, device=DEVICE), rows_used=rows_used.to(DEVICE))


def test_a_quantiser_tile_of_other_than_powers_of_two_is_refused(monkeypatch):
    monkeypatch.setattr(quant, "INTERPRETER_ROUNDS_FP8_WRONGLY", False)
    monkeypatch.setattr(quant, "QUANT_TILE", (3, 1))
    if not HAS_TRITON:
        pytest.skip("the torch path takes no tile")
    with pytest.raises(ValueError, match="QUANT_TILE"):
        per_token_group_quant_fp8(torch.ones(4, 256, device=DEVICE))


def test_zero_group_gets_a_finite_scale():
    q, s = per_token_group_quant_fp8(torch.zeros(2, 256, device=DEVICE))
    assert torch.isfinite(s).all() and (s > 0).all() and (q.float() == 0).all()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("n, k", [(256, 384), (200, 300)])
def test_weight_quantiser_layouts(granularity, n, k):
    w = torch.randn(3, n, k, generator=torch.Generator().manual_seed(2))
    q, s = quantize_weight(w, granularity)
    want = {"block": (3, -(-n // 128), -(-k // 128)), "channel": (3, n), "tensor": (3,)}[granularity]
    assert q.shape == w.shape and q.dtype == FP8 and tuple(s.shape) == want and s.dtype == torch.float32
    # Each scale is its group's amax / 448, so the relative error is at most half an fp8 step.
    err = (dequantize_weight(q, s) - w).abs().max() / w.abs().max()
    assert float(err) <= 1 / 16


@pytest.mark.parametrize("scheme", ["group", "token", "tensor"])
def test_activation_quantiser_layouts(scheme):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q, s = quantize_activations(x, scheme)
    assert tuple(s.shape) == {"group": (4, 2), "token": (4,), "tensor": (1,)}[scheme]
    assert rel_err(dequantize_activations(q, s, scheme), x.double()) < 0.05


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_every_format_scales_activations_per_token(granularity):
    """No format lets one token's values into another token's scale (so one request's inf
    cannot reach another request's output)."""
    fmt = FORMATS[granularity]
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    _, s = fmt.quantize_activations(x)
    x[2, 5] = float("inf")
    _, s_inf = fmt.quantize_activations(x)
    assert s.shape[0] == 4 and torch.equal(s[[0, 1, 3]], s_inf[[0, 1, 3]])


# ---- the kernels on the same quantised numbers ---------------------------------------------------


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("naive", [False, True])
def test_each_gemm_stage_is_exact_on_the_quantised_numbers(granularity, naive):
    """Stage by stage there is no requantisation in between: float32 accumulation only."""
    x, w1, w2, weights, ids = problem()
    w1q, w1s = quantize_weight(w1, granularity)
    w2q, w2s = quantize_weight(w2, granularity)
    fmt = FORMATS[granularity]
    xq, xs = fmt.quantize_activations(x)
    blocks = assign_blocks(ids, 16, w1.shape[0], naive=naive)
    tiles = GemmTiles(32, 64)
    inter = expert_gate_up(xq, w1q, blocks, 2, tiles=tiles, a_scale=xs, w_scale=w1s, out_dtype=torch.float32)
    x_deq, w1d = fmt.dequantize_activations(xq, xs).double(), dequantize_weight(w1q, w1s).double()
    rows = torch.arange(ids.numel(), device=DEVICE) // 2
    want = silu_and_mul_reference(torch.einsum("ad,afd->af", x_deq[rows], w1d[ids.flatten()]))
    assert rel_err(inter, want) < 1e-6
    iq, is_ = fmt.quantize_activations(inter)
    per_slot = expert_down(iq, w2q, weights, blocks, tiles=tiles, a_scale=is_, w_scale=w2s, out_dtype=torch.float32)
    want = weights.reshape(-1, 1).double() * torch.einsum(
        "af,adf->ad", fmt.dequantize_activations(iq, is_).double(), dequantize_weight(w2q, w2s).double()[ids.flatten()])
    assert rel_err(per_slot.reshape(-1, w2.shape[1]), want) < 1e-6


@pytest.mark.skipif(not HAS_TRITON, reason="no Triton: the torch references launch nothing")
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("num_tokens", [2, 3])
def test_block_fp8_experts_leave_the_naive_map_from_three_tokens(granularity, num_tokens):
    """vLLM's rule takes the naive map at these batches (T * 2 * 4 <= 64); block-fp8 weights keep it up to
    ``blocks.NAIVE_MAX_TOKENS_BLOCK_FP8`` = 2 tokens only (faster aligned on an H100), the other formats throughout.
    The path, not only the value: which block map the GEMMs ran, and whether an alignment launched."""
    x, w1, w2, weights, ids = problem(num_tokens=num_tokens, num_experts=64, seed=5)
    w1q, w1s = quantize_weight(w1, granularity)
    w2q, w2s = quantize_weight(w2, granularity)
    with record_launches() as launches:
        out = fused_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    naive = granularity != "block" or num_tokens <= 2
    gemms = [settings for name, settings in launches if name == "index_gather.gemm"]
    assert [g["naive"] for g in gemms] == [naive, naive]
    assert ("align.moe_align_block_size" in [name for name, _ in launches]) == (not naive)
    ref = moe_reference_fp8(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity=granularity,
                            intermediate_dtype=torch.float32)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_match_the_quantised_reference(layout, granularity, dtype):
    x, w1, w2, weights, ids = problem(dtype=dtype, seed=4)
    w1q, w1s = quantize_weight(w1, granularity)
    w2q, w2s = quantize_weight(w2, granularity)
    out = LAYOUTS[layout](x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    assert out.dtype == dtype and out.shape == x.shape
    ref = moe_reference_fp8(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity=granularity,
                            intermediate_dtype=dtype)
    # float32: accumulation order plus a rare fp8 flip of the intermediate; bf16: the output's rounding.
    assert rel_err(out, ref) < (1e-3 if dtype == torch.float32 else 1e-2)
    # The quantisation error itself, against the unquantised experts: a few percent, not asserted tightly.
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 0.2


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # inf * 0 in the interpreter
@pytest.mark.parametrize("layout, granularity", [("index_gather", "tensor"), ("permute", "tensor"),
                                                 ("index_gather", "block"), ("permute", "channel")])
def test_one_bad_token_changes_no_other_token(layout, granularity):
    """An inf in one token (one request's bad input) reaches that token's output only: every
    format quantises activations per token (issue 16: per-tensor activation scales once turned
    every token of the batch into NaN)."""
    x, w1, w2, weights, ids = problem(seed=6)
    (w1q, w1s), (w2q, w2s) = quantize_weight(w1, granularity), quantize_weight(w2, granularity)
    clean = LAYOUTS[layout](x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    bad = x.clone()
    bad[4, 7] = float("inf")
    out = LAYOUTS[layout](bad, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    others = [t for t in range(x.shape[0]) if t != 4]
    assert torch.equal(out[others], clean[others])


def fewer_experts(key, num_experts=32):
    """The model's routing style (scoring, groups, bias, shared expert) with 32 experts: under the
    interpreter a DeepSeek-V3 layer with all 256 (at d = 256) takes 15-25 s."""
    return dataclasses.replace(MODELS[key], num_experts=num_experts)


# Each layout and each model style once; the GPU test below runs both layouts for both styles at
# every granularity, with the models' own number of experts.
@pytest.mark.parametrize("layout, model, shared", [("index_gather", "qwen3-30b-a3b", "separate"),
                                                   ("index_gather", "deepseek-v3", "fused"),
                                                   ("permute", "deepseek-v3", "separate")])
def test_fp8_layer_both_model_styles(layout, model, shared):
    base = MoELayer.random(fewer_experts(model), hidden_size=128, intermediate_size=128, dtype=torch.float32,
                           device=DEVICE, seed=0, layout=layout, shared_expert=shared)
    layer = base.quantized("block")
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = layer(x)
    assert rel_err(out, layer.reference(x)) < 1e-3
    assert rel_err(out, base.reference(x)) < 0.2


@needs_gpu
@pytest.mark.parametrize("model, shared", [("qwen3-30b-a3b", "separate"), ("deepseek-v3", "fused")])
@pytest.mark.parametrize("layout", ["index_gather", "permute"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_layer_bf16_gpu(model, shared, layout, granularity):
    base = MoELayer.random(model, hidden_size=1024, intermediate_size=512, dtype=torch.bfloat16, device="cuda",
                           seed=0, layout=layout, shared_expert=shared)
    layer = base.quantized(granularity)
    x = torch.randn(200, 1024, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    assert rel_err(layer(x), layer.reference(x)) < 2e-2


# ---- errors ----------------------------------------------------------------------------------------


def test_bad_fp8_inputs_name_the_argument():
    x, w1, w2, weights, ids = problem()
    w1q, w1s = quantize_weight(w1, "block")
    w2q, w2s = quantize_weight(w2, "block")
    cases = [
        (lambda: fused_experts(x, w1q, w2q, weights, ids, w1_scale=w1s[:, :1], w2_scale=w2s), ValueError, "w1_scale"),
        (lambda: fused_experts(x, w1q, w2q, weights, ids, w1_scale=w1s.double(), w2_scale=w2s), TypeError, "w1_scale"),
        (lambda: fused_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=None), TypeError, "w2_scale"),
        (lambda: fused_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=quantize_weight(w2, "channel")[1]),
         ValueError, "w2_scale"),
        (lambda: fused_experts(x, w1, w2, weights, ids, w1_scale=w1s, w2_scale=w2s), ValueError, "w1_scale"),
        (lambda: masked_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s), ValueError, "layout"),
        (lambda: masked_experts(x, w1q, w2q, weights, ids), TypeError, "w1_scale"),
        (lambda: per_token_group_quant_fp8(x[:, :200]), ValueError, "x"),
        (lambda: per_token_group_quant_fp8(x, 96), ValueError, "group_size"),
        (lambda: quantize_weight(w1, "row"), ValueError, "granularity"),
        (lambda: quantize_activations(x, "row"), ValueError, "scheme"),
        (lambda: expert_gate_up(x, w1q, assign_blocks(ids, 16, 6), 2, tiles=GemmTiles(32, 64)), TypeError,
         "hidden_states"),
        (lambda: expert_gate_up(quantize_activations(x, "group")[0], w1q, assign_blocks(ids, 16, 6), 2,
                                tiles=GemmTiles(32, 64), a_scale=torch.ones(9, device=DEVICE), w_scale=w1s),
         ValueError, "a_scale"),
    ]
    ragged = quantize_weight(torch.randn(2, 256, 200), "block")
    cases.append((lambda: fused_experts(torch.randn(3, 200, device=DEVICE), ragged[0].to(DEVICE),
                                        quantize_weight(torch.randn(2, 200, 128), "block")[0].to(DEVICE),
                                        weights[:3], ids[:3] % 2, w1_scale=ragged[1].to(DEVICE),
                                        w2_scale=quantize_weight(torch.randn(2, 200, 128), "block")[1].to(DEVICE)),
                  ValueError, "w1"))
    for run, exc, name in cases:
        with pytest.raises(exc, match=re.escape(f"argument '{name}'")):
            run()


# ---- loading an fp8 checkpoint ----------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
def test_loader_reads_fp8_weights_and_their_scales(tmp_path, fused):
    from safetensors.torch import save_file

    e, d, f = 4, 256, 128
    g = torch.Generator().manual_seed(5)
    gate_w, up, down = torch.randn(e, f, d, generator=g), torch.randn(e, f, d, generator=g), torch.randn(e, d, f, generator=g)
    (gq, gs), (uq, us), (dq, ds) = (quantize_weight(t, "block") for t in (gate_w, up, down))
    p = "model.layers.2.mlp."
    state = {p + "gate.weight": torch.randn(e, d, generator=g)}
    if fused:
        state[p + "experts.gate_up_proj"] = torch.cat([gq, uq], 1)
        state[p + "experts.gate_up_proj_scale_inv"] = torch.cat([gs, us], 1)
        state[p + "experts.down_proj"], state[p + "experts.down_proj_scale_inv"] = dq, ds
    else:
        for i in range(e):
            for name, (q, s) in (("gate_proj", (gq, gs)), ("up_proj", (uq, us)), ("down_proj", (dq, ds))):
                state[p + f"experts.{i}.{name}.weight"] = q[i].contiguous()
                state[p + f"experts.{i}.{name}.weight_scale_inv"] = s[i].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    config = {"hidden_size": d, "moe_intermediate_size": f, "num_experts": e, "num_experts_per_tok": 2,
              "norm_topk_prob": True}
    weights, _ = load_layer(tmp_path / "model.safetensors", layer=2, config=config, dtype=torch.bfloat16)
    assert weights.w13.dtype == FP8 and weights.granularity == "block"
    assert torch.equal(weights.w13.float(), torch.cat([gq, uq], 1).float())
    assert torch.equal(weights.w13_scale, torch.cat([gs, us], 1)) and torch.equal(weights.w2_scale, ds)
    layer = MoELayer.from_pretrained_layer(tmp_path / "model.safetensors", layer=2, config=config, device=DEVICE)
    x = torch.randn(5, d, generator=g).to(DEVICE)
    assert rel_err(layer(x), layer.reference(x)) < 1e-3

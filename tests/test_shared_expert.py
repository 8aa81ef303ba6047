"""Shared expert (moe_kernels.kernels.shared): separate and fused agree with the float64 reference;
its byte share (moe_kernels.model.costs).

Runs on default_device(): the Triton interpreter on a CPU machine, the compiled kernels on a GPU.
"""

import random
import re

import pytest
import torch

from moe_kernels.kernels import blocks, index_gather
from moe_kernels.kernels import shared as se
from moe_kernels.kernels.config import GemmTiles, MoEConfig
from moe_kernels.model import costs
from moe_kernels.reference import moe_reference, silu_and_mul_reference
from moe_testing import assert_device_assert, DEVICE, TOLERANCE, make_problem, needs_gpu, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")



def shared_problem(*shape, **kwargs):
    """make_problem's tensors by name, with a shared expert and weights scaled as DeepSeek-V3's
    router returns them."""
    tensors = make_problem(*shape, **kwargs, fused_topk_like=True, routed_scaling_factor=2.5, shared_expert=True)
    return dict(zip(("hidden", "w1", "w2", "weights", "ids", "w1_shared", "w2_shared"), tensors))


def expected(p, shared_weight=1.0):
    """Routed experts by the per-token reference, plus the shared FFN written out, all in float64."""
    x = p["hidden"].double()
    shared = silu_and_mul_reference(x @ p["w1_shared"].double().T) @ p["w2_shared"].double().T
    return moe_reference(p["hidden"], p["w1"], p["w2"], p["weights"], p["ids"]) + shared_weight * shared


def both_ways(p):
    separate = se.moe_with_shared_separate(p["hidden"], p["w1"], p["w2"], p["weights"], p["ids"],
                                           p["w1_shared"], p["w2_shared"])
    w1_all, w2_all = se.stack_shared_expert(p["w1"], p["w2"], p["w1_shared"], p["w2_shared"])
    fused = se.moe_with_shared_fused(p["hidden"], w1_all, w2_all, p["weights"], p["ids"])
    return separate, fused


def check(p, dtype):
    ref = expected(p)
    for name, out in zip(("separate", "fused"), both_ways(p)):
        assert out.shape == p["hidden"].shape and out.dtype == dtype, name
        err = rel_err(out, ref)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"


# ---- same output both ways ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes(seed):
    rnd = random.Random(seed)
    num_experts = rnd.randint(2, 12)
    dtype = (torch.float32, torch.float16)[seed % 2]
    check(shared_problem(rnd.randint(1, 20), num_experts, rnd.randint(1, min(num_experts, 4)),
                         rnd.choice([16, 32, 48]), rnd.choice([8, 16, 24]), dtype, seed=seed), dtype)


def test_one_token():  # top-(k+1) still small enough for the naive block map: 1 * 3 * 4 <= 17
    p = shared_problem(1, 16, 2, 32, 16, torch.float32, seed=1)
    assert blocks.assign_blocks(p["ids"], 16, 17).naive
    check(p, torch.float32)


def test_expert_with_no_tokens():
    ids = torch.tensor([[0, 2], [2, 5], [5, 0], [0, 5]])  # experts 1, 3, 4 receive nothing
    check(shared_problem(4, 6, 2, 32, 16, torch.float32, seed=2, topk_ids=ids), torch.float32)


def test_all_tokens_on_one_expert():
    check(shared_problem(24, 5, 1, 32, 16, torch.float32, seed=3, topk_ids=torch.full((24, 1), 3)), torch.float32)


def test_k_equals_1():
    check(shared_problem(9, 6, 1, 32, 16, torch.float16, seed=4), torch.float16)


def test_k_equals_num_experts():
    check(shared_problem(7, 4, 4, 32, 16, torch.float32, seed=5), torch.float32)


def test_no_tokens():
    p = shared_problem(0, 4, 2, 32, 16, torch.float32, seed=6)
    for out in both_ways(p):
        assert out.shape == (0, 32)


def test_shared_weight_scales_the_shared_slot():
    # SGLang writes sum(w) / routed_scaling_factor into the slot when the routed weights are
    # unscaled; any weight must scale exactly the shared expert's contribution.
    p = shared_problem(6, 8, 2, 32, 16, torch.float32, seed=7)
    w1_all, w2_all = se.stack_shared_expert(p["w1"], p["w2"], p["w1_shared"], p["w2_shared"])
    out = se.moe_with_shared_fused(p["hidden"], w1_all, w2_all, p["weights"], p["ids"], shared_weight=0.4)
    assert rel_err(out, expected(p, shared_weight=0.4)) < 1e-5


def test_shared_ffn_alone():
    p = shared_problem(5, 4, 2, 32, 16, torch.float32, seed=8)
    out = se.shared_expert_separate(p["hidden"], p["w1_shared"], p["w2_shared"])
    ones, zeros = torch.ones(5, 1, device=DEVICE), torch.zeros(5, 1, dtype=torch.int32, device=DEVICE)
    ref = moe_reference(p["hidden"], p["w1_shared"][None], p["w2_shared"][None], ones, zeros)
    assert rel_err(out, ref) < 1e-5


def test_shared_ffn_wider_than_routed():
    # Two shared experts of width F stored as one FFN of width 2F (vLLM's DeepseekV2MLP) equal
    # the sum of the two: the gated activation is elementwise over the intermediate columns.
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 16, generator=g).to(DEVICE)
    halves = [(torch.randn(16, 16, generator=g).to(DEVICE), torch.randn(16, 8, generator=g).to(DEVICE))
              for _ in range(2)]
    gate = torch.cat([w1[:8] for w1, _ in halves])
    up = torch.cat([w1[8:] for w1, _ in halves])
    wide = se.shared_expert_separate(x, torch.cat([gate, up]), torch.cat([w2 for _, w2 in halves], dim=1))
    summed = sum(se.shared_expert_separate(x, w1, w2) for w1, w2 in halves)
    assert torch.allclose(wide, summed, atol=1e-5)


def test_fused_asks_for_its_own_table_then_the_routed_one(monkeypatch):
    """The fused call's tiles: the table of its own problem (E+1 experts) first, and where there is none (here,
    on any machine without tuned tables for this shape) the routed shape's, never straight to the default."""
    import moe_kernels.kernels.config as config_module

    seen = []
    real = config_module.choose_config

    def spy(M, E, N, K, dtype, device, **options):
        seen.append(E)
        return real(M, E, N, K, dtype, device, **options)

    monkeypatch.setattr(config_module, "choose_config", spy)
    p = shared_problem(3, 6, 2, 32, 16, torch.float32, seed=10)
    w1_all, w2_all = se.stack_shared_expert(p["w1"], p["w2"], p["w1_shared"], p["w2_shared"])
    se.moe_with_shared_fused(p["hidden"], w1_all, w2_all, p["weights"], p["ids"])
    assert seen == [7, 6]


@pytest.mark.parametrize("device_name, own_up_to", [("NVIDIA H100 80GB HBM3", 2), ("NVIDIA H200", 64)])
def test_the_fused_table_answers_only_near_its_entries(device_name, own_up_to):
    """DeepSeek-V3's fp8 slot: its E+1 table within TABLE_REACH of its entries (the H100's keeps one token only:
    from 4 tokens the routed tiles measured faster in the layer), the routed shape's table beyond, never the
    default."""
    from moe_kernels.kernels.config import choose_fused_shared_config

    for batch in (1, 2, 3, 4, 16, 64, 65, 128, 512):
        choice = choose_fused_shared_config(batch, 256, 2048, 7168, torch.float8_e4m3fn, "cpu", device_name=device_name)
        assert choice.source == "table"
        assert (",E=257," in choice.table) == (batch <= own_up_to), (batch, choice.table)


def test_torch_fallback_matches(monkeypatch):
    monkeypatch.setattr(index_gather, "use_triton", lambda *tensors: False)
    check(shared_problem(5, 6, 2, 32, 16, torch.float32, seed=11), torch.float32)


def test_bf16_on_cpu():
    if DEVICE.type == "cuda":
        pytest.skip("covered natively by test_bf16_gpu")
    check(shared_problem(6, 5, 2, 32, 16, torch.bfloat16, seed=12), torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("seed", range(4))
def test_bf16_gpu(seed):
    rnd = random.Random(100 + seed)
    num_experts = rnd.choice([8, 64, 256])
    p = shared_problem(rnd.choice([1, 8, 65, 300]), num_experts, rnd.choice([1, 2, 8]), rnd.choice([256, 512]),
                       rnd.choice([128, 256]), torch.bfloat16, seed=seed)
    check(p, torch.bfloat16)


# ---- byte fractions ------------------------------------------------------------------------------


def test_byte_fractions_at_the_limits():
    assert costs.shared_expert_byte_overhead(1, 256, 8) == pytest.approx(1 / 8, rel=1e-12)
    assert costs.shared_expert_byte_share(1, 256, 8) == pytest.approx(1 / 9, rel=1e-12)
    assert costs.shared_expert_byte_overhead(1e6, 256, 8) == pytest.approx(1 / 256, rel=1e-12)
    assert costs.shared_expert_byte_share(1e6, 256, 8) == pytest.approx(1 / 257, rel=1e-12)
    assert costs.shared_expert_byte_share(1, 64, 6, num_shared_experts=2) == pytest.approx(2 / 8, rel=1e-12)
    assert costs.shared_expert_byte_overhead(3, 8, 8) == 1 / 8  # k = E: every expert, every batch


def test_byte_fractions_fall_with_the_batch():
    shares = [costs.shared_expert_byte_share(b, 256, 8) for b in (1, 2, 8, 64, 512, 4096)]
    assert all(a > b for a, b in zip(shares, shares[1:]))
    for b in (1, 7, 100):
        over, share = costs.shared_expert_byte_overhead(b, 128, 8), costs.shared_expert_byte_share(b, 128, 8)
        assert share == pytest.approx(over / (1 + over), rel=1e-12)


# ---- bad inputs ----------------------------------------------------------------------------------


def test_bad_inputs():
    p = shared_problem(3, 4, 2, 32, 16, torch.float32, seed=13)
    x, w1, w2, ws, wd = p["hidden"], p["w1"], p["w2"], p["w1_shared"], p["w2_shared"]
    with pytest.raises(ValueError, match=r"shared_expert_separate: argument 'w1_shared' must have shape \[2F, d=32\]"):
        se.shared_expert_separate(x, ws[:, :16], wd)
    with pytest.raises(ValueError, match=r"argument 'w1_shared' .* 2F even"):
        se.shared_expert_separate(x, ws[:31], wd)
    with pytest.raises(ValueError, match=r"argument 'w2_shared' must have shape \[d=32, F=16\]"):
        se.shared_expert_separate(x, ws, wd[:, :8])
    with pytest.raises(TypeError, match=r"argument 'w1_shared' must have dtype float32"):
        se.shared_expert_separate(x, ws.half(), wd)
    with pytest.raises(ValueError, match=r"moe_with_shared_separate: argument 'w2_shared'"):
        se.moe_with_shared_separate(x, w1, w2, p["weights"], p["ids"], ws, wd.T)
    with pytest.raises(ValueError, match=r"stack_shared_expert: argument 'w1_shared' must have the shape of one"):
        se.stack_shared_expert(w1, w2, torch.cat([ws, ws]), wd)
    with pytest.raises(ValueError, match=r"stack_shared_expert: argument 'w2_shared'"):
        se.stack_shared_expert(w1, w2, ws, wd[:, :8])
    w1_all, w2_all = se.stack_shared_expert(w1, w2, ws, wd)
    bad_ids = p["ids"].clone()
    bad_ids[0, 0] = 4  # the shared expert's slot: not a routed id
    message = "moe_with_shared_fused: argument 'topk_ids' must hold expert ids in [0, 4)"
    if DEVICE.type == "cuda":
        assert_device_assert(f"""
            from moe_kernels.kernels.shared import moe_with_shared_fused
            w1_all, w2_all = torch.randn(5, 32, 32, device="cuda"), torch.randn(5, 32, 16, device="cuda")
            ids = torch.tensor({bad_ids.tolist()}, dtype=torch.int32, device="cuda")
            moe_with_shared_fused(torch.randn(3, 32, device="cuda"), w1_all, w2_all, torch.rand(3, 2, device="cuda"), ids)
            """, message)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            se.moe_with_shared_fused(x, w1_all, w2_all, p["weights"], bad_ids)
    with pytest.raises(ValueError, match=r"argument 'w1_with_shared' must hold E >= 1 routed experts"):
        se.moe_with_shared_fused(x, w1_all[:1], w2_all[:1], p["weights"][:, :1], p["ids"][:, :1])
    with pytest.raises(ValueError, match=r"argument 'topk_ids.shape\[1\]' must be <= 4"):
        se.moe_with_shared_fused(x, w1_all, w2_all, p["weights"].repeat(1, 3), p["ids"].repeat(1, 3))
    with pytest.raises(ValueError, match=r"shared_expert_byte_share: argument 'batch' must be > 0"):
        costs.shared_expert_byte_share(0, 256, 8)
    with pytest.raises(ValueError, match=r"argument 'num_shared_experts' must be >= 1"):
        costs.shared_expert_byte_overhead(1, 256, 8, num_shared_experts=0)
    with pytest.raises(ValueError, match=r"argument 'top_k'"):
        costs.shared_expert_byte_overhead(1, 8, 9)


# ---- one expert on a dense block map (the layer's fp8 shared expert, and any dense FFN) ------------------


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 40])
@pytest.mark.parametrize("gated", [False, True])
def test_dense_expert_is_one_ffn_per_token(num_tokens, gated):
    """dense_expert = silu(x W1g^T) * (x W1u^T) W2^T per token, times the row weight if given;
    no alignment and no top-k sum launch (the block map is computed in the kernel)."""
    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels.formats import FORMATS

    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 32, generator=g).to(DEVICE)
    w1 = (torch.randn(2 * 16, 32, generator=g) / 32**0.5).to(DEVICE)
    w2 = (torch.randn(32, 16, generator=g) / 16**0.5).to(DEVICE)
    weight = torch.rand(num_tokens, 1, generator=g).to(DEVICE) if gated else None
    config = MoEConfig(16, GemmTiles(16, 16), GemmTiles(16, 16))
    with record_launches() as launches:
        out = index_gather.dense_expert(x, w1, w2, fmt=FORMATS["none"], config=config, weight=weight)
    want = silu_and_mul_reference(x.double() @ w1.double().T) @ w2.double().T
    want = want if weight is None else want * weight.double()
    assert out.shape == (num_tokens, 32)
    if num_tokens:
        assert rel_err(out, want) < TOLERANCE[torch.float32]
    assert all(name == "index_gather.gemm" and settings["dense"] for name, settings in launches), launches
    from moe_kernels._runtime import BACKEND
    assert len(launches) == (2 if num_tokens and BACKEND != "torch" else 0), launches


@pytest.mark.parametrize("fmt", ["none", "block"])
def test_dense_expert_without_triton(fmt):
    """The torch path of the dense expert (no Triton: macOS, MOE_KERNELS_BACKEND=torch), bf16-free
    and fp8, against the per-token reference on the same quantised numbers."""
    from unittest import mock

    from moe_kernels.kernels.formats import FORMATS
    from moe_kernels.reference import moe_reference_fp8

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=g)
    w1 = torch.randn(2 * 128, 256, generator=g) / 16
    w2 = torch.randn(256, 128, generator=g) / 11
    form = FORMATS[fmt]
    scales = {}
    if form.quantized:
        (w1, s1), (w2, s2) = form.quantize_weight(w1[None]), form.quantize_weight(w2[None])
        w1, w2, scales = w1[0], w2[0], dict(w1_scale=s1[0], w2_scale=s2[0])
    config = MoEConfig(16, GemmTiles(16, 32), GemmTiles(16, 32))
    with mock.patch.object(index_gather, "use_triton", lambda *tensors: False):
        out = index_gather.dense_expert(x, w1, w2, fmt=form, config=config, **scales)
    ids, weights = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    want = moe_reference(x, w1[None], w2[None], weights, ids) if not form.quantized else moe_reference_fp8(
        x, w1[None], w2[None], weights, ids, w1_scale=scales["w1_scale"][None], w2_scale=scales["w2_scale"][None],
        granularity=fmt, intermediate_dtype=x.dtype)
    assert out.shape == (3, 256) and rel_err(out, want) < 1e-5


def test_a_dense_block_map_is_checked_when_built_by_hand():
    with pytest.raises(ValueError, match="dense"):
        blocks.BlockAssignment(16, torch.zeros(1, dtype=torch.int32), torch.zeros(16, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), 1, num_assignments=16, dense=True)
    with pytest.raises(ValueError, match="num_m_blocks"):
        blocks.BlockAssignment(16, torch.zeros(1, dtype=torch.int32), None, None, 2, num_assignments=40, dense=True)
    ok = blocks.BlockAssignment(16, torch.zeros(1, dtype=torch.int32), None, None, 3, num_assignments=40, dense=True)
    assert ok.dense and not ok.naive


def test_the_top_k_sum_adds_a_shared_output_before_rounding():
    from moe_kernels.kernels.combine import moe_sum_reference, sum_slots

    g = torch.Generator().manual_seed(3)
    per_slot = torch.randn(5, 3, 40, generator=g).to(DEVICE)
    shared = torch.randn(5, 40, generator=g).to(DEVICE)
    want = per_slot.double().sum(1) + shared.double()
    assert rel_err(sum_slots(per_slot, add=shared), want) < 1e-6
    assert rel_err(moe_sum_reference(per_slot.cpu(), shared.cpu()), want.cpu()) < 1e-6
    assert rel_err(sum_slots(per_slot[:, :0], add=shared), shared.double()) < 1e-6   # k = 0: the addend alone


def _with_a_callable_addend(seed, **config_fields):
    """``run_experts`` on a small problem with a tensor addend, then with a callable returning it: the reference
    (routed experts and the addend, float64), both outputs, the launches seen when the callable was called, and
    all the second call's launches (by name)."""
    import dataclasses

    from moe_kernels._runtime import record_launches
    from moe_kernels.kernels.config import default_config
    from moe_kernels.kernels.formats import FORMATS

    p = shared_problem(7, 6, 2, 32, 16, torch.float32, seed=seed)
    config = dataclasses.replace(default_config(7, 6, 16, 32), **config_fields)
    shared = torch.randn(7, 32, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    calls = []

    def run(add):
        return index_gather.run_experts(p["hidden"], p["w1"], p["w2"], p["weights"], p["ids"], fmt=FORMATS["none"],
                                        config=config, add=add)

    want = run(shared)
    with record_launches() as launches:
        got = run(lambda: calls.append([name for name, _ in launches]) or shared)
    assert len(calls) == 1   # called once
    reference = moe_reference(p["hidden"], p["w1"], p["w2"], p["weights"], p["ids"]) + shared.double()
    return reference, want, got, calls[0], [name for name, _ in launches]


@pytest.mark.parametrize("sum_in_gemm", [False, True])
def test_a_callable_addend_is_called_once_after_the_gemms_and_adds_the_same(sum_in_gemm):
    """``run_experts(add=callable)`` (how a shared expert on a side stream joins: moe_kernels.layer_shared): the
    callable is called once, after both GEMMs are launched, and the output equals that with the tensor itself."""
    from moe_kernels._runtime import BACKEND

    reference, want, got, before, names = _with_a_callable_addend(21, sum_in_gemm=sum_in_gemm)
    assert torch.equal(got, want)
    if BACKEND != "torch":   # both GEMMs launched before the join; after it only the top-k sum (none: summed in GEMM 2)
        assert before.count("index_gather.gemm") == 2, before
        assert names[len(before):] == ([] if sum_in_gemm else ["combine.moe_sum"]), names
    assert rel_err(want, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("phases", [1, 2])
def test_a_callable_addend_joins_after_the_launch_where_both_gemms_are_one(phases):
    """Where both GEMMs are one launch (one_launch, two_phase), a tensor addend is read by its kernel, but a
    callable (a forked shared expert) is called once after the launch and its result added then: the launch runs
    beside the side stream instead of waiting for it. Same values, to one rounding of the output dtype more."""
    from moe_kernels._runtime import BACKEND
    from moe_kernels.kernels.config import OneLaunchTiles

    tiles = OneLaunchTiles(16, 16, phases=phases, **({"block_k": 16, "num_stages": 2} if phases == 2 else {}))
    reference, want, got, before, names = _with_a_callable_addend(22, one_launch=tiles)
    assert rel_err(got, want.double()) < TOLERANCE[torch.float32]
    if BACKEND != "torch":   # the one launch before the join, nothing after it (the addition is a torch op)
        assert [n.split(".")[0] for n in before] == ["two_phase" if phases == 2 else "one_launch"], before
        assert names[len(before):] == [], names
    assert rel_err(got, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("phases", [1, 2])
def test_a_column_strided_tensor_addend_is_read_right_where_both_gemms_are_one(phases):
    """A tensor addend reaches the one-launch kernels, which read it by its row stride: one whose columns are not
    adjacent (a transposed copy's transpose) gives the same output as the contiguous one."""
    import dataclasses

    from moe_kernels.kernels.config import OneLaunchTiles, default_config
    from moe_kernels.kernels.formats import FORMATS

    p = shared_problem(7, 6, 2, 32, 16, torch.float32, seed=23)
    tiles = OneLaunchTiles(16, 16, phases=phases, **({"block_k": 16, "num_stages": 2} if phases == 2 else {}))
    config = dataclasses.replace(default_config(7, 6, 16, 32), one_launch=tiles)
    shared = torch.randn(7, 32, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    strided = shared.t().contiguous().t()
    assert strided.stride(1) != 1 and torch.equal(strided, shared)
    outs = [index_gather.run_experts(p["hidden"], p["w1"], p["w2"], p["weights"], p["ids"], fmt=FORMATS["none"],
                                     config=config, add=add) for add in (shared, strided)]
    assert torch.equal(*outs)

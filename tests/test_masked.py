"""The masked ``[E, m_max, d]`` layout against the float64 direct reference, plus its pieces.

Runs on ``default_device()``: the Triton interpreter on a CPU machine, the compiled kernels on a
GPU (where the bf16 cases also run). Shapes are small because the interpreter is slow.
"""

import random
import re

import pytest
import torch

from moe_kernels.kernels import combine as combine_module
from moe_kernels.kernels import masked as masked_module
from moe_kernels.kernels.masked import grouped_gemm_masked, masked_dispatch, masked_dispatch_reference, masked_experts
from moe_kernels.model.buffers import (
    choose_layout,
    compact_buffer_bytes,
    m_max_measured_cap,
    m_max_token_budget,
    masked_buffer_bytes,
    max_padded_rows,
)
from moe_kernels.reference import moe_reference, silu_and_mul_reference
from moe_testing import (
    DEVICE,
    EDGE_SHAPES,
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


def hottest(ids, num_experts):
    return int(torch.bincount(ids.flatten().cpu(), minlength=num_experts).max())


# ------------------------------------------------------------------------------------------
# end to end against the float64 reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_masked_experts_random(seed):
    shape, rng = random_shape(1000 + seed, [torch.float32, torch.float16])
    num_experts = shape["num_experts"]
    x, w1, w2, weights, ids = make_problem(**shape, seed=seed)
    policy = rng.choice(["token budget", "measured cap", "exact"])
    m_max = {"token budget": None,
             "measured cap": m_max_measured_cap(ids, num_experts, block=rng.choice([16, 256])),
             "exact": hottest(ids, num_experts)}[policy]
    out = masked_experts(x, w1, w2, weights, ids, m_max=m_max, config=rng.choice([None, SMALL_TILES]))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[x.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(EDGE_SHAPES))
def test_masked_experts_edge_cases(case, dtype):
    x, w1, w2, weights, ids = make_problem(**EDGE_SHAPES[case], hidden=24, inter=16, dtype=dtype,
                                           seed=7)
    out = masked_experts(x, w1, w2, weights, ids, m_max=48, config=SMALL_TILES)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < TOLERANCE[dtype]


def test_expert_with_no_tokens_and_all_tokens_on_one_expert():
    for x, w1, w2, weights, ids in skewed_problems():
        out = masked_experts(x, w1, w2, weights, ids, m_max=7, config=SMALL_TILES)
        assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-5
    assert masked_dispatch(x, ids, 4, m_max=7).masked_m.tolist() == [0, 0, 7, 0]


def test_masked_experts_bf16_on_this_machine():
    """bf16 on the interpreter takes the documented float32 detour around tl.dot."""
    x, w1, w2, weights, ids = make_problem(6, 4, 2, 24, 16, torch.bfloat16, seed=11)
    out = masked_experts(x, w1, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-2


@needs_gpu
@pytest.mark.parametrize("seed", range(6))
def test_masked_experts_bf16_gpu(seed):
    x, w1, w2, weights, ids = gpu_sized_bf16_problem(seed)
    out = masked_experts(x, w1, w2, weights, ids)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-2


def test_torch_fallback_when_triton_is_unavailable(monkeypatch):
    """Without Triton every step runs its torch reference and the answer is the same."""
    monkeypatch.setattr(masked_module, "use_triton", lambda *tensors: False)
    monkeypatch.setattr(combine_module, "use_triton", lambda *tensors: False)
    x, w1, w2, weights, ids = make_problem(9, 4, 2, 24, 16, torch.float32, seed=5)
    out = masked_experts(x, w1, w2, weights, ids, m_max=20)
    assert rel_err(out, moe_reference(x, w1, w2, weights, ids)) < 1e-5


# ------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------


def check_masked_layout(d, x, ids, num_experts, m_max, poisoned):
    assert d.rows.shape == (num_experts, m_max, x.shape[1])
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert d.masked_m.tolist() == counts.tolist()
    dst = d.src2dst.flatten().long().cpu()
    assert torch.equal(dst // m_max, ids.flatten().long().cpu())      # each row in its expert's slab
    for e in range(num_experts):                                       # slots 0..count-1, once each
        slots = sorted((dst[dst // m_max == e] % m_max).tolist())
        assert slots == list(range(int(counts[e])))
    tokens = torch.arange(ids.numel(), device=x.device) // ids.shape[1]
    assert torch.equal(d.rows.view(-1, x.shape[1])[d.src2dst.flatten().long()], x[tokens])
    if poisoned:
        unused = torch.arange(m_max)[None, :] >= counts[:, None]
        assert d.rows[unused.to(DEVICE)].isnan().all()                 # never written


@pytest.mark.parametrize("seed", range(10))
def test_masked_dispatch_layout(seed):
    rng = random.Random(2000 + seed)
    num_experts = rng.randint(1, 8)
    x, _, _, _, ids = make_problem(rng.randint(1, 12), num_experts,
                                   rng.randint(1, num_experts), 24, 16, torch.float16, seed=seed)
    m_max = hottest(ids, num_experts) + rng.choice([0, 3])
    out = torch.full((num_experts, m_max, 24), float("nan"), dtype=x.dtype, device=DEVICE)
    d = masked_dispatch(x, ids, num_experts, m_max=m_max, out=out)
    assert d.rows is out
    check_masked_layout(d, x, ids, num_experts, m_max, poisoned=True)
    check_masked_layout(masked_dispatch_reference(x, ids, num_experts, m_max=m_max), x, ids,
                        num_experts, m_max, poisoned=False)


@pytest.mark.parametrize("dispatch", [masked_dispatch, masked_dispatch_reference])
def test_overflow_raises_instead_of_dropping(dispatch):
    if DEVICE.type == "cuda" and dispatch is masked_dispatch:
        pytest.skip("on a GPU the overflow is a device-side assert (test_device_asserts_name_the_argument)")
    x, _, _, _, ids = make_problem(9, 3, 1, 16, 16, torch.float32, seed=4,
                                   topk_ids=torch.tensor([[0]] * 5 + [[1]] * 3 + [[2]]))
    message = "'m_max' must be >= 5 (the hottest expert's row count; no token is dropped), got 4"
    with pytest.raises(ValueError, match=re.escape(message)):
        dispatch(x, ids, 3, m_max=4)
    assert dispatch(x, ids, 3, m_max=5).masked_m.tolist() == [5, 3, 1]
    # A token naming the same expert twice is the one way to beat the token budget.
    twice = torch.tensor([[1, 1]], device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("'m_max' must be >= 2")):
        dispatch(x[:1], twice, 3, m_max=1)


def test_dispatch_rejects_bad_ids_after_counting():
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU a bad id is a device-side assert (test_device_asserts_name_the_argument)")
    x, _, _, _, ids = make_problem(3, 3, 2, 16, 16, torch.float32, seed=4)
    for bad in (3, -1):
        with pytest.raises(ValueError, match=re.escape("'topk_ids' must hold expert ids in [0, 3)")):
            masked_dispatch(x, torch.full_like(ids, bad), 3, m_max=8)


# ------------------------------------------------------------------------------------------
# the masked grouped GEMM
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_gemm_masked_skips_unused_rows(silu_mul, dtype):
    num_experts, m_max = 4, 40
    masked_m = torch.tensor([0, 17, 40, 3], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(num_experts, m_max, 40, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(num_experts, 48, 40, generator=gen) / 6).to(DEVICE, dtype)
    used = (torch.arange(m_max, device=DEVICE)[None, :] < masked_m[:, None].long())
    x[~used] = float("nan")                                          # never read
    n = 24 if silu_mul else 48
    out = torch.full((num_experts, m_max, n), float("nan"), dtype=dtype, device=DEVICE)
    grouped_gemm_masked(x, w, masked_m, silu_mul=silu_mul, out=out, config=SMALL_TILES)
    assert out[~used].isnan().all()                                  # never written
    h = torch.einsum("emk,enk->emn", x.double().nan_to_num(), w.double())
    expected = silu_and_mul_reference(h) if silu_mul else h
    assert rel_err(out[used], expected[used]) < TOLERANCE[dtype]


# ------------------------------------------------------------------------------------------
# m_max policies, memory, layout choice
# ------------------------------------------------------------------------------------------


def test_m_max_token_budget():
    assert [m_max_token_budget(t) for t in (0, 1, 255, 256, 16384)] == [256, 256, 256, 512, 16640]
    assert m_max_token_budget(100, block=64) == 128
    for t in range(1, 600, 37):                        # room for every token on one expert
        assert m_max_token_budget(t) > t


def test_m_max_measured_cap():
    ids = torch.tensor([[0, 1]] * 300 + [[2, 1]] * 10, device=DEVICE)   # expert 1 holds 310 rows
    assert m_max_measured_cap(ids, 3) == 512
    assert m_max_measured_cap(ids, 3, block=64) == 320
    assert m_max_measured_cap(ids[:3], 3) == 256                         # never below one block
    assert m_max_measured_cap(ids, 3) <= m_max_token_budget(ids.shape[0])
    with pytest.raises(ValueError, match=re.escape("'topk_ids' must hold expert ids in [0, 2)")):
        m_max_measured_cap(ids, 2)


def test_buffer_bytes_at_real_shapes():
    # Qwen3-30B-A3B: E = 128, d = 2048, F = 768, top-8, bf16.
    assert masked_buffer_bytes(128, 16640, 2048, 768, torch.bfloat16) == 128 * 16640 * 2816 * 2
    rows = max_padded_rows(16384 * 8, 128, 128)
    assert rows == 128 * (128 + (16384 * 8 - 128) // 128)
    assert compact_buffer_bytes(16384, 8, 128, 2048, 768, torch.bfloat16) == rows * 2816 * 2
    # DeepSeek-V3 shapes (E = 256, d = 7168, F = 2048) at one decode token: compact needs 8 blocks.
    assert compact_buffer_bytes(1, 8, 256, 7168, 2048, torch.bfloat16) == 1024 * 9216 * 2


def test_choose_layout_by_budget():
    args = (64, 8, 128, 2048, 768, torch.bfloat16)
    masked_bytes = masked_buffer_bytes(128, m_max_token_budget(64), 2048, 768, torch.bfloat16)
    assert choose_layout(*args, budget_bytes=masked_bytes) == "masked"
    assert choose_layout(*args, budget_bytes=masked_bytes - 1) == "compact"
    assert choose_layout(16384, 8, 128, 2048, 768, torch.bfloat16, budget_bytes=2**30) == "compact"


# ------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    problem = make_problem(4, 3, 2, 16, 16, torch.float32, seed=1)
    x, w1, w2, weights, ids = problem
    assert_each_raises(masked_experts, problem, [
        (dict(w1=w1[:2]), ValueError, "'w2' must have shape [E=2, d=16, F=16] to match w1"),
        (dict(w1=w1.half()), TypeError, "'w1' must have dtype float32"),
        (dict(topk_weights=weights.long()), TypeError, "'topk_weights' must have dtype"),
        (dict(topk_ids=ids.to("meta")), ValueError, "'topk_ids' must be on device"),
        (dict(topk_weights=weights.T.contiguous().T), ValueError,
         "'topk_weights' must be contiguous in its last dimension"),
        (dict(topk_ids=torch.full_like(ids, 5)), ValueError, "expert ids in [0, 3)"),
        (dict(m_max=0), ValueError, "'m_max' must be >= 1"),
        (dict(m_max=1), ValueError, "'m_max' must be >= "),
        (dict(m_max=2.5), TypeError, "'m_max' must be an int"),
    ])
    with pytest.raises(ValueError, match=re.escape("'out' must have shape (3, 8, 16)")):
        masked_dispatch(x, ids, 3, m_max=8, out=torch.empty(3, 7, 16, device=DEVICE))
    with pytest.raises(ValueError, match=re.escape("'masked_m' must have shape [3]")):
        grouped_gemm_masked(torch.zeros(3, 8, 16, device=DEVICE), w1,
                            torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=re.escape("'w' must have an even number of rows")):
        grouped_gemm_masked(torch.zeros(3, 8, 16, device=DEVICE), w1[:, :31],
                            torch.zeros(3, dtype=torch.int32, device=DEVICE), silu_mul=True)


def test_overflow_is_checked_even_without_id_validation():
    """validate_ids=False skips the id check only: a token naming one expert twice can overflow a
    token-budget m_max, and that still fails instead of dropping an assignment."""
    x = torch.randn(4, 8, device=DEVICE)
    ids = torch.tensor([[0], [0], [0], [1]], device=DEVICE)
    rows = masked_dispatch(x, ids, 2, m_max=4, validate_ids=False)
    assert rows.masked_m.tolist() == [3, 1]
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU the overflow is a device-side assert (test_device_asserts_name_the_argument)")
    with pytest.raises(ValueError, match=re.escape("masked_dispatch: argument 'm_max' must be >= 3")):
        masked_dispatch(x, ids, 2, m_max=2, validate_ids=False)
    twice = torch.tensor([[1, 1], [1, 0]], device=DEVICE)   # m_max >= T = 2, yet expert 1 gets 3 rows
    with pytest.raises(ValueError, match=re.escape("argument 'm_max' must be >= 3")):
        masked_experts(x[:2], torch.randn(2, 16, 8, device=DEVICE), torch.randn(2, 8, 8, device=DEVICE),
                       torch.ones(2, 2, device=DEVICE), twice, m_max=2, validate_ids=False)


def test_empty_batch():
    x, w1, w2, weights, ids = make_problem(4, 3, 2, 16, 16, torch.float32, seed=1)
    assert masked_experts(x[:0], w1, w2, weights[:0], ids[:0]).shape == (0, 16)


@needs_gpu
@pytest.mark.parametrize("case", ["bad id", "overflow"])
def test_device_asserts_name_the_argument(case):
    """On a GPU the dispatch kernel itself stops on a bad id or an overflowing m_max (no launch and
    no host sync of its own); the process's CUDA context is then gone, so it runs in a subprocess."""
    ids, m_max, message = {"bad id": ("[[0, 3], [1, 2]]", 8, "masked_dispatch: argument 'topk_ids' must hold expert "
                                      "ids in [0, 3)"),
                           "overflow": ("[[0], [0], [0], [1]]", 2, "masked_dispatch: argument 'm_max' is smaller than "
                                        "the hottest expert's row count")}[case]
    assert_device_assert(f"""
        from moe_kernels.kernels.masked import masked_dispatch
        ids = torch.tensor({ids}, device="cuda")
        masked_dispatch(torch.randn(ids.shape[0], 16, device="cuda"), ids, 3, m_max={m_max})
        """, message)

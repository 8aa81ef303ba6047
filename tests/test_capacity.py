"""Capacity factors and token dropping, and the dropless rule that replaces them at inference.

Runs on ``default_device()``: the Triton interpreter on a CPU machine, the compiled kernels on a
GPU (where the bf16 case also runs). Shapes are small because the interpreter is slow.
"""

import itertools
import random
import re
from fractions import Fraction

import pytest
import torch

from moe_kernels.kernels.dropping import moe_with_capacity
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.masked import masked_experts
from moe_kernels.kernels.permute import permute_experts
from moe_kernels.model.buffers import (
    compact_buffer_bytes,
    m_max_measured_cap,
    m_max_token_budget,
    masked_buffer_bytes,
    max_padded_rows,
)
from moe_kernels.model.capacity import (
    BufferSpec,
    capacity_assign,
    dropless_buffers,
    dropped_fraction,
    ensure_capacity,
    expected_dropped_fraction,
    expert_capacity,
    expert_queue_positions,
    monte_carlo_dropped_fraction,
)
from moe_kernels.model.skew import zipf_popularity
from moe_kernels.reference import moe_reference
from moe_testing import assert_device_assert, DEVICE, TOLERANCE, make_problem, needs_gpu, random_topk_ids, rel_err




def queue_positions_by_loop(topk_ids, num_experts):
    """The priority rule spelled out: walk choice by choice, token by token."""
    ids = topk_ids.cpu().tolist()
    filled = [0] * num_experts
    positions = [[None] * len(row) for row in ids]
    for j in range(len(ids[0]) if ids else 0):
        for t, row in enumerate(ids):
            positions[t][j] = filled[row[j]]
            filled[row[j]] += 1
    return torch.tensor(positions, dtype=torch.int64).reshape(topk_ids.shape)


# ------------------------------------------------------------------------------------------
# the capacity
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    ((4096, 8, 256, 1.25), 160),      # DeepSeek-V3: mean 128 rows, 1.25 x
    ((2048, 8, 128, 1.0), 128),       # Qwen3-30B-A3B: mean 128 rows
    ((12, 2, 4, 1.0), 6),
    ((7, 2, 4, 1.0), 4),              # 3.5 rounds up
    ((7, 2, 4, 0.5), 2),              # 1.75 rounds up
    ((10, 1, 1, 1.1), 11),            # exact decimal: 11, not ceil(11.000000000000002) = 12
    ((3, 1, 10, 1.0), 1),             # below one row still gets one
    ((0, 2, 4, 1.0), 0),              # no tokens, no rows
    ((100, 8, 256, 32.0), 100),       # alpha = E/k: the whole batch
    ((100, 3, 8, 8 / 3), 100),        # alpha = E/k, not a finite binary fraction
    ((9, 2, 6, Fraction(4, 3)), 4),   # 4/3 * 18 / 6 = 4 exactly
    ((9, 2, 6, 2), 6),                # an int factor
])
def test_expert_capacity_hand_computed(args, expected):
    assert expert_capacity(*args) == expected


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 1000])
@pytest.mark.parametrize("num_experts, topk", [(8, 2), (256, 8), (128, 8), (6, 6), (7, 1)])
def test_capacity_factor_e_over_k_is_the_token_budget(num_tokens, num_experts, topk):
    assert expert_capacity(num_tokens, topk, num_experts, num_experts / topk) == num_tokens


@pytest.mark.parametrize("kwargs, name, exc", [
    (dict(capacity_factor=0.0), "capacity_factor", ValueError),
    (dict(capacity_factor=-1.0), "capacity_factor", ValueError),
    (dict(capacity_factor=float("nan")), "capacity_factor", ValueError),
    (dict(capacity_factor=float("inf")), "capacity_factor", ValueError),
    (dict(capacity_factor=True), "capacity_factor", TypeError),
    (dict(capacity_factor="1.0"), "capacity_factor", TypeError),
    (dict(num_tokens=-1), "num_tokens", ValueError),
    (dict(num_tokens=4.0), "num_tokens", TypeError),
    (dict(top_k=0), "top_k", ValueError),
    (dict(top_k=9), "top_k", ValueError),
    (dict(num_experts=0), "num_experts", ValueError),
])
def test_expert_capacity_bad_inputs(kwargs, name, exc):
    args = dict(num_tokens=16, top_k=2, num_experts=8, capacity_factor=1.0) | kwargs
    with pytest.raises(exc, match=rf"expert_capacity: argument '{name}'"):
        expert_capacity(**args)


# ------------------------------------------------------------------------------------------
# who keeps a slot
# ------------------------------------------------------------------------------------------


def routing_cases():
    gen = torch.Generator().manual_seed(7)
    cases = [
        torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]]),          # the module's worked example
        torch.tensor([[3]]),                                      # one token, k = 1
        torch.zeros(9, 1, dtype=torch.int64),                     # all on one expert
        torch.arange(4).repeat(5, 1),                              # k = E
        torch.tensor([[1, 0]] * 6 + [[0, 1]] * 6),                 # two experts, swapped orders
    ]
    for _ in range(20):
        num_experts = int(torch.randint(1, 9, (1,), generator=gen))
        topk = int(torch.randint(1, num_experts + 1, (1,), generator=gen))
        num_tokens = int(torch.randint(1, 30, (1,), generator=gen))
        cases.append(random_topk_ids(gen, num_tokens, num_experts, topk))
    return cases


@pytest.mark.parametrize("case", range(len(routing_cases())))
def test_queue_positions_follow_the_priority_rule(case):
    ids = routing_cases()[case]
    num_experts = int(ids.max()) + 1
    positions = expert_queue_positions(ids.to(DEVICE), num_experts)
    assert positions.dtype == torch.int64 and positions.shape == ids.shape
    assert torch.equal(positions.cpu(), queue_positions_by_loop(ids, num_experts))


@pytest.mark.parametrize("case", range(len(routing_cases())))
@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 5, 100])
def test_keep_mask_properties(case, capacity):
    ids = routing_cases()[case]
    num_experts = int(ids.max()) + 2  # one more expert that nobody picks
    keep = capacity_assign(ids.to(DEVICE), num_experts, capacity).cpu()
    assert keep.dtype == torch.bool and keep.shape == ids.shape
    loads = torch.bincount(ids.flatten(), minlength=num_experts)
    kept = torch.bincount(ids[keep], minlength=num_experts)
    # Each expert keeps min(load, C): never more than C, and nothing drops while it has room.
    assert torch.equal(kept, loads.clamp(max=capacity))
    # Priority: every kept assignment of an expert precedes (choice, token) every dropped one.
    for e in range(num_experts):
        t_idx, j_idx = torch.nonzero(ids == e, as_tuple=True)
        rank = j_idx * ids.shape[0] + t_idx
        kept_ranks, dropped_ranks = rank[keep[t_idx, j_idx]], rank[~keep[t_idx, j_idx]]
        if len(kept_ranks) and len(dropped_ranks):
            assert kept_ranks.max() < dropped_ranks.min()
    assert dropped_fraction(ids.to(DEVICE), num_experts, capacity) == int((~keep).sum()) / ids.numel()


def test_first_choices_beat_earlier_tokens_second_choices():
    # Token 0's second choice and token 1's first choice both want expert 0, capacity 1:
    # the first choice wins although token 0 comes first.
    ids = torch.tensor([[1, 0], [0, 2]], device=DEVICE)
    assert capacity_assign(ids, 3, 1).tolist() == [[True, False], [True, True]]


def test_large_capacity_factor_drops_nothing():
    gen = torch.Generator().manual_seed(3)
    for num_experts, topk, num_tokens in [(8, 2, 40), (16, 4, 9), (5, 5, 7), (64, 8, 33)]:
        ids = random_topk_ids(gen, num_tokens, num_experts, topk).to(DEVICE)
        capacity = expert_capacity(num_tokens, topk, num_experts, num_experts / topk)
        assert capacity_assign(ids, num_experts, capacity).all()
        assert dropped_fraction(ids, num_experts, capacity) == 0.0


@pytest.mark.parametrize("func, args, name, exc", [
    (capacity_assign, (torch.tensor([[0, 4]]), 4, 1), "topk_ids", ValueError),
    (capacity_assign, (torch.tensor([[-1, 0]]), 4, 1), "topk_ids", ValueError),
    (capacity_assign, (torch.tensor([[0.0, 1.0]]), 4, 1), "topk_ids", TypeError),
    (capacity_assign, (torch.tensor([0, 1]), 4, 1), "topk_ids", ValueError),
    (capacity_assign, (torch.tensor([[0, 1]]), 4, -1), "capacity", ValueError),
    (capacity_assign, (torch.tensor([[0, 1]]), 0, 1), "num_experts", ValueError),
    (expert_queue_positions, (torch.tensor([[0, 9]]), 4), "topk_ids", ValueError),
    (dropped_fraction, (torch.tensor([[0, 1]]), 4, 1.5), "capacity", TypeError),
])
def test_assignment_bad_inputs(func, args, name, exc):
    with pytest.raises(exc, match=rf"{func.__name__}: argument '{name}'"):
        func(*args)


# ------------------------------------------------------------------------------------------
# the layer with a capacity, against the float64 reference
# ------------------------------------------------------------------------------------------


EDGE_CASES = {
    "one token": dict(num_tokens=1, num_experts=4, topk=2),
    "k = 1": dict(num_tokens=12, num_experts=4, topk=1),
    "k = E": dict(num_tokens=6, num_experts=4, topk=4),
    "an expert with no tokens": dict(num_tokens=10, num_experts=5, topk=2,
                                     topk_ids=torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]] * 2
                                                           + [[0, 2], [1, 3]])),
    "all tokens on one expert": dict(num_tokens=9, num_experts=3, topk=1,
                                     topk_ids=torch.zeros(9, 1, dtype=torch.int64)),
}


def check_against_kept_reference(x, w1, w2, weights, ids, alpha):
    num_tokens, topk = ids.shape
    num_experts = w1.shape[0]
    out = moe_with_capacity(x, w1, w2, weights, ids, capacity_factor=alpha)
    assert out.shape == x.shape and out.dtype == x.dtype
    keep = capacity_assign(ids, num_experts, expert_capacity(num_tokens, topk, num_experts, alpha))
    kept_weights = torch.where(keep, weights, torch.zeros_like(weights))
    reference = moe_reference(x, w1, w2, kept_weights, ids)
    assert rel_err(out, reference) < TOLERANCE[x.dtype]
    # A token that lost every assignment gets exactly nothing from the layer.
    lost = ~keep.any(dim=1)
    assert torch.equal(out[lost], torch.zeros_like(out[lost]))
    return keep


@pytest.mark.parametrize("name", EDGE_CASES)
@pytest.mark.parametrize("alpha", [0.5, 1.0, 1.5])
def test_moe_with_capacity_edge_cases(name, alpha):
    check_against_kept_reference(*make_problem(**EDGE_CASES[name], seed=11), alpha)


@pytest.mark.parametrize("seed", range(12))
def test_moe_with_capacity_random(seed):
    rng = random.Random(500 + seed)
    num_experts = rng.randint(1, 8)
    shape = dict(num_tokens=rng.randint(1, 24), num_experts=num_experts,
                 topk=rng.randint(1, num_experts), hidden=rng.choice([16, 32]),
                 inter=rng.choice([16, 24]), dtype=rng.choice([torch.float32, torch.float16]))
    alpha = rng.choice([0.25, 0.75, 1.0, 1.25, 2.0])
    check_against_kept_reference(*make_problem(**shape, seed=seed), alpha)


def test_dropped_tokens_get_exactly_zero():
    # k = 1, all nine tokens on expert 0, alpha = 1 with E = 3: C = 3, tokens 3..8 drop.
    x, w1, w2, weights, ids = make_problem(**EDGE_CASES["all tokens on one expert"], seed=5)
    out = moe_with_capacity(x, w1, w2, weights, ids, capacity_factor=1.0)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert bool((out[:3].abs().sum(dim=1) > 0).all())


def test_capacity_e_over_k_is_the_dropless_layer():
    x, w1, w2, weights, ids = make_problem(num_tokens=20, num_experts=8, topk=2, seed=8)
    assert torch.equal(moe_with_capacity(x, w1, w2, weights, ids, capacity_factor=8 / 2),
                       fused_experts(x, w1, w2, weights, ids))


@needs_gpu
def test_moe_with_capacity_bf16():
    x, w1, w2, weights, ids = make_problem(num_tokens=300, num_experts=16, topk=4, hidden=128,
                                           inter=64, dtype=torch.bfloat16, seed=9)
    keep = check_against_kept_reference(x, w1, w2, weights, ids, 1.0)
    assert not bool(keep.all())


def test_moe_with_capacity_bad_inputs():
    x, w1, w2, weights, ids = make_problem(num_tokens=4, num_experts=4, topk=2, seed=1)
    with pytest.raises(ValueError, match="moe_with_capacity: argument 'capacity_factor'"):
        moe_with_capacity(x, w1, w2, weights, ids, capacity_factor=0.0)
    with pytest.raises(ValueError, match="moe_with_capacity: argument 'w2'"):
        moe_with_capacity(x, w1, w2[:, :, :-1], weights, ids, capacity_factor=1.0)
    message = "capacity_assign: argument 'topk_ids' must hold expert ids in [0, 4)"
    if DEVICE.type == "cuda":
        assert_device_assert(f"""
            from moe_kernels.kernels.dropping import moe_with_capacity
            w1, w2 = torch.randn(4, 32, 32, device="cuda"), torch.randn(4, 32, 16, device="cuda")
            ids = torch.tensor({(ids + 4).tolist()}, device="cuda")
            moe_with_capacity(torch.randn(4, 32, device="cuda"), w1, w2, torch.rand(4, 2, device="cuda"), ids,
                              capacity_factor=1.0)
            """, message)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            moe_with_capacity(x, w1, w2, weights, ids + 4, capacity_factor=1.0)


# ------------------------------------------------------------------------------------------
# how much drops: the exact expectation against enumeration and sampling
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, num_experts, topk, alpha", [
    (3, 4, 2, 1.0), (3, 4, 2, 0.5), (4, 3, 1, 1.0), (2, 5, 3, 1.0), (4, 4, 1, 1.5), (1, 6, 2, 0.1),
])
def test_expected_dropped_fraction_matches_enumeration(num_tokens, num_experts, topk, alpha):
    # Uniform routing: every token picks each k-subset with equal probability. Average the
    # measured dropped fraction over every routing of the batch.
    subsets = [list(c) for c in itertools.combinations(range(num_experts), topk)]
    capacity = expert_capacity(num_tokens, topk, num_experts, alpha)
    total = 0.0
    for choice in itertools.product(subsets, repeat=num_tokens):
        total += dropped_fraction(torch.tensor(choice), num_experts, capacity)
    exact = total / len(subsets) ** num_tokens
    assert expected_dropped_fraction(num_tokens, topk, num_experts, alpha) == pytest.approx(exact, abs=1e-12)


@pytest.mark.parametrize("num_tokens, num_experts, topk, alpha, s", [
    (64, 16, 2, 1.0, None), (64, 16, 2, 1.25, 0.0), (200, 32, 4, 1.0, 0.7), (50, 8, 3, 1.5, 1.5),
    (128, 64, 8, 0.75, 1.0),
])
def test_expected_dropped_fraction_matches_monte_carlo(num_tokens, num_experts, topk, alpha, s):
    popularity = None if s is None else zipf_popularity(num_experts, s)
    analytic = expected_dropped_fraction(num_tokens, topk, num_experts, alpha, popularity)
    sampled = monte_carlo_dropped_fraction(num_tokens, topk, num_experts, alpha, popularity,
                                           trials=400, seed=1)
    assert 0.0 < analytic < 1.0
    # 400 trials of B*k assignments: the standard error is about 0.001 at these sizes.
    assert sampled == pytest.approx(analytic, abs=0.004)


def test_expected_dropped_fraction_limits():
    assert expected_dropped_fraction(1000, 8, 256, 256 / 8) == 0.0    # alpha = E/k: C = B
    assert expected_dropped_fraction(1, 8, 256, 1.0) == 0.0           # one token cannot collide
    assert expected_dropped_fraction(0, 8, 256, 1.0) == 0.0
    # Skew only adds drops, and a larger factor only removes them.
    uniform = expected_dropped_fraction(512, 8, 128, 1.0)
    assert expected_dropped_fraction(512, 8, 128, 1.0, zipf_popularity(128, 1.0)) > uniform
    assert expected_dropped_fraction(512, 8, 128, 1.5) < uniform
    assert expected_dropped_fraction(512, 8, 128, 1.0, zipf_popularity(128, 0.0)) == pytest.approx(uniform)


def test_expected_dropped_fraction_bad_inputs():
    with pytest.raises(ValueError, match="expected_dropped_fraction: argument 'popularity'"):
        expected_dropped_fraction(16, 2, 8, 1.0, torch.ones(7))
    with pytest.raises(ValueError, match="expected_dropped_fraction: argument 'top_k'"):
        expected_dropped_fraction(16, 9, 8, 1.0)
    with pytest.raises(ValueError, match="monte_carlo_dropped_fraction: argument 'trials'"):
        monte_carlo_dropped_fraction(16, 2, 8, 1.0, trials=0)


# ------------------------------------------------------------------------------------------
# the dropless buffers and the overflow rule
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_dropless_buffers_use_the_layout_byte_functions(num_tokens):
    E, k, d, F, dtype = 128, 8, 2048, 768, torch.bfloat16
    ids = random_topk_ids(torch.Generator().manual_seed(num_tokens), num_tokens, E, k)
    compact, budget, cap = dropless_buffers(ids, E, d, F, dtype)
    assert [b.strategy for b in (compact, budget, cap)] == [
        "compact", "masked, token budget", "masked, measured cap"]
    assert compact.nbytes == compact_buffer_bytes(num_tokens, k, E, d, F, dtype)
    assert compact.rows == max_padded_rows(num_tokens * k, E, 128)
    assert budget.nbytes == masked_buffer_bytes(E, m_max_token_budget(num_tokens), d, F, dtype)
    assert cap.nbytes == masked_buffer_bytes(E, m_max_measured_cap(ids, E), d, F, dtype)
    assert [b.host_sync for b in (compact, budget, cap)] == [False, False, True]
    for b in (compact, budget, cap):
        assert b.capacity_factor == pytest.approx(b.rows / (num_tokens * k))
        assert b.capacity_factor >= 1.0        # dropless: room for every assignment
    assert budget.capacity_factor >= E / k     # the token budget is a capacity factor of E/k
    assert cap.nbytes <= budget.nbytes


def test_ensure_capacity_keeps_a_buffer_that_fits():
    ids = torch.tensor([[0, 1], [0, 2], [1, 2]], device=DEVICE)
    assert ensure_capacity(ids, 3, m_max=2) == BufferSpec("masked", 2, 6)


@pytest.mark.parametrize("on_overflow", ["raise", "resize", "compact"])
def test_ensure_capacity_never_drops(on_overflow):
    # All eight tokens pick expert 0 first: a static 4-row buffer overflows by 4 rows.
    ids = torch.stack([torch.zeros(8, dtype=torch.int64), torch.arange(1, 9) % 3 + 1], dim=1)
    x, w1, w2, weights, ids = make_problem(num_tokens=8, num_experts=4, topk=2, topk_ids=ids,
                                           seed=4)
    if on_overflow == "raise":
        with pytest.raises(ValueError, match=re.escape(
                "ensure_capacity: argument 'm_max' must be >= 8 (the hottest expert's row count")):
            ensure_capacity(ids, 4, m_max=4, on_overflow=on_overflow)
        return
    spec = ensure_capacity(ids, 4, m_max=4, on_overflow=on_overflow, block=16, align=16)
    reference = moe_reference(x, w1, w2, weights, ids)
    if on_overflow == "resize":
        assert spec == BufferSpec("masked", 16, 64)
        out = masked_experts(x, w1, w2, weights, ids, m_max=spec.m_max)
    else:
        assert spec == BufferSpec("compact", None, max_padded_rows(16, 4, 16))
        out = permute_experts(x, w1, w2, weights, ids, align=16)
    assert rel_err(out, reference) < TOLERANCE[torch.float32]


def test_ensure_capacity_bad_inputs():
    ids = torch.tensor([[0, 1]], device=DEVICE)
    with pytest.raises(ValueError, match="ensure_capacity: argument 'on_overflow'"):
        ensure_capacity(ids, 2, 1, on_overflow="drop")
    with pytest.raises(ValueError, match="ensure_capacity: argument 'topk_ids'"):
        ensure_capacity(ids + 1, 2, 4)
    with pytest.raises(ValueError, match="ensure_capacity: argument 'm_max'"):
        ensure_capacity(ids, 2, 0)
    with pytest.raises(ValueError, match="dropless_buffers: argument 'topk_ids'"):
        dropless_buffers(torch.zeros(0, 2, dtype=torch.int64), 4, 8, 8, torch.float32)


def test_bench_capacity_plan_reads_every_expert():
    """The capacity bench's closed form: C rows for each of the E experts, whatever the batch
    touches (a capacity layer's GEMMs run over its whole static buffer)."""
    from moe_kernels.bench.capacity import capacity_plan
    from moe_kernels.model.shapes import MODELS

    qwen = MODELS["qwen3-30b-a3b"]
    for batch, alpha in ((1, 1.0), (64, 1.25), (4096, 2.0)):
        plan = capacity_plan(qwen, batch, alpha)
        assert plan["capacity"] == -(-int(alpha * 100) * batch * qwen.top_k // (100 * qwen.num_experts))
        assert plan["rows_computed"] == qwen.num_experts * plan["capacity"] and plan["experts_read"] == 128


@needs_gpu
def test_bench_capacity_measures_after_checking():
    from moe_kernels.bench.capacity import measure
    from moe_kernels.bench.problems import make_weights
    from moe_kernels.model.shapes import MODELS

    w1, w2 = make_weights(MODELS["qwen3-30b-a3b"], torch.bfloat16, 0)
    row = measure("qwen3-30b-a3b", 64, 1.0, w1, w2, seed=1)
    assert row["capacity"] == 4 and row["rows_computed"] == 512 and row["rows_real"] == 512
    assert row["dropped"] > 0 and all(t is not None and t > 0 for t in row["times_us"].values())

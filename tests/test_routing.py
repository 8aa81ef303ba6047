"""Routing kernels against their torch references, and the routing rules themselves.

Runs on ``default_device()``: the Triton interpreter on a CPU machine, the compiled kernels on a
GPU. Ids must match exactly (the tie rule is part of the contract), weights to 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_kernels._runtime import HAS_TRITON, use_triton
from moe_kernels.reference import moe_reference
from moe_kernels.kernels.grouped_routing import grouped_topk, grouped_topk_reference
from moe_kernels.kernels.routing import append_shared_expert, fused_topk, fused_topk_reference, gate
from moe_testing import DEVICE, needs_gpu


def random_logits(num_tokens, num_experts, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_experts, generator=generator).to(dtype).to(DEVICE)


def random_bias(num_experts, seed):
    generator = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(num_experts, generator=generator)).to(DEVICE)


def tokens(num_tokens):
    return torch.zeros(num_tokens, 8, device=DEVICE)


def assert_same_routing(got, want):
    (weights, ids), (ref_weights, ref_ids) = got, want
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)


def test_kernels_run_where_triton_is():
    """Guards the comparisons below: with Triton present they must exercise the kernels."""
    assert use_triton(random_logits(1, 4, 0)) == HAS_TRITON


# ------------------------------------------------------------------------------------------
# Reference math, by hand, in float64
# ------------------------------------------------------------------------------------------


def sigmoid64(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_fused_reference_matches_hand_computation():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]], device=DEVICE)
    z = sum(math.exp(v) for v in (2.0, 0.0, 1.0, -1.0))
    weights, ids = fused_topk_reference(tokens(1), logits, 2, False)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights.double().cpu(),
                               torch.tensor([[math.exp(2) / z, math.exp(1) / z]],
                                            dtype=torch.float64), atol=1e-7, rtol=0)
    weights, _ = fused_topk_reference(tokens(1), logits, 2, True)
    selected = math.exp(2) + math.exp(1)
    expected = torch.tensor([[math.exp(2) / selected, math.exp(1) / selected]], dtype=torch.float64)
    torch.testing.assert_close(weights.double().cpu(), expected, atol=1e-7, rtol=0)


def test_grouped_reference_matches_hand_computation():
    # Three groups of two. Sigmoid scores s, selection s + b:
    #   s = .6225 .2689 | .8808 .5000 | .7311 .8176
    #   sel .9225 .2689 | .3808 .6000 | .7311 .8176
    # With the bias, group scores (top-2 sums) are 1.1914, 0.9808, 1.5487: keep groups 2 and 0,
    # then the best two of experts {0, 1, 4, 5} by selection are 0 (.9225) and 5 (.8176).
    # Without it, group scores (max) are .6225, .8808, .8176: keep groups 1 and 2 -> 2, 5.
    logits_list = [0.5, -1.0, 2.0, 0.0, 1.0, 1.5]
    logits = torch.tensor([logits_list], device=DEVICE)
    bias = torch.tensor([0.3, 0.0, -0.5, 0.1, 0.0, 0.0], device=DEVICE)
    s = [sigmoid64(v) for v in logits_list]
    weights, ids = grouped_topk_reference(tokens(1), logits, 2, True, 3, 2, "sigmoid", 2.5, bias)
    assert ids.tolist() == [[0, 5]]
    expected = [2.5 * s[0] / (s[0] + s[5]), 2.5 * s[5] / (s[0] + s[5])]
    torch.testing.assert_close(weights.double().cpu(),
                               torch.tensor([expected], dtype=torch.float64), atol=1e-6, rtol=0)
    weights, ids = grouped_topk_reference(tokens(1), logits, 2, False, 3, 2, "sigmoid")
    assert ids.tolist() == [[2, 5]]
    torch.testing.assert_close(weights.double().cpu(),
                               torch.tensor([[s[2], s[5]]], dtype=torch.float64), atol=1e-7, rtol=0)


# ------------------------------------------------------------------------------------------
# Kernels against references on random shapes
# ------------------------------------------------------------------------------------------

FUSED_CASES = [
    # tokens, experts, k, scoring, renormalize, dtype
    (1, 8, 1, "softmax", False, torch.float32),      # one token, k = 1
    (7, 60, 6, "sigmoid", True, torch.float32),      # E not a multiple of 32
    (9, 72, 72, "softmax", True, torch.float32),     # k = E
    (5, 128, 8, "softmax", True, torch.float16),     # Qwen3-30B-A3B routing
    (4, 512, 8, "sigmoid", False, torch.bfloat16),   # E = 512, bf16 logits (loads only)
    (2, 512, 512, "softmax", False, torch.float32),  # k = E = 512
    (33, 256, 8, "sigmoid", True, torch.float32),    # several programs, partial last block
]


@pytest.mark.parametrize("num_tokens,num_experts,topk,scoring,renormalize,dtype", FUSED_CASES)
def test_fused_topk_matches_reference(num_tokens, num_experts, topk, scoring, renormalize, dtype):
    logits = random_logits(num_tokens, num_experts, seed=num_experts + topk, dtype=dtype)
    args = (tokens(num_tokens), logits, topk, renormalize, scoring)
    assert_same_routing(fused_topk(*args), fused_topk_reference(*args))


GROUPED_CASES = [
    # tokens, experts, groups, topk_group, k, scoring, renormalize, bias, scaling, dtype
    (16, 256, 8, 4, 8, "sigmoid", True, True, 2.5, torch.float32),   # DeepSeek-V3
    (5, 256, 8, 4, 8, "softmax", False, False, 1.0, torch.float32),
    (6, 72, 8, 3, 5, "sigmoid", False, True, 1.0, torch.float32),    # groups of 9
    (4, 60, 4, 4, 60, "softmax", True, False, 1.0, torch.float32),   # k = E, groups of 15
    (3, 60, 4, 2, 30, "sigmoid", True, True, 1.0, torch.float32),    # k = topk_group * group
    (2, 512, 8, 2, 16, "sigmoid", True, True, 1.0, torch.float16),   # E = 512
    (1, 16, 8, 2, 1, "softmax", False, True, 1.0, torch.bfloat16),   # one token, k = 1
    (5, 64, 64, 3, 3, "softmax", True, False, 1.0, torch.float32),   # groups of one expert
    (4, 32, 1, 1, 4, "sigmoid", True, True, 1.0, torch.float32),     # a single group
]


@pytest.mark.parametrize(
    "num_tokens,num_experts,groups,topk_group,topk,scoring,renormalize,with_bias,scaling,dtype",
    GROUPED_CASES)
def test_grouped_topk_matches_reference(num_tokens, num_experts, groups, topk_group, topk, scoring,
                                        renormalize, with_bias, scaling, dtype):
    logits = random_logits(num_tokens, num_experts, seed=num_experts + groups, dtype=dtype)
    bias = random_bias(num_experts, seed=topk) if with_bias else None
    args = (tokens(num_tokens), logits, topk, renormalize, groups, topk_group, scoring, scaling,
            bias)
    assert_same_routing(grouped_topk(*args), grouped_topk_reference(*args))


def test_row_strided_logits():
    wide = random_logits(6, 40, seed=3)
    view = wide[:, :33]  # rows 40 apart, experts adjacent
    assert_same_routing(fused_topk(tokens(6), view, 4, True),
                        fused_topk_reference(tokens(6), view.contiguous(), 4, True))
    assert_same_routing(grouped_topk(tokens(6), view[:, :32], 4, True, 4, 2),
                        grouped_topk_reference(tokens(6), view[:, :32].contiguous(), 4, True, 4, 2))


def test_no_tokens():
    weights, ids = fused_topk(tokens(0), random_logits(0, 16, seed=0), 3, True)
    assert weights.shape == ids.shape == (0, 3)
    weights, ids = grouped_topk(tokens(0), random_logits(0, 16, seed=0), 3, True, 4, 2)
    assert weights.shape == ids.shape == (0, 3)


# ------------------------------------------------------------------------------------------
# Ties and degenerate routings
# ------------------------------------------------------------------------------------------


def integer_logits(num_tokens, num_experts, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, (num_tokens, num_experts), generator=generator).float().to(DEVICE)


def test_dropped_groups_never_fill_the_top_k():
    """A kept group with fewer real scores than the top-k needs: the rest are its NaN members (ranked
    as -inf), never an expert of a dropped group, in the kernel and in its reference alike."""
    logits = torch.tensor([[-80.0, -30.0, 0.0, float("nan")]], device=DEVICE)
    args = (tokens(1), logits, 2, False, 2, 1, "sigmoid")
    weights, ids = grouped_topk(*args)
    ref_weights, ref_ids = grouped_topk_reference(*args)
    assert ids.tolist() == [[2, 3]] and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, equal_nan=True)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_ties_break_to_lower_id(scoring):
    logits = integer_logits(8, 24, seed=1)  # three values over 24 experts: ties everywhere
    args = (tokens(8), logits, 10, False, scoring)
    assert_same_routing(fused_topk(*args), fused_topk_reference(*args))
    generator = torch.Generator().manual_seed(2)
    bias = (torch.randint(0, 3, (24,), generator=generator) / 4).to(DEVICE)  # exact: 0, .25, .5
    for maybe_bias in (None, bias):
        args = (tokens(8), logits, 7, True, 6, 3, scoring, 1.0, maybe_bias)
        assert_same_routing(grouped_topk(*args), grouped_topk_reference(*args))


def test_all_equal_logits_pick_the_lowest_ids():
    logits = torch.zeros(3, 12, device=DEVICE)
    weights, ids = fused_topk(tokens(3), logits, 5, False)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    torch.testing.assert_close(weights, torch.full((3, 5), 1 / 12, device=DEVICE))
    # Groups of 3; groups 0 and 1 win the group tie, then experts 0..4 the expert tie.
    weights, ids = grouped_topk(tokens(3), logits, 5, True, 4, 2, "sigmoid",
                                e_score_correction_bias=torch.zeros(12, device=DEVICE))
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    torch.testing.assert_close(weights, torch.full((3, 5), 0.2, device=DEVICE))


def test_the_reference_scores_equal_logits_equally_wherever_they_sit():
    # CPU torch.sigmoid gives sigmoid(-15) another last bit in a tensor's scalar tail (index 32
    # of 33 here), which once made the reference break this tie towards the higher id.
    logits = torch.full((1, 33), -15.0, device=DEVICE)
    logits[0, :32] = -16.0
    logits[0, 0] = -15.0
    _, ids = fused_topk_reference(tokens(1), logits, 1, False, "sigmoid")
    assert ids.tolist() == [[0]]
    args = (tokens(1), logits, 2, False, 1, 1, "sigmoid")
    assert grouped_topk_reference(*args)[1].tolist() == [[0, 32]]


def test_one_hot_expert_and_an_unused_expert():
    logits = random_logits(10, 20, seed=4)
    logits[:, 13] = 20.0    # every token's first choice
    logits[:, 2] = -20.0    # nobody's choice
    for weights, ids in (fused_topk(tokens(10), logits, 3, True, "sigmoid"),
                         grouped_topk(tokens(10), logits, 3, True, 4, 2)):
        assert (ids[:, 0] == 13).all() and not (ids == 2).any()


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_nan_logits_still_give_valid_ids(scoring):
    logits = random_logits(4, 16, seed=5)
    logits[1, 3] = float("nan")
    args = (tokens(4), logits, 4, False, scoring)
    weights, ids = fused_topk(*args)
    assert ((ids >= 0) & (ids < 16)).all()
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert_same_routing((weights.nan_to_num(-1.0), ids),
                        tuple(t.nan_to_num(-1.0) for t in fused_topk_reference(*args)))


# ------------------------------------------------------------------------------------------
# Properties of the routing rules
# ------------------------------------------------------------------------------------------


def test_renormalised_softmax_is_softmax_over_selected_logits():
    logits = random_logits(6, 40, seed=6)
    weights, ids = fused_topk(tokens(6), logits, 5, True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids.long()), dim=-1),
                               atol=1e-6, rtol=1e-6)


def test_bias_steers_selection_but_weights_stay_unbiased():
    logits = random_logits(12, 64, seed=7)
    bias = random_bias(64, seed=8) * 5
    weights, ids = grouped_topk(tokens(12), logits, 6, False, 8, 3, "sigmoid", 1.0, bias)
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, ids.long()),
                               atol=1e-6, rtol=1e-6)
    _, unbiased_ids = grouped_topk(tokens(12), logits, 6, False, 8, 3, "sigmoid")
    assert not torch.equal(ids, unbiased_ids)


def test_bias_changes_the_choice_not_the_weight():
    logits = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]], device=DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    bias[5] = 1.0
    _, ids = grouped_topk(tokens(1), logits, 1, False, 2, 1, "sigmoid")
    assert ids.tolist() == [[0]]
    weights, ids = grouped_topk(tokens(1), logits, 1, False, 2, 1, "sigmoid", 1.0, bias)
    assert ids.tolist() == [[5]] and weights.tolist() == [[0.5]]


def test_one_group_is_plain_topk_and_scaling_multiplies():
    logits = random_logits(9, 48, seed=9)
    for scoring in ("softmax", "sigmoid"):
        assert_same_routing(grouped_topk(tokens(9), logits, 6, True, 1, 1, scoring),
                            fused_topk(tokens(9), logits, 6, True, scoring))
    scaled, scaled_ids = grouped_topk(tokens(9), logits, 6, True, 6, 2, "sigmoid", 2.5)
    plain, plain_ids = grouped_topk(tokens(9), logits, 6, True, 6, 2, "sigmoid")
    assert torch.equal(scaled_ids, plain_ids)
    torch.testing.assert_close(scaled, 2.5 * plain, atol=1e-6, rtol=1e-6)


def test_gate_is_a_float32_linear_layer():
    generator = torch.Generator().manual_seed(10)
    hidden = torch.randn(5, 24, generator=generator).to(torch.bfloat16).to(DEVICE)
    weight = torch.randn(9, 24, generator=generator).to(torch.bfloat16).to(DEVICE)
    logits = gate(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (5, 9)
    torch.testing.assert_close(logits.double(), hidden.double() @ weight.double().T,
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Shared expert splicing
# ------------------------------------------------------------------------------------------


def test_append_shared_expert_layout():
    weights, ids = grouped_topk(tokens(5), random_logits(5, 16, seed=11), 2, True, 4, 2, "sigmoid",
                                2.5)
    spliced_weights, spliced_ids = append_shared_expert(weights, ids, 16, num_shared_experts=2)
    assert spliced_ids.dtype == torch.int32 and spliced_weights.shape == (5, 3)
    assert torch.equal(spliced_ids[:, :2], ids) and torch.equal(spliced_weights[:, :2], weights)
    assert spliced_ids[:, 2].tolist() == [16, 17, 16, 17, 16]
    assert spliced_weights[:, 2].tolist() == [1.0] * 5
    # SGLang's convention for unscaled routed weights: sum / factor, i.e. 1 / factor here.
    unscaled, unscaled_ids = grouped_topk(tokens(5), random_logits(5, 16, seed=11), 2, True, 4, 2,
                                          "sigmoid")
    sglang_weights, _ = append_shared_expert(unscaled, unscaled_ids, 16,
                                             shared_weight=unscaled.sum(-1) / 2.5)
    torch.testing.assert_close(sglang_weights[:, 2], torch.full((5,), 1 / 2.5, device=DEVICE))


def test_spliced_shared_expert_equals_adding_it_separately():
    """Routed experts plus a shared FFN == one MoE over E+1 experts with the shared one at E."""
    generator = torch.Generator().manual_seed(12)
    num_experts, d, f = 8, 6, 4
    x = torch.randn(3, d, generator=generator, dtype=torch.float64)
    w1 = torch.randn(num_experts + 1, 2 * f, d, generator=generator, dtype=torch.float64)
    w2 = torch.randn(num_experts + 1, d, f, generator=generator, dtype=torch.float64)
    weights, ids = grouped_topk(tokens(3), random_logits(3, num_experts, seed=13), 2, True, 4, 2,
                                "sigmoid", 2.5)
    weights, ids = weights.cpu(), ids.cpu()
    routed = moe_reference(x, w1, w2, weights, ids)
    shared = moe_reference(x, w1, w2, torch.ones(3, 1), torch.full((3, 1), num_experts))
    spliced = moe_reference(x, w1, w2, *append_shared_expert(weights, ids, num_experts))
    torch.testing.assert_close(spliced, routed + shared)


# ------------------------------------------------------------------------------------------
# Bad input names the argument
# ------------------------------------------------------------------------------------------


def grouped_args(**changes):
    args = dict(hidden_states=tokens(3), gating_output=random_logits(3, 16, seed=14), topk=4,
                renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                routed_scaling_factor=1.0, e_score_correction_bias=random_bias(16, seed=15))
    args.update(changes)
    return args


def fused_args(**changes):
    args = dict(hidden_states=tokens(3), gating_output=random_logits(3, 16, seed=14), topk=4,
                renormalize=True, scoring_func="softmax")
    args.update(changes)
    return args


def transposed_logits():
    return random_logits(16, 3, seed=14).t()  # [3, 16] with experts 3 elements apart


BAD_INPUTS = [
    (fused_topk, lambda: fused_args(topk=0), "topk"),
    (fused_topk, lambda: fused_args(topk=17), "topk"),
    (fused_topk, lambda: fused_args(scoring_func="relu"), "scoring_func"),
    (fused_topk, lambda: fused_args(hidden_states=tokens(4)), "gating_output"),
    (fused_topk, lambda: fused_args(gating_output=torch.zeros(3, 16, dtype=torch.int32)),
     "gating_output"),
    (fused_topk, lambda: fused_args(gating_output=torch.zeros(3, 16, 1)), "gating_output"),
    (fused_topk, lambda: fused_args(hidden_states=torch.zeros(3, 8, device="meta")),
     "gating_output"),
    (fused_topk, lambda: fused_args(gating_output=transposed_logits()), "gating_output"),
    (fused_topk, lambda: fused_args(renormalize=1), "renormalize"),
    (fused_topk, lambda: fused_args(hidden_states=[0, 1, 2]), "hidden_states"),
    (fused_topk_reference, lambda: fused_args(topk=17), "topk"),
    (grouped_topk, lambda: grouped_args(topk=0), "topk"),
    (grouped_topk, lambda: grouped_args(topk=17), "topk"),
    (grouped_topk, lambda: grouped_args(topk=9), "topk"),  # > topk_group * 4 experts per group
    (grouped_topk, lambda: grouped_args(num_expert_group=3), "num_expert_group"),
    (grouped_topk, lambda: grouped_args(num_expert_group=0), "num_expert_group"),
    (grouped_topk, lambda: grouped_args(topk_group=5), "topk_group"),
    (grouped_topk, lambda: grouped_args(topk_group=0), "topk_group"),
    (grouped_topk, lambda: grouped_args(scoring_func="tanh"), "scoring_func"),
    (grouped_topk, lambda: grouped_args(hidden_states=tokens(2)), "gating_output"),
    (grouped_topk, lambda: grouped_args(gating_output=torch.zeros(3, 16, dtype=torch.float64)),
     "gating_output"),
    (grouped_topk, lambda: grouped_args(gating_output=transposed_logits()), "gating_output"),
    (grouped_topk, lambda: grouped_args(e_score_correction_bias=torch.zeros(15, device=DEVICE)),
     "e_score_correction_bias"),
    (grouped_topk, lambda: grouped_args(e_score_correction_bias=torch.zeros(1, 16, device=DEVICE)),
     "e_score_correction_bias"),
    (grouped_topk, lambda: grouped_args(e_score_correction_bias=torch.zeros(16, device="meta")),
     "e_score_correction_bias"),
    (grouped_topk, lambda: grouped_args(num_expert_group=16, topk_group=2, topk=2),
     "num_expert_group"),  # groups of one expert have no top 2
    (grouped_topk, lambda: grouped_args(routed_scaling_factor="2.5"), "routed_scaling_factor"),
    (grouped_topk_reference, lambda: grouped_args(topk_group=5), "topk_group"),
    (gate, lambda: dict(hidden_states=tokens(2), gate_weight=torch.zeros(4, 7, device=DEVICE)),
     "gate_weight"),
    (gate, lambda: dict(hidden_states=torch.zeros(2, 8, dtype=torch.int64),
                        gate_weight=torch.zeros(4, 8)), "hidden_states"),
    (append_shared_expert, lambda: dict(topk_weights=torch.zeros(2, 3),
                                        topk_ids=torch.zeros(2, 2, dtype=torch.int32),
                                        num_experts=4), "topk_ids"),
    (append_shared_expert, lambda: dict(topk_weights=torch.zeros(2, 2, dtype=torch.float16),
                                        topk_ids=torch.zeros(2, 2, dtype=torch.int32),
                                        num_experts=4), "topk_weights"),
    (append_shared_expert, lambda: dict(topk_weights=torch.zeros(2, 2),
                                        topk_ids=torch.zeros(2, 2, dtype=torch.int32),
                                        num_experts=4, num_shared_experts=0),
     "num_shared_experts"),
    (append_shared_expert, lambda: dict(topk_weights=torch.zeros(2, 2),
                                        topk_ids=torch.zeros(2, 2, dtype=torch.int32),
                                        num_experts=4, shared_weight=torch.ones(3)),
     "shared_weight"),
    (append_shared_expert, lambda: dict(topk_weights=torch.zeros(2, 2),
                                        topk_ids=torch.zeros(2, 2, dtype=torch.int32),
                                        num_experts=4, shared_weight="one"), "shared_weight"),
]


@pytest.mark.parametrize("func,make_args,name", BAD_INPUTS,
                         ids=[f"{f.__name__}-{n}-{i}" for i, (f, _, n) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(func, make_args, name):
    with pytest.raises((ValueError, TypeError), match=f"{func.__name__}: argument '{name}'"):
        func(**make_args())


# ------------------------------------------------------------------------------------------
# Model shapes on the GPU (bf16 logits, as a serving engine produces them)
# ------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 100, 4096, 16384])
def test_deepseek_v3_routing_on_gpu(num_tokens):
    logits = random_logits(num_tokens, 256, seed=num_tokens, dtype=torch.bfloat16)
    args = (tokens(num_tokens), logits, 8, True, 8, 4, "sigmoid", 2.5, random_bias(256, seed=1))
    assert_same_routing(grouped_topk(*args), grouped_topk_reference(*args))


@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 100, 4096, 16384])
def test_qwen3_routing_on_gpu(num_tokens):
    logits = random_logits(num_tokens, 128, seed=num_tokens, dtype=torch.bfloat16)
    args = (tokens(num_tokens), logits, 8, True, "softmax")
    assert_same_routing(fused_topk(*args), fused_topk_reference(*args))


@needs_gpu
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("skewed", [False, True])
def test_tensor_core_gate_picks_the_float64_experts_away_from_ties(model, skewed):
    """The gate on tensor cores (bf16 operands, float32 sums) routes 4096 tokens of the model's real
    shape to the experts float64 logits pick, but for at most 0.1% of them; for plain top-k every
    such token is a near-tie (its float64 logits at the top-k boundary closer than twice the gate's
    largest error). The recorded run over 8 draws: ``bench routing --gate``."""
    from moe_kernels.bench.routing import gate_agreement

    row = gate_agreement(model, 4096, skewed=skewed, seed=1)
    assert row["differ_tensor_core"] <= 4, row
    assert row["max_logit_error_tensor_core"] < 1e-2, row
    if model == "qwen3-30b-a3b":
        assert row["tie_explained"], row

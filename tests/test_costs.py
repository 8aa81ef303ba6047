"""The byte model: hand-computed values, limits, and agreement with Monte Carlo routing."""

from __future__ import annotations

import math

import pytest
import torch

from moe_kernels.model import costs, shapes

DSV3 = shapes.MODELS["deepseek-v3"]
QWEN = shapes.MODELS["qwen3-30b-a3b"]


def test_experts_touched_hand_values():
    # E = 4, k = 1: miss probability 3/4 per token; B = 2 -> 4 * (1 - 9/16) = 1.75.
    assert costs.experts_touched(2, 4, 1) == pytest.approx(1.75, rel=1e-15)
    # E = 4, k = 2, B = 3: 4 * (1 - (1/2)^3) = 3.5.
    assert costs.experts_touched(3, 4, 2) == pytest.approx(3.5, rel=1e-15)
    assert costs.experts_touched(1, 256, 8) == pytest.approx(8.0, rel=1e-14)
    assert costs.experts_touched(5, 16, 16) == 16.0  # k = E: everything, every time
    assert costs.experts_touched(0, 16, 4) == 0.0


def test_experts_touched_limits_and_monotone():
    values = [costs.experts_touched(b, 256, 8) for b in range(1, 2000)]
    assert all(a < b for a, b in zip(values[:800], values[1:800]))
    assert all(a <= b for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(256.0, rel=1e-12)


@pytest.mark.parametrize("E,k", [(256, 8), (128, 8), (8, 2), (60, 6)])
def test_experts_touched_matches_monte_carlo(E, k):
    gen = torch.Generator().manual_seed(E * 100 + k)
    trials = 400
    for B in (1, 3, 16, 64):
        ids = torch.rand(trials, B, E, generator=gen).topk(k, dim=-1).indices  # uniform k-subsets
        hit = torch.zeros(trials, E, dtype=torch.bool).scatter_(1, ids.reshape(trials, -1), True)
        distinct = hit.sum(1).double()
        sem = distinct.std().item() / math.sqrt(trials)
        assert abs(distinct.mean().item() - costs.experts_touched(B, E, k)) <= 4 * sem + 1e-6 * E


def test_batch_for_fraction_inverts_the_curve():
    for E, k in ((256, 8), (128, 8), (64, 6)):
        for f in (0.1, 0.5, 0.95):
            b = costs.batch_for_fraction(f, E, k)
            assert costs.experts_touched(b, E, k) / E == pytest.approx(f, rel=1e-12)
    # The chapter's numbers (the source's 94 and 46 are the real solutions rounded down).
    assert costs.batch_for_fraction(0.5, 256, 8) == pytest.approx(21.83, abs=0.01)
    assert costs.batch_for_fraction(0.5, 128, 8) == pytest.approx(10.74, abs=0.01)
    assert math.ceil(costs.batch_for_fraction(0.95, 256, 8)) == 95
    assert math.ceil(costs.batch_for_fraction(0.95, 128, 8)) == 47


def test_intensity_limits():
    assert costs.moe_intensity(1, 256, 8, 1.0) == pytest.approx(2.0, rel=1e-14)
    assert costs.moe_intensity(1, 256, 8, 2.0) == pytest.approx(1.0, rel=1e-14)
    big = 1e6
    assert costs.moe_intensity(big, 256, 8, 1.0) == pytest.approx(costs.dense_intensity(big, 1.0) * 8 / 256, rel=1e-12)
    assert costs.dense_intensity(296, 1.0) == 592


def test_ridge_batches():
    h100 = shapes.GPUS["H100 SXM"]
    ridge = h100.ridge("fp8")
    assert ridge == pytest.approx(1978.9 / 3.35, rel=1e-12)
    dense = costs.ridge_batch_dense(ridge, 1.0)
    moe = costs.ridge_batch_moe(256, 8, ridge, 1.0)
    assert costs.moe_intensity(moe, 256, 8, 1.0) == pytest.approx(ridge, rel=1e-9)
    assert moe == pytest.approx(dense * 256 / 8, rel=1e-6)  # every expert is touched by then
    assert costs.ridge_batch_moe(8, 8, 1.0, 1.0) == 1.0  # already past the ridge at batch 1


def test_layer_bytes_and_flops_deepseek():
    assert DSV3.expert_params == 3 * 7168 * 2048 == 44_040_192
    assert costs.moe_layer_weight_bytes(1, DSV3, "fp8") == pytest.approx(8 * 44_040_192)
    assert costs.moe_layer_flops(4, DSV3) == 4 * 8 * 6 * 7168 * 2048
    b256 = costs.moe_layer_weight_bytes(256, DSV3, "fp8")
    assert b256 / 1e9 == pytest.approx(11.27, abs=0.005)


def test_expected_padded_rows_exact_small_case():
    # B = 2, E = 2, k = 1, block 2: m_0 ~ Bin(2, 1/2): P(0)=1/4, P(1)=1/2, P(2)=1/4.
    # Per expert: 0*1/4 + 2*1/2 + 2*1/4 = 1.5 rows; two experts: 3 rows for 2 real rows.
    assert costs.expected_padded_rows(2, 2, 1, 2) == pytest.approx(3.0, rel=1e-14)
    assert costs.expected_padded_rows(7, 4, 2, 1) == pytest.approx(14.0, rel=1e-12)  # block 1: no padding


def test_expected_padded_rows_matches_monte_carlo():
    gen = torch.Generator().manual_seed(1)
    E, k, B, block = 64, 6, 40, 16
    trials = 500
    ids = torch.rand(trials, B, E, generator=gen).topk(k, dim=-1).indices.reshape(trials, -1)
    counts = torch.zeros(trials, E, dtype=torch.int64).scatter_add_(1, ids, torch.ones_like(ids))
    padded = ((counts + block - 1) // block * block).sum(1).double()
    sem = padded.std().item() / math.sqrt(trials)
    assert abs(padded.mean().item() - costs.expected_padded_rows(B, E, k, block)) <= 4 * sem


def test_padding_small_batch_limit():
    # DeepSeek-V3 at B = 64, block 16: almost no expert needs a second tile.
    exact = costs.padding_factor(64, 256, 8, 16)
    approx = costs.padding_factor_small_batch_limit(64, 256, 8, 16)
    assert exact == pytest.approx(approx, rel=2e-3)
    assert exact == pytest.approx(6.95, abs=0.01)


def test_parameter_counts_reconcile_with_cards():
    for model in shapes.MODELS.values():
        p = costs.parameter_count(model)
        assert p.total == pytest.approx(model.published_total_params, rel=0.01), model.name
    p = costs.parameter_count(DSV3)
    assert (p.routed_active + p.shared_experts + p.attention) / 1e9 == pytest.approx(34.40, abs=0.005)
    assert p.active / 1e9 == pytest.approx(37.55, abs=0.01)
    assert p.routed_experts / 1e9 == pytest.approx(653.9, abs=0.05)
    q = costs.parameter_count(QWEN)
    assert q.routed_experts / 1e9 == pytest.approx(28.99, abs=0.005)
    assert q.active / 1e9 == pytest.approx(3.35, abs=0.01)


def test_step_time_and_units():
    h100 = shapes.GPUS["H100 SXM"]
    t1 = costs.step_time_weight_streaming(1, QWEN, "fp8", h100.hbm_bandwidth)
    assert t1 * 1e6 == pytest.approx(541, abs=0.5)
    assert h100.memory_gib == pytest.approx(79.65, abs=0.005)
    usable = costs.usable_memory_bytes(h100)
    assert usable / shapes.GiB == pytest.approx(67.28, abs=0.005)
    assert usable / shapes.GB == pytest.approx(72.24, abs=0.01)


@pytest.mark.parametrize(
    "call",
    [
        lambda: costs.experts_touched(4, 8, 9),
        lambda: costs.experts_touched(4, 0, 1),
        lambda: costs.batch_for_fraction(1.0, 8, 2),
        lambda: costs.expected_padded_rows(4, 8, 2, 0),
        lambda: shapes.bytes_per_weight("fp7"),
    ],
)
def test_bad_arguments_name_themselves(call):
    with pytest.raises(ValueError, match="argument '"):
        call()

"""Skewed routing: popularity, the sampler, and the closed forms against brute force and Monte Carlo.

The sampler runs on ``default_device()`` (the GPU when there is one). The closed forms are
float64 arithmetic on the host.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_kernels._runtime import default_device
from moe_kernels.kernels.align import moe_align_block_size_reference
from moe_kernels.model import buffers, costs, skew
from moe_kernels.model.skew import (
    expected_contiguous_rows,
    expected_experts_touched,
    expected_hottest_rows,
    expected_masked_rows,
    expected_rows_per_expert,
    inclusion_probabilities,
    layout_rows,
    sample_topk_ids,
    zipf_popularity,
)

DEVICE = default_device()


def draw_counts(num_tokens, inclusion, top_k, trials, seed):
    """``[trials, E]`` row counts of ``trials`` independent batches of ``num_tokens`` tokens."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pi = inclusion.to(DEVICE)
    ids = sample_topk_ids(num_tokens * trials, pi, top_k, generator=gen).view(trials, -1).long()
    counts = torch.zeros(trials, pi.numel(), dtype=torch.long, device=DEVICE)
    return counts.scatter_add_(1, ids, torch.ones_like(ids)).cpu()


def mean_and_sem(values):
    values = values.double()
    return values.mean().item(), values.std().item() / math.sqrt(values.numel())


def agrees(draws, expected, jump, rel=0.0):
    """The mean of the draws is within 5 standard errors (plus ``rel``) of ``expected``.

    ``jump`` is the largest step one rare event makes in a single draw (a second tile, an
    untouched expert): allowing two of them keeps a few hundred draws, which may not see an
    event of probability 1e-3 at all, from failing on a sample variance of zero.
    """
    mean, sem = mean_and_sem(draws)
    return abs(mean - expected) <= 5 * sem + 2 * jump / draws.numel() + rel * abs(expected)


# ---- popularity and inclusion ------------------------------------------------------------------


@pytest.mark.parametrize("E", [1, 8, 128, 256])
@pytest.mark.parametrize("s", [0.0, 0.5, 1.0, 2.5])
def test_popularity_sums_to_one_and_ranks_experts(E, s):
    p = zipf_popularity(E, s)
    assert p.dtype == torch.float64 and p.shape == (E,)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12)
    assert bool((p[:-1] >= p[1:]).all())
    if s == 0.0:
        assert torch.equal(p, torch.full((E,), 1.0 / E, dtype=torch.float64))
    elif E > 1:
        assert float(p[0] / p[1]) == pytest.approx(2.0**s, rel=1e-12)


@pytest.mark.parametrize("E,k", [(256, 8), (128, 8), (8, 2), (16, 1), (6, 6)])
@pytest.mark.parametrize("s", [0.0, 0.4, 1.0, 1.5, 4.0])
def test_inclusion_is_capped_proportional(E, k, s):
    p = zipf_popularity(E, s)
    pi = inclusion_probabilities(p, k)
    assert float(pi.sum()) == pytest.approx(k, abs=1e-9)
    assert bool((pi <= 1.0).all()) and bool((pi > 0).all())
    if s == 0.0:
        assert torch.allclose(pi, torch.full((E,), k / E, dtype=torch.float64), rtol=1e-14, atol=0)
    uncapped = pi < 1.0
    if uncapped.sum() >= 2:  # the uncapped experts keep their popularity ratios
        ratios = pi[uncapped] / p[uncapped]
        assert torch.allclose(ratios, ratios[0].expand_as(ratios), rtol=1e-12, atol=0)
    # every capped expert is at least as popular as every uncapped one
    if (~uncapped).any() and uncapped.any():
        assert float(p[~uncapped].min()) >= float(p[uncapped].max())


def test_inclusion_hand_values_and_order():
    # k = 2 of three experts with shares 0.5, 0.3, 0.2: 2 * 0.5 = 1 is exactly at the cap.
    pi = inclusion_probabilities([0.2, 0.5, 0.3], 2)
    assert pi.tolist() == pytest.approx([0.4, 1.0, 0.6], abs=1e-15)
    # shares 0.7, 0.2, 0.1 with k = 2: expert 0 capped, the other 1.0 split 2:1.
    pi = inclusion_probabilities(torch.tensor([0.1, 0.7, 0.2], dtype=torch.float64), 2)
    assert pi.tolist() == pytest.approx([1 / 3, 1.0, 2 / 3], abs=1e-15)
    # k = E: every expert, every token
    assert inclusion_probabilities(zipf_popularity(5, 1.0), 5).tolist() == [1.0] * 5


# ---- the sampler ---------------------------------------------------------------------------------


@pytest.mark.parametrize("E,k,s", [(256, 8, 0.0), (256, 8, 1.0), (128, 8, 0.5), (8, 2, 1.5), (6, 6, 1.0),
                                   (16, 1, 0.7)])
def test_sampler_draws_k_distinct_ids_with_the_inclusion_probabilities(E, k, s):
    pi = inclusion_probabilities(zipf_popularity(E, s), k)
    gen = torch.Generator(device=DEVICE).manual_seed(E + k)
    T = 4000
    ids = sample_topk_ids(T, pi.to(DEVICE), k, generator=gen)
    assert ids.dtype == torch.int32 and ids.shape == (T, k) and ids.device.type == DEVICE.type
    ids = ids.long().cpu()
    assert int(ids.min()) >= 0 and int(ids.max()) < E
    assert bool((ids.sort(dim=1).values.diff(dim=1) > 0).all()), "a token picked one expert twice"
    freq = torch.bincount(ids.flatten(), minlength=E).double() / T
    sem = (pi * (1 - pi) / T).sqrt()
    assert bool(((freq - pi).abs() <= 5 * sem + 1e-12).all())


def test_sampler_edge_cases():
    gen = torch.Generator().manual_seed(0)
    # one token
    ids = sample_topk_ids(1, inclusion_probabilities(zipf_popularity(8, 1.0), 3), 3, generator=gen)
    assert ids.shape == (1, 3) and len(set(ids[0].tolist())) == 3
    # all tokens on one expert (k = 1), and experts that no token can pick
    ids = sample_topk_ids(50, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64), 1, generator=gen)
    assert ids.flatten().tolist() == [1] * 50
    # zero tokens
    assert sample_topk_ids(0, torch.full((4,), 0.5, dtype=torch.float64), 2, generator=gen).shape == (0, 2)
    # the same seed gives the same routing
    pi = inclusion_probabilities(zipf_popularity(64, 0.8), 4)
    a = sample_topk_ids(32, pi, 4, generator=torch.Generator().manual_seed(7))
    b = sample_topk_ids(32, pi, 4, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


# ---- closed forms against the uniform byte model and against brute force -----------------------


@pytest.mark.parametrize("E,k", [(256, 8), (128, 8), (8, 2), (16, 1), (6, 6)])
@pytest.mark.parametrize("B", [1, 3, 64, 512, 4096])
@pytest.mark.parametrize("block", [1, 16, 128])
def test_uniform_skew_reproduces_the_byte_model(E, k, B, block):
    """At s = 0 each expert's rows are Binomial(B, k/E), the exact formula of costs.py."""
    pi = inclusion_probabilities(zipf_popularity(E, 0.0), k)
    assert expected_contiguous_rows(B, pi, block) == pytest.approx(
        costs.expected_padded_rows(B, E, k, block), rel=1e-9)
    assert expected_experts_touched(B, pi) == pytest.approx(costs.experts_touched(B, E, k), rel=1e-12)
    assert expected_rows_per_expert(B, pi).tolist() == pytest.approx([B * k / E] * E, rel=1e-12)


def _full_binomial_cdfs(B, pi):
    return [torch.tensor(costs._binomial_pmf(B, float(q)), dtype=torch.float64).cumsum(0) for q in pi]


@pytest.mark.parametrize("E,k,s", [(8, 2, 0.0), (8, 2, 1.0), (16, 3, 0.6), (5, 5, 0.0), (12, 1, 1.3)])
@pytest.mark.parametrize("B", [1, 2, 7, 40, 300])
def test_closed_forms_match_brute_force_sums(E, k, s, B):
    """The windowed pmfs and the tail-sum identity against full lgamma pmfs, term by term."""
    pi = inclusion_probabilities(zipf_popularity(E, s), k)
    for block in (1, 4, 16):
        direct = sum(sum(prob * (-(-m // block)) * block
                         for m, prob in enumerate(costs._binomial_pmf(B, float(q)))) for q in pi)
        assert expected_contiguous_rows(B, pi, block) == pytest.approx(direct, rel=1e-10)
    cdfs = _full_binomial_cdfs(B, pi)
    below = torch.stack(cdfs).prod(dim=0)  # P(max <= m) for m = 0..B, independent counts
    below[: -(-B * k // E)] = 0.0  # the pigeonhole floor: the max is at least the mean
    pmf_max = torch.diff(below, prepend=torch.zeros(1))
    for r in (1, 3, 16):
        m = torch.arange(B + 1, dtype=torch.float64)
        want = float((pmf_max * torch.ceil(m / r) * r).sum())
        assert expected_hottest_rows(B, pi, r) == pytest.approx(want, rel=1e-10)
        assert expected_masked_rows(B, pi, r) == pytest.approx(E * want, rel=1e-10)


def test_closed_form_edge_cases():
    one_expert = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)  # k = 1, all on expert 1
    assert expected_hottest_rows(100, one_expert) == 100.0
    assert expected_contiguous_rows(100, one_expert, 16) == 112.0
    assert expected_masked_rows(100, one_expert, 64) == 4 * 128
    assert expected_experts_touched(100, one_expert) == 1.0
    every = torch.ones(6, dtype=torch.float64)  # k = E
    assert expected_hottest_rows(10, every) == 10.0
    assert expected_contiguous_rows(10, every, 4) == 6 * 12
    # one token: the hottest expert has exactly one row
    pi = inclusion_probabilities(zipf_popularity(16, 0.0), 1)
    assert expected_hottest_rows(1, pi) == pytest.approx(1.0, abs=1e-15)


# ---- closed forms against Monte Carlo of the sampler --------------------------------------------


@pytest.mark.parametrize("E,k,s,B,trials", [
    (256, 8, 0.0, 64, 300), (256, 8, 0.5, 512, 60), (256, 8, 1.0, 4096, 10), (128, 8, 0.0, 4, 3000),
    (128, 8, 0.3, 512, 60), (128, 8, 1.5, 64, 300), (8, 2, 0.5, 16, 2000), (16, 1, 0.7, 100, 1000),
])
def test_closed_forms_match_monte_carlo(E, k, s, B, trials):
    pi = inclusion_probabilities(zipf_popularity(E, s), k)
    counts = draw_counts(B, pi, k, trials, seed=E * 1000 + B)
    # rows per expert and experts touched: exact in expectation
    per_expert = counts.double().mean(0)
    sem = (B * pi * (1 - pi) / trials).sqrt()
    assert bool(((per_expert - expected_rows_per_expert(B, pi)).abs() <= 5 * sem + 1e-12).all())
    assert agrees((counts > 0).sum(1), expected_experts_touched(B, pi), jump=1)
    # contiguous rows: exact in expectation
    for block in (16, 128):
        assert agrees(((counts + block - 1) // block * block).sum(1), expected_contiguous_rows(B, pi, block),
                      jump=block)
    # the hottest expert: the independence approximation, within the error the docstring states
    stated = 0.025 if E >= 128 else 0.06
    hottest = counts.max(1).values
    assert agrees(hottest, expected_hottest_rows(B, pi), jump=1, rel=stated)
    for r in (16, 256):
        assert agrees(E * ((hottest + r - 1) // r * r), expected_masked_rows(B, pi, r), jump=E * r, rel=stated)


@pytest.mark.parametrize("B", [4, 16])
def test_the_hottest_count_is_underestimated_not_overestimated_at_small_batches(B):
    """Negative correlation between the counts: the product formula errs low (tight Monte Carlo)."""
    pi = inclusion_probabilities(zipf_popularity(8, 0.0), 2)
    hottest, sem = mean_and_sem(draw_counts(B, pi, 2, 20000, seed=B).max(1).values)
    assert expected_hottest_rows(B, pi) < hottest - 3 * sem


# ---- one drawn routing -------------------------------------------------------------------------


@pytest.mark.parametrize("E,k,s,B", [(64, 4, 0.0, 40), (64, 4, 1.2, 40), (8, 8, 0.0, 5), (32, 1, 2.0, 33)])
def test_layout_rows_match_the_alignment_and_the_measured_cap(E, k, s, B):
    pi = inclusion_probabilities(zipf_popularity(E, s), k)
    ids = sample_topk_ids(B, pi, k, generator=torch.Generator().manual_seed(B))
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    for block in (4, 16):
        rows = layout_rows(ids, E, block, round_to=16)
        assert rows.contiguous == int(moe_align_block_size_reference(ids, block, E)[2])
        assert rows.real == B * k and rows.hottest == int(counts.max())
        assert rows.touched == int((counts > 0).sum())
        assert rows.masked_m_max == buffers.m_max_measured_cap(ids, E, block=16)
        assert rows.masked_reserved == E * rows.masked_m_max


# ---- the tile-height tables --------------------------------------------------------------------


def test_tuned_block_m_reads_the_index_gather_table():
    from moe_kernels.kernels import config

    table = config.tuned_block_m(256, 2048, 7168)
    assert table and list(table) == sorted(table)
    tuned = config.load_table(config.table_name("NVIDIA H200", 256, 2048, 7168, torch.bfloat16, "index_gather"))
    assert sorted(tuned) == list(table)
    for batch, block_m in table.items():
        assert tuned[batch].block_m == block_m
    assert config.tuned_block_m(256, 2048, 7168, device_name="no such GPU") == {}
    assert config.tuned_block_m(256, 2048, 7168, dtype=torch.float16) == {}  # tuned in bf16 only
    tiles = list(skew.VLLM_H100_DSV3_TP4_BLOCK_M.values())
    assert tiles == sorted(tiles) and set(tiles) <= {16, 32, 64, 128}


# ---- bad inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("call,argument", [
    (lambda: zipf_popularity(0, 1.0), "num_experts"),
    (lambda: zipf_popularity(8, -0.5), "s"),
    (lambda: zipf_popularity(8, float("nan")), "s"),
    (lambda: inclusion_probabilities([0.5, 0.4], 1), "popularity"),
    (lambda: inclusion_probabilities([0.5, 0.5], 3), "top_k"),
    (lambda: inclusion_probabilities([1.0, 0.0, 0.0], 2), "popularity"),
    (lambda: inclusion_probabilities([-0.5, 1.5], 1), "popularity"),
    (lambda: sample_topk_ids(4, torch.full((4,), 0.5, dtype=torch.float64), 3), "inclusion"),
    (lambda: sample_topk_ids(4, [1.5, 0.5], 2), "inclusion"),
    (lambda: sample_topk_ids(-1, [0.5, 0.5], 1), "num_tokens"),
    (lambda: expected_contiguous_rows(8, [0.5, 0.5], 0), "block"),
    (lambda: expected_contiguous_rows(0, [0.5, 0.5], 16), "num_tokens"),
    (lambda: expected_contiguous_rows(8, [0.5, 0.7], 16), "inclusion"),
    (lambda: expected_masked_rows(8, [0.5, 0.5], 0), "round_to"),
    (lambda: expected_hottest_rows(8, torch.ones(2, 2)), "inclusion"),
    (lambda: layout_rows(torch.tensor([[0, 9]]), 4, 16, 16), "topk_ids"),
    (lambda: layout_rows(torch.tensor([[0, 1]]), 4, 0, 16), "block"),
])
def test_bad_inputs_name_the_argument(call, argument):
    with pytest.raises((TypeError, ValueError), match=f"argument '{argument}'"):
        call()


# ---- the GPU measurement's command line --------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CLI would run the measurement")
def test_bench_cli_needs_a_gpu(capsys):
    from moe_kernels.bench import skew as bench_skew

    assert bench_skew.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

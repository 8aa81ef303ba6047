"""Skewed routing: how popular experts change what the contiguous and masked layouts pay.

The byte model (:mod:`moe_kernels.model.costs`) assumes every expert is equally likely. Real routers
have favourites. This module gives a one-parameter family of favourites, a sampler that draws
routings from it, and closed forms for the rows each layout then runs.

**Popularity and inclusion.** :func:`zipf_popularity` ranks the experts and gives expert ``e``
(0-based) a share proportional to ``(e + 1) ** -s``: ``s = 0`` is uniform, larger ``s`` piles the
traffic onto the first few. A token picks ``k`` *distinct* experts, so no expert can be chosen by
more than every token: its *inclusion probability* ``pi_e`` (the fraction of tokens that pick it)
is at most 1, and the ``pi_e`` sum to ``k``. :func:`inclusion_probabilities` makes ``pi``
proportional to the popularity and caps it at 1, handing the excess to the others (the usual
capped probability-proportional-to-size rule). At ``s = 0`` it returns ``k / E`` for every expert,
which is the uniform model of :mod:`moe_kernels.model.costs`.

**The sampler.** :func:`sample_topk_ids` draws ``k`` distinct experts per token with exactly these
inclusion probabilities, by randomized systematic sampling (Hartley and Rao, 1962): shuffle the
experts, lay their ``pi_e`` end to end on ``[0, k)``, and take the experts under the ``k`` points
``u, u + 1, ..., u + k - 1`` for one uniform ``u``. No interval is longer than 1, so no expert is
hit twice. (A Gumbel-top-k router with logits ``log p`` also prefers popular experts, but its
inclusion probabilities have no closed form; this sampler's do, which is what lets the formulas
below be exact.)

**Rows per expert.** Tokens are independent and each one either picks expert ``e`` or not, so
expert ``e``'s rows are exactly ``m_e ~ Binomial(B, pi_e)``; its mean is ``B pi_e``
(:func:`expected_rows_per_expert`). Two layouts turn these rows into GEMM work:

* the **contiguous** (aligned, index-gather) layout rounds each expert up to whole tiles of
  ``b`` rows: ``R_contig = sum_e E[ceil(m_e / b) b]``. Linearity of expectation makes this exact
  with the binomial marginals (:func:`expected_contiguous_rows`). At ``s = 0`` it is
  :func:`moe_kernels.model.costs.expected_padded_rows`.
* the **masked** layout gives every expert a slab of ``m_max`` rows, the hottest expert's count
  rounded up to ``r`` (SGLang's measured cap uses ``r = 256``): it *reserves*
  ``R_masked = E * E[ceil(M / r) r]`` rows, ``M = max_e m_e`` (:func:`expected_masked_rows`).
  Here the experts' counts are treated as independent, ``P(M <= m) = prod_e P(m_e <= m)``, with
  one exact correction: ``M`` is at least the mean ``B k / E``. The counts are not independent:
  a fixed total of ``B k`` assignments makes them negatively correlated, so the product
  overstates ``P(M <= m)`` and the formula *underestimates* the hottest count. Against the
  sampler, for E = 128 and 256 with k = 8, the expected hottest count
  (:func:`expected_hottest_rows`) is about 2% low at 4 tokens and within 1% from 16 tokens up;
  with few experts it is further off (5% low for E = 8, k = 2 at 4 tokens). The tests check
  these bounds by Monte Carlo.

Memory and time are different bills. The masked slabs occupy ``E * m_max * (d + F)`` elements
whatever the routing; the masked GEMM, like DeepGEMM's, skips the tiles past ``masked_m[e]``,
so its *arithmetic* is the contiguous layout's tiles, and the empty slab space costs programs
that exit at once. :func:`layout_rows` counts all of these for one drawn routing.

A worked example: four experts, top-2, ``s = 2``. Expert 0's share would give it an inclusion
probability above 1, so it is capped: every token picks it::

    >>> pop = zipf_popularity(4, 2.0)
    >>> [round(p, 4) for p in pop.tolist()]
    [0.7024, 0.1756, 0.078, 0.0439]
    >>> pi = inclusion_probabilities(pop, top_k=2)
    >>> [round(p, 4) for p in pi.tolist()], round(float(pi.sum()), 12)
    ([1.0, 0.5902, 0.2623, 0.1475], 2.0)
    >>> [round(r, 3) for r in expected_rows_per_expert(8, pi).tolist()]   # B = 8 tokens
    [8.0, 4.721, 2.098, 1.18]
    >>> round(expected_contiguous_rows(8, pi, block=4), 3)   # each expert rounded up to tiles of 4
    20.959
    >>> round(expected_masked_rows(8, pi, round_to=4), 3)    # expert 0 has 8 rows: 4 slabs of 8
    32.0
    >>> ids = sample_topk_ids(8, pi, 2, generator=torch.Generator().manual_seed(0))
    >>> ids.shape, bool((ids[:, 0] != ids[:, 1]).all()), bool((ids == 0).any(dim=1).all())
    (torch.Size([8, 2]), True, True)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from .._checks import check_int, check_number, check_tensor, fail

__all__ = [
    "LayoutRows",
    "VLLM_H100_DSV3_TP4_BLOCK_M",
    "expected_contiguous_rows",
    "expected_experts_touched",
    "expected_hottest_rows",
    "expected_masked_rows",
    "expected_rows_per_expert",
    "inclusion_probabilities",
    "layout_rows",
    "sample_topk_ids",
    "zipf_popularity",
]

# A binomial's probabilities are computed in a window of this many standard deviations (plus a
# margin for tiny means) around its mode; what lies outside is below 1e-20 of the total.
_WINDOW_SDS = 10.0
_WINDOW_MARGIN = 10


# ----------------------------------------------------------------------------------------------
# Popularity, inclusion, sampling
# ----------------------------------------------------------------------------------------------


def zipf_popularity(num_experts: int, s: float) -> torch.Tensor:
    """Expert ``e``'s share of the traffic, proportional to ``(e + 1) ** -s`` (float64, sums to 1).

    Expert 0 is the most popular; ``s = 0`` is uniform. The JavaScript explorer
    (``skew_explorer.js``) computes the same numbers.
    """
    func = "zipf_popularity"
    check_int(func, "num_experts", num_experts, lo=1)
    check_number(func, "s", s, ge=0)
    weights = [(e + 1) ** -float(s) for e in range(num_experts)]
    total = sum(weights)
    return torch.tensor([w / total for w in weights], dtype=torch.float64)


def _as_probabilities(func: str, name: str, values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        check_tensor(func, name, values, ndim=1)
        values = values.detach().to("cpu", torch.float64).numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        fail(func, name, "must be a non-empty 1-D sequence of probabilities", f"shape {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any() or (array > 1 + 1e-12).any():
        fail(func, name, "must hold probabilities in [0, 1]",
             f"values in [{array.min():.6g}, {array.max():.6g}]")
    return np.minimum(array, 1.0)


def inclusion_probabilities(popularity, top_k: int) -> torch.Tensor:
    """Per-expert probability that a token picks it: ``min(1, c * p_e)``, summing to ``top_k``.

    ``c`` is found by capping the most popular experts one at a time: if ``c * p`` would exceed
    1 for the most popular remaining expert, it is fixed at 1 and the remaining ``k - capped``
    is shared out in proportion to the rest. Needs at least ``top_k`` experts with non-zero
    popularity. Returns float64 ``[E]`` in the experts' own order.
    """
    func = "inclusion_probabilities"
    p = _as_probabilities(func, "popularity", popularity)
    num_experts = p.size
    check_int(func, "top_k", top_k, lo=1, hi=num_experts, what_hi="the number of experts")
    if abs(p.sum() - 1.0) > 1e-9:
        fail(func, "popularity", "must sum to 1", f"sum {p.sum():.12g}")
    if int((p > 0).sum()) < top_k:
        fail(func, "popularity", f"must give at least top_k={top_k} experts a non-zero share",
             f"{int((p > 0).sum())} non-zero")
    order = np.argsort(-p, kind="stable")
    ranked = p[order]
    inclusion_ranked = np.ones(num_experts)
    for capped in range(top_k):
        rest = float(ranked[capped:].sum())
        scale = (top_k - capped) / rest
        if scale * ranked[capped] <= 1.0:
            inclusion_ranked[capped:] = scale * ranked[capped:]
            break
    result = np.empty(num_experts)
    result[order] = inclusion_ranked
    return torch.from_numpy(result)


def _check_inclusion(func: str, inclusion, top_k: int) -> np.ndarray:
    pi = _as_probabilities(func, "inclusion", inclusion)
    check_int(func, "top_k", top_k, lo=1, hi=pi.size, what_hi="the number of experts")
    if abs(pi.sum() - top_k) > 1e-6:
        fail(func, "inclusion", f"must sum to top_k={top_k} (one inclusion per pick)",
             f"sum {pi.sum():.9g}")
    return pi


def sample_topk_ids(num_tokens: int, inclusion, top_k: int, *,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw ``top_k`` distinct experts per token; expert ``e`` is picked with probability ``inclusion[e]``.

    Randomized systematic sampling, one independent draw per token: a random order of the
    experts, their inclusion probabilities laid end to end (a total length of ``top_k``), and the
    experts under the points ``u, u+1, ..., u+top_k-1`` for one uniform ``u``. Each expert's
    interval has length at most 1, so it holds at most one point. Returns int32 ``[T, k]`` on
    ``inclusion``'s device (a tensor's, else the CPU), in the draw order rather than sorted.
    ``generator`` must live on that device.
    """
    func = "sample_topk_ids"
    check_int(func, "num_tokens", num_tokens, lo=0)
    device = inclusion.device if isinstance(inclusion, torch.Tensor) else torch.device("cpu")
    pi = torch.from_numpy(_check_inclusion(func, inclusion, top_k)).to(device)
    num_experts = pi.numel()
    order = torch.rand(num_tokens, num_experts, generator=generator, device=device).argsort(dim=1)
    ends = pi[order].cumsum(dim=1)
    # Rounding can leave the last end a hair below k; pin it so the last point always lands.
    ends[:, -1] = float(top_k)
    points = torch.rand(num_tokens, 1, generator=generator, device=device, dtype=torch.float64)
    points = points + torch.arange(top_k, device=device, dtype=torch.float64)
    slots = torch.searchsorted(ends, points, right=True).clamp_(max=num_experts - 1)
    return order.gather(1, slots).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Closed forms
# ----------------------------------------------------------------------------------------------


def _binomial_window(n: int, p: float) -> tuple[int, np.ndarray]:
    """``(lo, probs)``: ``P(X = lo + i) = probs[i]`` for ``X ~ Binomial(n, p)``.

    Built from the mode outwards with the ratio of neighbouring terms, then normalised: no
    factorials, no underflow, and the same arithmetic the JavaScript explorer does. The window
    is ``mode +- (10 sd + 10)``; the mass outside it is below 1e-20.
    """
    if p <= 0.0:
        return 0, np.ones(1)
    if p >= 1.0:
        return n, np.ones(1)
    mode = min(n, math.floor((n + 1) * p))
    half = math.ceil(_WINDOW_SDS * math.sqrt(n * p * (1.0 - p))) + _WINDOW_MARGIN
    lo, hi = max(0, mode - half), min(n, mode + half)
    odds = p / (1.0 - p)
    above = np.arange(mode + 1, hi + 1, dtype=np.float64)
    below = np.arange(mode - 1, lo - 1, -1, dtype=np.float64)
    right = np.cumprod((n - above + 1.0) / above * odds)
    left = np.cumprod((below + 1.0) / (n - below) / odds)
    weights = np.concatenate([left[::-1], [1.0], right])
    return lo, weights / weights.sum()


def _check_batch(func: str, num_tokens: int, inclusion) -> np.ndarray:
    check_int(func, "num_tokens", num_tokens, lo=1)
    pi = _as_probabilities(func, "inclusion", inclusion)
    picks = pi.sum()
    if picks < 1 - 1e-6 or abs(picks - round(picks)) > 1e-6:
        fail(func, "inclusion", "must sum to a whole number k >= 1 (the experts per token)",
             f"sum {picks:.9g}")
    return pi


def expected_rows_per_expert(num_tokens: int, inclusion) -> torch.Tensor:
    """``B * pi_e``: the mean of expert ``e``'s rows (float64 ``[E]``). Exact."""
    pi = _check_batch("expected_rows_per_expert", num_tokens, inclusion)
    return torch.from_numpy(num_tokens * pi)


def expected_experts_touched(num_tokens: int, inclusion) -> float:
    """``sum_e 1 - (1 - pi_e)**B``: experts with at least one row, on average. Exact.

    At ``pi_e = k/E`` this is :func:`moe_kernels.model.costs.experts_touched`.
    """
    pi = _check_batch("expected_experts_touched", num_tokens, inclusion)
    return float(sum(1.0 if q >= 1.0 else -math.expm1(num_tokens * math.log1p(-q)) for q in pi))


def expected_contiguous_rows(num_tokens: int, inclusion, block: int) -> float:
    """``sum_e E[ceil(m_e / b) * b]`` with ``m_e ~ Binomial(B, pi_e)``: the aligned layout's rows.

    Exact (up to the 1e-20 window truncation): each expert's marginal is exactly binomial, and
    the sum needs nothing more. Divide by ``B * k`` for the padding factor.
    """
    func = "expected_contiguous_rows"
    pi = _check_batch(func, num_tokens, inclusion)
    check_int(func, "block", block, lo=1)
    total = 0.0
    values, counts = np.unique(pi, return_counts=True)
    for q, count in zip(values.tolist(), counts.tolist()):
        lo, probs = _binomial_window(num_tokens, q)
        rows = np.arange(lo, lo + probs.size)
        total += count * block * float(probs @ ((rows + block - 1) // block))
    return total


def expected_hottest_rows(num_tokens: int, inclusion, round_to: int = 1) -> float:
    """``E[ceil(M / r) * r]`` for ``M = max_e m_e``, treating the experts' counts as independent.

    ``ceil(M / r) = #{j >= 0 : j r < M}``, so the expectation is ``r * sum_j P(M > j r)`` with
    ``P(M <= m) = prod_e P(m_e <= m)``. The counts are in fact negatively correlated, which makes
    this a slight underestimate (see the module docstring for the size of the error).
    ``round_to = 1`` gives the expected hottest count itself.
    """
    func = "expected_hottest_rows"
    pi = _check_batch(func, num_tokens, inclusion)
    check_int(func, "round_to", round_to, lo=1)
    values, counts = np.unique(pi, return_counts=True)
    windows = [_binomial_window(num_tokens, q) for q in values.tolist()]
    # P(M <= m) = 0 below the highest window start (that expert surely has more rows) and below
    # the mean B k / E (the largest of E counts summing to B k is at least their mean: this
    # floor is exact, and it is what keeps tiny batches right, where independence would allow
    # every expert to be empty). At or past the highest window end, P(M <= m) = 1.
    top_k = round(float(pi.sum()))
    start = max(max(lo for lo, _ in windows), -(-num_tokens * top_k // pi.size))
    end = max(lo + probs.size - 1 for lo, probs in windows)
    first_j = -(-start // round_to)
    points = np.arange(first_j * round_to, end, round_to)
    below = np.ones(points.size)
    for (lo, probs), count in zip(windows, counts.tolist()):
        cdf = np.cumsum(probs)
        index = points - lo
        at = np.where(index < 0, 0.0, np.where(index >= probs.size - 1, 1.0,
                                               cdf[np.clip(index, 0, probs.size - 1)]))
        below *= at ** count
    return round_to * (first_j + float((1.0 - below).sum()))


def expected_masked_rows(num_tokens: int, inclusion, round_to: int) -> float:
    """``E * E[ceil(M / r) * r]``: rows the masked layout reserves when ``m_max`` is the hottest
    expert's count rounded up to ``round_to`` (SGLang's measured cap: 256). See
    :func:`expected_hottest_rows` for the approximation."""
    func = "expected_masked_rows"
    pi = _check_batch(func, num_tokens, inclusion)
    check_int(func, "round_to", round_to, lo=1)
    return pi.size * expected_hottest_rows(num_tokens, pi, round_to)


# ----------------------------------------------------------------------------------------------
# One drawn routing
# ----------------------------------------------------------------------------------------------


class LayoutRows(NamedTuple):
    """Rows of one routing in each layout (see :func:`layout_rows`)."""

    real: int  #: ``B * k`` assignments
    touched: int  #: experts with at least one row
    hottest: int  #: the largest expert's row count
    contiguous: int  #: ``sum_e ceil(m_e / b) * b`` (the alignment's ``num_tokens_post_padded``)
    masked_m_max: int  #: the hottest count rounded up to ``round_to`` (at least ``round_to``)
    masked_reserved: int  #: ``E * masked_m_max``: the slab rows allocated


def layout_rows(topk_ids: torch.Tensor, num_experts: int, block: int, round_to: int) -> LayoutRows:
    """Count the rows each layout handles for the routing ``topk_ids`` (one host read).

    ``block`` is the GEMM's tile height; ``round_to`` is what the masked ``m_max`` is rounded up
    to (:func:`moe_kernels.model.buffers.m_max_measured_cap` uses 256).
    """
    func = "layout_rows"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "block", block, lo=1)
    check_int(func, "round_to", round_to, lo=1)
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        fail(func, "topk_ids", f"must hold expert ids in [0, {num_experts})",
             f"ids in [{int(flat.min())}, {int(flat.max())}]")
    counts = torch.bincount(flat, minlength=num_experts).cpu()
    tiles = (counts + block - 1) // block * block
    hottest = int(counts.max())
    m_max = max(round_to, -(-hottest // round_to) * round_to)
    return LayoutRows(real=flat.numel(), touched=int((counts > 0).sum()), hottest=hottest,
                      contiguous=int(tiles.sum()), masked_m_max=m_max,
                      masked_reserved=num_experts * m_max)


# ----------------------------------------------------------------------------------------------
# The tile height vLLM's tuner picked
# ----------------------------------------------------------------------------------------------

#: ``BLOCK_SIZE_M`` by batch in vLLM's tuned bf16 table for E = 256, N = 512 on an H100
#: (DeepSeek-V3's experts split four ways): vllm-project/vllm
#: ``vllm/model_executor/layers/fused_moe/configs/E=256,N=512,device_name=NVIDIA_H100_80GB_HBM3.json``
#: (commit 1b55f1e9b664c3844552b42749193e7ab3df352c).
VLLM_H100_DSV3_TP4_BLOCK_M: dict[int, int] = {
    1: 16, 2: 16, 4: 16, 8: 16, 16: 16, 24: 16, 32: 16, 48: 16, 64: 16, 96: 16, 128: 16, 256: 16,
    512: 32, 1024: 64, 1536: 64, 2048: 128, 3072: 128, 4096: 128,
}

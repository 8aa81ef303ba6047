"""Capacity factors: the training rule that drops tokens, and the inference rule that never does.

Training frameworks give every expert a buffer of fixed height, so that every tensor in the step
has a static shape. With ``B`` tokens each routed to ``k`` of ``E`` experts there are ``B*k``
assignments, ``B*k/E`` per expert on average; a capacity factor ``alpha`` scales that mean, and
the buffer holds

    ``C = ceil(alpha * B * k / E)`` rows per expert             (:func:`expert_capacity`)

An assignment that arrives at a full expert is *dropped*: that expert contributes nothing to the
token, and only the residual connection (outside the layer) carries the token forward. GShard
(Lepikhin et al. 2020) and Switch Transformer (Fedus et al. 2021) work this way; MegaBlocks
(databricks/megablocks ``megablocks/layers/moe.py``) computes ``capacity_factor * top_k *
tokens / E`` and truncates it with ``int()``, google/flaxformer
(``flaxformer/architectures/moe/moe_layers.py``) rounds ``capacity_factor * tokens / E`` (no
``k``) and never goes below 4 rows. We take the ceiling, so an expert always has at least
``alpha`` times the mean load. With ``alpha = E/k`` the capacity is ``B``, every token could
pick the same expert, and nothing can ever drop: that is the masked layout's token-budget
``m_max`` (``moe_kernels.kernels.masked``), a capacity factor of ``E/k`` in effect.

Which assignments drop is a priority rule (:func:`expert_queue_positions`): every expert serves
the first choices of all tokens (in token order) before any second choice, the second choices
before any third, and so on. That is GShard's top-2 rule and google/flaxformer's
``TokensChooseMaskedRouter`` (``flaxformer/architectures/moe/routing.py``, "top-1 choices have
priority over top-2 choices"); V-MoE's batch-prioritised routing orders by router score
instead, which this module does not implement.

Inference engines drop nothing. :func:`moe_kernels.kernels.dropping.moe_with_capacity` shows what
dropping would do to the output (it reuses the dropless kernel, with the dropped weights zeroed);
:func:`expected_dropped_fraction` predicts how much would drop (exact under the routing model
of :mod:`moe_kernels.model.skew`, where each token includes expert ``e`` with probability ``pi_e``),
and :func:`monte_carlo_dropped_fraction` checks it with that module's sampler. :func:`dropless_buffers` sizes the three ways engines avoid dropping, and
:func:`ensure_capacity` is the rule that keeps a static buffer honest: on overflow it resizes,
falls back to the compact layout, or raises; it never loses a token.

A worked example: four tokens, ``k = 2``, four experts, ``alpha = 1``, so ``C = 2``::

    >>> import torch
    >>> expert_capacity(num_tokens=4, top_k=2, num_experts=4, capacity_factor=1.0)
    2
    >>> ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    >>> expert_queue_positions(ids, num_experts=4).tolist()   # first choices queue first
    [[0, 0], [1, 0], [2, 1], [0, 3]]
    >>> capacity_assign(ids, num_experts=4, capacity=2).tolist()
    [[True, True], [True, True], [False, True], [True, False]]
    >>> dropped_fraction(ids, num_experts=4, capacity=2)      # 2 of 8 assignments
    0.25

Expert 0 is everyone's favourite: tokens 0 and 1 take its two slots with their first choices,
token 2's first choice and token 3's second choice find it full. The expected fraction under
uniform routing, and the rule that a static buffer must grow or fail rather than drop::

    >>> round(expected_dropped_fraction(4, 2, 4, 1.0), 4)
    0.1875
    >>> ensure_capacity(ids, num_experts=4, m_max=2, on_overflow="resize", block=2)
    BufferSpec(layout='masked', m_max=4, rows=16)
    >>> ensure_capacity(ids, num_experts=4, m_max=2)                # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: ensure_capacity: argument 'm_max' must be >= 4 (the hottest expert's row count; ...
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch

from .._checks import ID_DTYPES, check_ids_in_range, check_int, check_number, check_tensor, fail
from .buffers import (
    MASKED_M_BLOCK,
    compact_buffer_bytes,
    expert_counts,
    m_max_measured_cap,
    m_max_token_budget,
    masked_buffer_bytes,
    max_padded_rows,
)
from .skew import inclusion_probabilities, sample_topk_ids

__all__ = [
    "BufferSpec", "DroplessBuffer", "capacity_assign", "dropless_buffers", "dropped_fraction",
    "ensure_capacity", "expected_dropped_fraction", "expert_capacity", "expert_queue_positions",
    "monte_carlo_dropped_fraction",
]


# --------------------------------------------------------------------------------------------
# The capacity and who gets it
# --------------------------------------------------------------------------------------------


def _exact_factor(func: str, capacity_factor: object) -> Fraction:
    """The capacity factor as an exact fraction, read as the decimal it prints as.

    ``1.1 * 10`` in binary floating point is ``11.000000000000002``, whose ceiling is 12; read
    as the decimal ``1.1`` (what the user typed) it is exactly 11.
    """
    check_number(func, "capacity_factor", capacity_factor, gt=0)
    if isinstance(capacity_factor, float):
        return Fraction(repr(float(capacity_factor)))  # float(): numpy floats repr as np.float64(...)
    return Fraction(capacity_factor)


def _check_routing(func: str, num_tokens: int, top_k: int, num_experts: int) -> None:
    check_int(func, "num_tokens", num_tokens, lo=0)
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "top_k", top_k, lo=1, hi=num_experts, what_hi="num_experts")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert under a capacity factor: ``ceil(alpha * B * k / E)``.

    Computed exactly (no floating-point ceiling surprises). ``alpha = E/k`` gives ``B``, the
    most any expert can receive when a token names each expert at most once.

        >>> expert_capacity(4096, 8, 256, 1.25)      # DeepSeek-V3: mean load 128 rows
        160
        >>> expert_capacity(10, 1, 1, 1.1)           # exactly 11, not 12
        11
        >>> expert_capacity(100, 8, 256, 256 / 8)    # alpha = E/k: room for the whole batch
        100
    """
    return _capacity("expert_capacity", num_tokens, top_k, num_experts, capacity_factor)


def _capacity(func: str, num_tokens: int, top_k: int, num_experts: int, capacity_factor) -> int:
    _check_routing(func, num_tokens, top_k, num_experts)
    alpha = _exact_factor(func, capacity_factor)
    return math.ceil(alpha * num_tokens * top_k / num_experts)


def _check_ids(func: str, topk_ids: object, num_experts: int) -> torch.Tensor:
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES)
    check_int(func, "num_experts", num_experts, lo=1)
    check_ids_in_range(func, "topk_ids", topk_ids, num_experts, on_device=False)
    return topk_ids


def _queue_positions(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    # Flatten in priority order (choice j of every token before choice j+1 of any), then a
    # stable sort by expert keeps that order inside each expert's queue; an assignment's place
    # in its queue is its rank in the sorted list minus where its expert's run begins.
    num_tokens, topk = topk_ids.shape
    in_priority = topk_ids.t().reshape(-1).to(torch.int64)
    order = torch.sort(in_priority, stable=True).indices
    counts = expert_counts(topk_ids, num_experts).to(torch.int64)
    run_start = torch.cumsum(counts, 0) - counts
    ranks = torch.arange(in_priority.numel(), device=topk_ids.device)
    positions = torch.empty_like(in_priority)
    positions[order] = ranks - run_start[in_priority[order]]
    return positions.view(topk, num_tokens).t().contiguous()


def expert_queue_positions(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each assignment's place (0-based) in its expert's queue, int64 ``[T, k]``.

    Priority: all first choices in token order, then all second choices in token order, and so
    on (GShard, flaxformer). Vectorised: one stable sort, no loop over tokens. Validates the ids
    (one device-to-host read).
    """
    topk_ids = _check_ids("expert_queue_positions", topk_ids, num_experts)
    return _queue_positions(topk_ids, num_experts)


def capacity_assign(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The keep mask (bool ``[T, k]``): True where the assignment got one of its expert's
    ``capacity`` slots, under :func:`expert_queue_positions`' priority.

    No expert keeps more than ``capacity`` assignments, and an expert with at most ``capacity``
    assignments keeps them all.
    """
    func = "capacity_assign"
    topk_ids = _check_ids(func, topk_ids, num_experts)
    check_int(func, "capacity", capacity, lo=0)
    return _queue_positions(topk_ids, num_experts) < capacity


def dropped_fraction(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> float:
    """Fraction of the ``T*k`` assignments that find their expert full: ``sum_e max(m_e - C, 0) / (T k)``.

    The count does not depend on the priority rule, only on the loads ``m_e``.
    """
    func = "dropped_fraction"
    topk_ids = _check_ids(func, topk_ids, num_experts)
    check_int(func, "capacity", capacity, lo=0)
    if topk_ids.numel() == 0:
        return 0.0
    overflow = (expert_counts(topk_ids, num_experts).to(torch.int64) - capacity).clamp(min=0).sum()
    return int(overflow) / topk_ids.numel()


# --------------------------------------------------------------------------------------------
# How much drops: a routing model, the exact expectation, and sampling
# --------------------------------------------------------------------------------------------


def _popularity_or_uniform(func: str, popularity, num_experts: int, top_k: int) -> torch.Tensor:
    if popularity is None:
        return torch.full((num_experts,), top_k / num_experts, dtype=torch.float64)
    check_tensor(func, "popularity", popularity, ndim=1)
    if popularity.numel() != num_experts:
        fail(func, "popularity", f"must have num_experts={num_experts} entries",
             f"{popularity.numel()} entries")
    return inclusion_probabilities(popularity, top_k)


def expected_dropped_fraction(num_tokens: int, top_k: int, num_experts: int,
                              capacity_factor: float, popularity: torch.Tensor | None = None) -> float:
    """Expected fraction of assignments dropped at capacity ``C = ceil(alpha B k / E)``.

    Tokens route independently and include expert ``e`` with probability ``pi_e`` (``k/E``
    under uniform routing, :func:`moe_kernels.model.skew.inclusion_probabilities` of ``popularity``
    otherwise, e.g. :func:`moe_kernels.model.skew.zipf_popularity`), so expert ``e``'s load is
    ``m_e ~ Binomial(B, pi_e)`` and, by linearity of expectation, the expected overflow is
    ``sum_e E[max(m_e - C, 0)]``, exactly; divided by ``B k``. The sum runs over every load
    above ``C`` in float64 (``E * (B - C)`` terms), no approximation.
    """
    func = "expected_dropped_fraction"
    capacity = _capacity(func, num_tokens, top_k, num_experts, capacity_factor)
    pi = _popularity_or_uniform(func, popularity, num_experts, top_k)
    if num_tokens == 0 or capacity >= num_tokens:
        return 0.0
    loads = torch.arange(capacity + 1, num_tokens + 1, dtype=torch.float64)
    log_choose = (math.lgamma(num_tokens + 1) - torch.lgamma(loads + 1)
                  - torch.lgamma(num_tokens - loads + 1))
    # xlogy gives 0 * log 0 = 0, so pi = 0 and pi = 1 need no special case.
    log_pmf = (log_choose + torch.xlogy(loads, pi[:, None])
               + torch.xlogy(num_tokens - loads, 1 - pi[:, None]))
    overflow = (torch.exp(log_pmf) * (loads - capacity)).sum()
    return float(overflow) / (num_tokens * top_k)


def monte_carlo_dropped_fraction(num_tokens: int, top_k: int, num_experts: int,
                                 capacity_factor: float, popularity: torch.Tensor | None = None,
                                 *, trials: int = 16, seed: int = 0) -> float:
    """The same expectation estimated by sampling: the mean of :func:`dropped_fraction` over
    ``trials`` routings drawn by :func:`moe_kernels.model.skew.sample_topk_ids` (seeded, so
    repeatable)."""
    func = "monte_carlo_dropped_fraction"
    capacity = _capacity(func, num_tokens, top_k, num_experts, capacity_factor)
    check_int(func, "trials", trials, lo=1)
    check_int(func, "seed", seed)
    pi = _popularity_or_uniform(func, popularity, num_experts, top_k)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(trials):
        ids = sample_topk_ids(num_tokens, pi, top_k, generator=generator)
        total += dropped_fraction(ids, num_experts, capacity)
    return total / trials


# --------------------------------------------------------------------------------------------
# The dropless alternatives: what they cost, and the rule for static buffers
# --------------------------------------------------------------------------------------------


class DroplessBuffer(NamedTuple):
    """One way to hold every assignment, sized for one batch.

    * ``strategy``: its name;
    * ``rows``: rows of the ``[rows, d]`` and ``[rows, F]`` intermediates;
    * ``nbytes``: their peak bytes (``moe_kernels.kernels.masked``'s byte functions);
    * ``capacity_factor``: ``rows / (T k)``, the capacity factor the buffer amounts to;
    * ``host_sync``: whether sizing it needs a device-to-host read (not allowed in CUDA graphs).
    """

    strategy: str
    rows: int
    nbytes: int
    capacity_factor: float
    host_sync: bool


def dropless_buffers(topk_ids: torch.Tensor, num_experts: int, hidden_size: int,
                     intermediate_size: int, dtype: torch.dtype, *, align: int = 128,
                     m_block: int = MASKED_M_BLOCK) -> list[DroplessBuffer]:
    """The three dropless buffer strategies for this routing, each in a :class:`DroplessBuffer`.

    * **compact**: packed segments, each aligned to ``align`` rows, sized for the worst routing
      of ``T k`` assignments (:func:`moe_kernels.model.buffers.max_padded_rows`, SGLang's compact
      bound; vLLM's alignment reserves ``T k + E (align - 1)`` index slots, never fewer);
    * **masked, token budget**: ``[E, m_max, d]`` slabs with ``m_max`` room for the whole batch
      (SGLang's default), a capacity factor of about ``E/k``;
    * **masked, measured cap**: ``m_max`` = the hottest expert's count rounded up to
      ``m_block`` (SGLang's opt-in ``SGLANG_OPT_DG_MASKED_M_CAP``), one host read per layer.

        >>> from moe_kernels.model.skew import sample_topk_ids
        >>> ids = sample_topk_ids(4096, torch.full((256,), 8 / 256, dtype=torch.float64), 8,
        ...                       generator=torch.Generator().manual_seed(0))
        >>> for b in dropless_buffers(ids, 256, 7168, 2048, torch.bfloat16):   # DeepSeek-V3
        ...     print(f"{b.strategy:24s} {b.nbytes / 1e9:6.2f} GB  alpha {b.capacity_factor:5.2f}")
        compact                    1.20 GB  alpha  1.99
        masked, token budget      20.54 GB  alpha 34.00
        masked, measured cap       1.21 GB  alpha  2.00
    """
    func = "dropless_buffers"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES)
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "align", align, lo=1)
    check_int(func, "m_block", m_block, lo=1)
    num_tokens, topk = topk_ids.shape
    if num_tokens == 0 or topk == 0:
        fail(func, "topk_ids", "must hold at least one assignment", f"shape {tuple(topk_ids.shape)}")
    shape = (hidden_size, intermediate_size, dtype)
    assignments = num_tokens * topk
    compact_rows = max_padded_rows(assignments, num_experts, align)
    budget = m_max_token_budget(num_tokens, m_block)
    cap = m_max_measured_cap(topk_ids, num_experts, m_block)
    return [
        DroplessBuffer("compact", compact_rows,
                       compact_buffer_bytes(num_tokens, topk, num_experts, *shape, align=align),
                       compact_rows / assignments, False),
        DroplessBuffer("masked, token budget", num_experts * budget,
                       masked_buffer_bytes(num_experts, budget, *shape),
                       num_experts * budget / assignments, False),
        DroplessBuffer("masked, measured cap", num_experts * cap,
                       masked_buffer_bytes(num_experts, cap, *shape),
                       num_experts * cap / assignments, True),
    ]


class BufferSpec(NamedTuple):
    """What to allocate so that every assignment fits (:func:`ensure_capacity`).

    ``layout`` is ``"masked"`` (``[E, m_max, d]`` slabs, ``rows = E * m_max``) or ``"compact"``
    (packed aligned segments, ``m_max`` None, ``rows`` = the worst-case padded row count).
    """

    layout: str
    m_max: int | None
    rows: int


_OVERFLOW_POLICIES = ("raise", "resize", "compact")


def ensure_capacity(topk_ids: torch.Tensor, num_experts: int, m_max: int, *,
                    on_overflow: str = "raise", block: int = MASKED_M_BLOCK,
                    align: int = 128) -> BufferSpec:
    """Check a static masked buffer of ``m_max`` rows per expert against this routing.

    If the hottest expert fits, the buffer stands. If not, ``on_overflow`` decides, and no
    choice loses a token:

    * ``"raise"``: ValueError naming ``m_max`` and the row count needed;
    * ``"resize"``: a masked buffer whose ``m_max`` is the hottest count rounded up to ``block``;
    * ``"compact"``: fall back to the packed layout, which holds any routing of ``T k``
      assignments (segments aligned to ``align``).

    Costs one device-to-host read (the ids' range and the hottest count together), which is why
    an engine cannot run it inside a CUDA graph and sizes captured buffers for the worst case.
    """
    func = "ensure_capacity"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES)
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "m_max", m_max, lo=1)
    check_int(func, "block", block, lo=1)
    check_int(func, "align", align, lo=1)
    if on_overflow not in _OVERFLOW_POLICIES:
        fail(func, "on_overflow", f"must be one of {', '.join(map(repr, _OVERFLOW_POLICIES))}",
             repr(on_overflow))
    hottest = 0
    if topk_ids.numel():
        counts = expert_counts(topk_ids, num_experts)
        lo, hi, hottest = torch.stack([topk_ids.min().to(torch.int64), topk_ids.max().to(torch.int64),
                                       counts.max().to(torch.int64)]).tolist()
        if lo < 0 or hi >= num_experts:
            fail(func, "topk_ids", f"must hold expert ids in [0, {num_experts})", f"ids in [{lo}, {hi}]")
    if hottest <= m_max:
        return BufferSpec("masked", m_max, num_experts * m_max)
    if on_overflow == "resize":
        resized = -(-hottest // block) * block
        return BufferSpec("masked", resized, num_experts * resized)
    if on_overflow == "compact":
        return BufferSpec("compact", None, max_padded_rows(topk_ids.numel(), num_experts, align))
    fail(func, "m_max", f"must be >= {hottest} (the hottest expert's row count; a static buffer "
         "that overflows must grow or fail, never drop a token)", m_max)

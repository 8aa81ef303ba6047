"""Masked layout: every expert gets a fixed ``[m_max, d]`` slab, and ``masked_m`` says how much is used.

The contiguous layout (:mod:`moe_kernels.kernels.permute`) packs the experts' rows end to end, so
its row count is known only up to a bound. The masked layout gives up on packing: the buffer is
``[E, m_max, d]``, expert ``e``'s rows are ``rows[e, :masked_m[e]]``, and every shape is fixed by
``(E, m_max, d)`` alone, which is what CUDA graphs want. DeepGEMM's ``m_grouped_*_gemm_nt_masked``
consumes it, SGLang fills it with ``fused_moe_dispatch_index`` (offsets ``e*m_max + slot``;
sgl-project/sglang ``python/sglang/kernels/ops/moe/ep_moe_kernels.py``), and vLLM's
``BatchedPrepareAndFinalize`` builds the same ``[E_local, m_max, d]`` shape. How big ``m_max``
must be, and what the slabs cost, is arithmetic: :mod:`moe_kernels.model.buffers`.

A token is never dropped: :func:`masked_dispatch` counts every assignment (including any that do
not fit) and fails when the hottest expert overflows ``m_max``: with a ValueError naming ``m_max``
and the count needed on the CPU, with a device-side assert on a GPU (no host sync, so the
dispatch can be captured in a CUDA graph). The grouped GEMM (:func:`grouped_gemm_masked`) launches
a program for every ``BLOCK_M`` tile of every slab; a tile past ``masked_m[e]`` exits after one
scalar load, so unused capacity costs launch slots, not FLOPs. The gather back is
:func:`moe_kernels.kernels.combine.unpermute`: ``src2dst`` indexes rows of the flattened
``[E*m_max, d]`` buffer, the same convention as a packed buffer's rows.

A worked example: three tokens, ``k = 2``, three experts, ``m_max = 4``::

    >>> import torch
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> ids = torch.tensor([[1, 0], [1, 2], [0, 1]])
    >>> d = masked_dispatch(x, ids, 3, m_max=4)
    >>> d.rows.shape, d.masked_m.tolist()
    (torch.Size([3, 4, 2]), [2, 3, 1])
    >>> torch.equal(d.rows.view(12, 2)[d.src2dst[1, 1]], x[1])   # row e*m_max + slot
    True
    >>> masked_dispatch(x, ids, 3, m_max=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: masked_dispatch: argument 'm_max' must be >= 3 (the hottest expert's row count; ...
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import check_dispatch_inputs, check_int, check_moe_inputs, check_tensor, device_id_check, fail
from .._runtime import HAS_TRITON, cdiv, device_assert_options, kernel, next_power_of_2, note_launch, tl, use_triton
from ..model.buffers import expert_counts, m_max_token_budget
from ._gemm_operands import check_out, expert_rows_product, gemm_width, in_float32_under_interpreter
from ._tile_gemm import dot_precision
from .combine import unpermute
from .config import MoEConfig, check_config, get_config
from .formats import WeightFormat
from .layouts import LAYOUTS

if HAS_TRITON:
    from ._tile_gemm import expert_tile_product, store_tile
    from .permute import copy_rows

    @kernel
    def _masked_dispatch_kernel(
        hidden_ptr, stride_ht, ids_ptr, stride_it, rows_ptr, stride_re, stride_rm, counts_ptr, src2dst_ptr,
        num_assignments, topk, num_experts, m_max, hidden_size,
        BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr, ID_CHECK: tl.constexpr, OVERFLOW_CHECK: tl.constexpr,
    ):
        assignment = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
        in_range = assignment < num_assignments
        token = assignment // topk
        expert = tl.load(ids_ptr + token * stride_it + assignment % topk, mask=in_range, other=-1).to(tl.int32)
        # Bad ids are never used as an address; the id check (when asked) stops the kernel here.
        valid = in_range & (expert >= 0) & (expert < num_experts)
        if ID_CHECK != "":
            tl.device_assert(valid | ~in_range, ID_CHECK)
        expert = tl.where(valid, expert, 0)
        # Every valid assignment is counted, even one that will not fit: a slot past m_max is the
        # overflow, which stops the kernel (no token is ever dropped silently).
        slot = tl.atomic_add(counts_ptr + expert, 1, mask=valid)
        if OVERFLOW_CHECK != "":
            tl.device_assert(~valid | (slot < m_max), OVERFLOW_CHECK)
        fits = valid & (slot < m_max)
        tl.store(src2dst_ptr + assignment, tl.where(fits, expert * m_max + slot, -1), mask=in_range)
        copy_rows(hidden_ptr, token.to(tl.int64) * stride_ht, rows_ptr,
                  expert.to(tl.int64) * stride_re + slot.to(tl.int64) * stride_rm, fits, hidden_size, BLOCK_D)

    @kernel
    def _masked_gemm_kernel(
        a_ptr, stride_ae, stride_am, w_ptr, stride_we, stride_wn, out_ptr, stride_oe, stride_om,
        masked_m_ptr, m_max, tiles_per_expert, N, K,
        GATED: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # >>> book: masked-early-exit
        pid = tl.program_id(0)
        expert = pid // tiles_per_expert
        first_row = (pid % tiles_per_expert) * BLOCK_M
        rows_used = tl.minimum(tl.load(masked_m_ptr + expert), m_max)
        if first_row >= rows_used:
            # (DeepGEMM's masked scheduler likewise runs only ceil(masked_m / BLOCK_M) tiles)
            return
        rows = first_row + tl.arange(0, BLOCK_M)
        row_real = rows < rows_used
        slab = expert.to(tl.int64)
        # Rows past masked_m read the tile's first row (real), so the loads need no row mask.
        a_rows = tl.where(row_real, rows, first_row).to(tl.int64) * stride_am
        acc = expert_tile_product(
            a_ptr + slab * stride_ae, a_rows, w_ptr + slab * stride_we, stride_wn,
            tl.program_id(1), N, K, a_ptr, a_rows, w_ptr, 0, 0,
            GATED, EVEN_K, INPUT_PRECISION, 0, BLOCK_M, BLOCK_N, BLOCK_K)
        store_tile(out_ptr + slab * stride_oe, rows.to(tl.int64) * stride_om, row_real, acc,
                   tl.program_id(1), N, BLOCK_N)
        # <<< book: masked-early-exit


class MaskedRows(NamedTuple):
    """The masked layout: what :func:`masked_dispatch` returns.

    * ``rows`` ``[E, m_max, d]``: expert ``e``'s rows are ``rows[e, :masked_m[e]]``; the rest of
      each slab is left unwritten and no kernel reads it.
    * ``masked_m`` int32 ``[E]``: rows used per expert.
    * ``src2dst`` int32 ``[T, k]``: ``e*m_max + slot``, the row of assignment ``(t, j)`` in
      ``rows.view(E*m_max, d)``. Order inside a slab is not specified (atomics on the GPU).
    """

    rows: torch.Tensor
    masked_m: torch.Tensor
    src2dst: torch.Tensor


def _check_dispatch_args(func, hidden_states, topk_ids, num_experts, m_max):
    check_dispatch_inputs(func, hidden_states, topk_ids, num_experts)
    check_int(func, "m_max", m_max, lo=1)


def _check_no_overflow(func: str, counts: torch.Tensor, m_max: int) -> None:
    """The hottest expert must fit: ValueError on the CPU, a device-side assert on a GPU."""
    if counts.is_cuda:
        torch._assert_async(counts.max() <= m_max,
                            f"{func}: argument 'm_max' ({m_max}) is smaller than the hottest expert's row "
                            "count (no token may be dropped)")
        return
    hottest = int(counts.max())
    if hottest > m_max:
        fail(func, "m_max", f"must be >= {hottest} (the hottest expert's row count; no token is dropped)", m_max)


def masked_dispatch(hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, m_max: int,
                    out: torch.Tensor | None = None, validate_ids: bool = True) -> MaskedRows:
    """Copy each assignment's row into slot ``masked_m[e]++`` of its expert's ``[m_max, d]`` slab.

    One Triton kernel claims slots with an atomic counter per expert and copies the rows. The
    overflow check (``m_max`` too small for the hottest expert) always runs; ``validate_ids`` also
    checks every id lies in ``[0, E)``. On a GPU both are device-side asserts in the dispatch
    kernel itself (no launch, no host sync); on the CPU, ValueErrors. ``out``, if given, is the
    ``[E, m_max, d]`` buffer to fill.
    """
    func = "masked_dispatch"
    _check_dispatch_args(func, hidden_states, topk_ids, num_experts, m_max)
    id_check = device_id_check(func, "topk_ids", topk_ids, num_experts) if validate_ids else ""
    num_tokens, hidden_size = hidden_states.shape
    topk = topk_ids.shape[1]
    rows = check_out(func, out, (num_experts, m_max, hidden_size), hidden_states)
    if not use_triton(hidden_states, topk_ids, rows):
        return _masked_dispatch_reference(hidden_states, topk_ids, num_experts, m_max, rows)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=rows.device)
    src2dst = torch.empty(num_tokens, topk, dtype=torch.int32, device=rows.device)
    if num_tokens * topk:
        block_a, block_d = 16, min(next_power_of_2(max(hidden_size, 1)), 256)
        # (m_max stays out of the message: a message is a compile-time constant, one kernel per text.)
        overflow = f"{func}: argument 'm_max' is smaller than the hottest expert's row count (no token may be dropped)"
        note_launch("masked.dispatch", id_check=bool(id_check))
        _masked_dispatch_kernel[(cdiv(num_tokens * topk, block_a),)](
            hidden_states, hidden_states.stride(0), topk_ids, topk_ids.stride(0),
            rows, rows.stride(0), rows.stride(1), counts, src2dst,
            num_tokens * topk, topk, num_experts, m_max, hidden_size,
            BLOCK_A=block_a, BLOCK_D=block_d, ID_CHECK=id_check, OVERFLOW_CHECK=overflow if counts.is_cuda else "",
            num_warps=4, **device_assert_options(overflow if counts.is_cuda else ""),
        )
    if not counts.is_cuda:   # the interpreter: the host check (on a GPU the kernel asserts)
        _check_no_overflow(func, counts, m_max)
    return MaskedRows(rows, counts, src2dst)


def _masked_dispatch_reference(hidden_states, topk_ids, num_experts, m_max, rows):
    counts = expert_counts(topk_ids, num_experts)
    _check_no_overflow("masked_dispatch", counts, m_max)
    flat = topk_ids.flatten().to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    order = torch.sort(torch.where(valid, flat, num_experts), stable=True).indices
    first = torch.cumsum(counts.to(torch.int64), 0) - counts
    slot = torch.full_like(flat, -1)
    position = torch.arange(flat.numel(), device=flat.device)
    ranked = order[: int(valid.sum())]
    slot[ranked] = position[: ranked.numel()] - first[flat[ranked]]
    rows[flat[valid], slot[valid]] = hidden_states[position[valid] // topk_ids.shape[1]]
    src2dst = torch.where(valid, flat * m_max + slot, -1).to(torch.int32).view(topk_ids.shape)
    return MaskedRows(rows, counts, src2dst)


def masked_dispatch_reference(hidden_states, topk_ids, num_experts, *, m_max):
    """Torch reference for :func:`masked_dispatch` (slots in assignment order; unused rows zero)."""
    _check_dispatch_args("masked_dispatch", hidden_states, topk_ids, num_experts, m_max)
    rows = hidden_states.new_zeros(num_experts, m_max, hidden_states.shape[1])
    return _masked_dispatch_reference(hidden_states, topk_ids, num_experts, m_max, rows)


def grouped_gemm_masked(x: torch.Tensor, w: torch.Tensor, masked_m: torch.Tensor, *, silu_mul: bool = False,
                        out: torch.Tensor | None = None, config: MoEConfig | None = None,
                        which: str = "gate_up") -> torch.Tensor:
    """``out[e, :masked_m[e]] = x[e, :masked_m[e]] @ w[e]^T`` for every expert ``e``.

    ``x`` ``[E, m_max, K]``, ``w`` ``[E, N_w, K]``; returns ``[E, m_max, N_w]`` (or
    ``[E, m_max, N_w/2]`` of ``silu(gate) * up`` when ``silu_mul``). Rows at or past ``masked_m[e]``
    are not stored. ``which`` picks the GEMM tiles of ``config`` (``gate_up``/``down``).
    """
    func = "grouped_gemm_masked"
    check_tensor(func, "x", x, ndim=3, last_dim_contiguous=True)
    check_tensor(func, "w", w, ndim=3, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
    check_tensor(func, "masked_m", masked_m, ndim=1, dtypes=(torch.int32,), device=x.device, contiguous=True)
    num_experts, m_max, k = x.shape
    if w.shape[0] != num_experts or w.shape[2] != k:
        fail(func, "w", f"must have shape [{num_experts}, N, {k}] to match x", f"shape {tuple(w.shape)}")
    if masked_m.shape[0] != num_experts:
        fail(func, "masked_m", f"must have shape [{num_experts}]", f"shape {tuple(masked_m.shape)}")
    n = gemm_width(func, w, silu_mul)
    if config is None:
        config = get_config(m_max, num_experts, n, k, x.dtype, x.device, layout="masked")
    if which not in ("gate_up", "down"):
        fail(func, "which", "must be 'gate_up' or 'down'", repr(which))
    tiles = getattr(check_config(func, config, layout="masked"), which)
    result = check_out(func, out, (num_experts, m_max, n), x)
    if not use_triton(x, w, masked_m, result):
        return _grouped_gemm_masked_reference(x, w, masked_m, silu_mul, result)
    rerun = lambda x, w, out: grouped_gemm_masked(x, w, masked_m, silu_mul=silu_mul, out=out,  # noqa: E731
                                                  config=config, which=which)
    if in_float32_under_interpreter(rerun, result, x, w) is not None:
        return result
    tiles_per_expert = cdiv(m_max, config.block_m)
    _masked_gemm_kernel[(num_experts * tiles_per_expert, cdiv(n, tiles.block_n))](
        x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1), result, result.stride(0), result.stride(1),
        masked_m, m_max, tiles_per_expert, n, k,
        GATED=silu_mul, EVEN_K=k % tiles.block_k == 0, INPUT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=config.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return result


def _grouped_gemm_masked_reference(x, w, masked_m, silu_mul, out):
    for e, used in enumerate(masked_m.clamp(min=0, max=x.shape[1]).tolist()):
        out[e, :used] = expert_rows_product(x[e, :used], w[e], silu_mul).to(out.dtype)
    return out


def masked_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, m_max: int | None = None, config: MoEConfig | None = None,
                   validate_ids: bool = True, w1_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE experts step in the masked layout: dispatch, two masked GEMMs, gather back.

    Same arguments and result as :func:`moe_kernels.kernels.index_gather.fused_experts`. ``m_max``
    defaults to :func:`~moe_kernels.model.buffers.m_max_token_budget` of the batch; pass
    :func:`~moe_kernels.model.buffers.m_max_measured_cap` (or any value) to shrink the slabs. Too
    small an ``m_max`` fails loudly (see :func:`masked_dispatch`); nothing is dropped. fp8
    weights (``w1_scale``/``w2_scale``) are refused by name: this layout runs 16/32-bit weights
    only (:mod:`moe_kernels.kernels.layouts`).
    """
    func = "masked_experts"
    num_tokens, _, num_experts, hidden_size, f = check_moe_inputs(func, hidden_states, w1, w2, topk_weights,
                                                                  topk_ids)
    LAYOUTS["masked"].check_format(func, WeightFormat.of_pair(func, w1, w2, w1_scale, w2_scale))
    if m_max is None:
        m_max = m_max_token_budget(num_tokens)
    check_int(func, "m_max", m_max, lo=1)
    if config is None:
        config = get_config(m_max, num_experts, f, hidden_size, hidden_states.dtype, hidden_states.device,
                            layout="masked")
    check_config(func, config, layout="masked")
    dispatched = masked_dispatch(hidden_states, topk_ids, num_experts, m_max=m_max, validate_ids=validate_ids)
    activated = grouped_gemm_masked(dispatched.rows, w1, dispatched.masked_m, silu_mul=True, config=config,
                                    which="gate_up")
    y = grouped_gemm_masked(activated, w2, dispatched.masked_m, out=dispatched.rows, config=config, which="down")
    return unpermute(y.view(num_experts * m_max, hidden_size), dispatched.src2dst, topk_weights)
